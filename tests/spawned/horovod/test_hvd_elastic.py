"""hvd.elastic: TorchState's commit/restore/sync and its commits on disk in one process, run()'s
failure path, and, end to end under torchring-run --max-restarts, a rank killed mid-training
that ends the job with the same final model as a run without the failure."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _dist import run_alone, spawn

ROOT = Path(__file__).resolve().parents[3]


def _objects(seed: int) -> tuple[Any, Any, Any]:
    """A model with integer weights, an SGD with momentum, and an ElasticSampler over 16 items."""
    from torchring.horovod import elastic
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(4.).reshape(2, 2) + seed)
        model.bias.fill_(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    return model, opt, elastic.ElasticSampler(list(range(16)), shuffle=False)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()


def _snapshot(state: Any) -> dict[str, Any]:
    return copy.deepcopy({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                          "sampler": state.sampler.state_dict(), "epoch": state.epoch,
                          "note": state.note})


def _commit_and_restore(rank: int) -> dict[str, Any]:
    from torchring._core.errors import CollectiveMismatchError
    from torchring.horovod import elastic, exceptions, runtime
    runtime.init()
    model, opt, sampler = _objects(seed=1)
    state = elastic.TorchState(model, opt, sampler=sampler, epoch=0, note="start")
    state.sync()
    assert state.epoch == 0 and state.note == "start" and state.model is model
    _step(model, opt)
    sampler.record_batch(0, 4)
    state.epoch, state.note = 1, "committed"
    state.commit()
    committed = _snapshot(state)

    _step(model, opt)  # not committed: undone by restore()
    sampler.record_batch(1, 4)
    state.epoch, state.note = 2, "lost"
    assert not torch.equal(model.weight, committed["model"]["weight"])
    state.restore()
    assert _snapshot(state)["note"] == "committed" and state.epoch == 1
    assert all(torch.equal(v, committed["model"][k]) for k, v in model.state_dict().items())
    assert sampler.processed_num == 4 and len(sampler) == 12
    momentum = committed["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum)
    _step(model, opt)  # the restored state is a copy: stepping it leaves the commit intact
    state.restore()
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum)

    # run(): a collective failure restores the last commit, re-forms the world in process (here
    # a world of 1 again, epoch 1) and runs the function again from the commit
    seen: list[tuple[int, int]] = []

    @elastic.run
    def fails_once(state: Any) -> int:
        from torchring.elastic import world
        seen.append((state.epoch, world.epoch()))
        if len(seen) == 1:
            _step(state.model, state.optimizer)
            state.epoch = 5
            raise runtime.basics.HorovodInternalError("a peer died")
        assert all(torch.equal(v, committed["model"][k]) for k, v in state.model.state_dict().items())
        return len(seen)

    assert fails_once(state) == 2 and seen == [(1, 0), (1, 1)] and runtime.basics.is_initialized()

    # under torchrun's agent (TORCHELASTIC_RUN_ID), the failure restores and is raised again for
    # the launcher, which restarts every rank
    @elastic.run
    def fails(state: Any) -> None:
        _step(state.model, state.optimizer)
        state.epoch = 5
        raise runtime.basics.HorovodInternalError("a peer died")

    os.environ["TORCHELASTIC_RUN_ID"] = "test"
    try:
        with pytest.raises(runtime.basics.HorovodInternalError, match="a peer died"):
            fails(state)
    finally:
        del os.environ["TORCHELASTIC_RUN_ID"]
    assert state.epoch == 1
    assert all(torch.equal(v, committed["model"][k]) for k, v in model.state_dict().items())

    # a mismatch left the communicator usable: it reaches the caller, nothing is restored
    @elastic.run
    def disagrees(state: Any) -> None:
        state.epoch = 6
        raise exceptions.to_horovod(CollectiveMismatchError("rank 1 sent [4]"))

    with pytest.raises(runtime.basics.HorovodInternalError, match=r"rank 1 sent \[4\]"):
        disagrees(state)
    assert state.epoch == 6
    state.restore()

    # HostsUpdatedInterrupt (raised by user code here) resets in place: re-form, callbacks, again
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(runtime.basics.size())])

    @elastic.run
    def interrupted(state: Any, attempts: list[int]) -> int:
        attempts.append(state.epoch)
        if len(attempts) == 1:
            raise elastic.HostsUpdatedInterrupt(skip_sync=False)
        return len(attempts)

    assert interrupted(state, []) == 2 and resets == [1] and runtime.basics.is_initialized()

    # a new model given to the state is tracked (and saved) from then on
    other = torch.nn.Linear(2, 2)
    state.model = other
    with torch.no_grad():
        other.bias.fill_(100.0)
    state.restore()
    assert other.bias.tolist() != [100.0, 100.0]
    runtime.shutdown()
    return _to_bytes(committed)  # tensors cross the pipe as bytes (shared memory dies with us)


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _resume(rank: int, committed_bytes: bytes | None) -> list[str]:
    """A fresh process, built from other values: run() syncs it to the commit on disk (if any)."""
    from torchring.horovod import elastic, runtime
    committed = None if committed_bytes is None else torch.load(io.BytesIO(committed_bytes))
    runtime.init()
    model, opt, sampler = _objects(seed=7)
    state = elastic.TorchState(model, opt, sampler=sampler, epoch=0, note="fresh")
    calls: list[str] = []
    state.register_reset_callbacks([lambda: calls.append("reset")])

    @elastic.run
    def train(state: Any) -> None:
        calls.append(f"train at epoch {state.epoch}")
        if committed is None:
            assert state.note == "fresh" and torch.equal(model.bias, torch.full((2,), 7.0))
            return
        got = _snapshot(state)
        assert got["note"] == "committed" and got["epoch"] == 1
        assert all(torch.equal(v, committed["model"][k]) for k, v in got["model"].items())
        assert torch.equal(got["optimizer"]["state"][0]["momentum_buffer"],
                           committed["optimizer"]["state"][0]["momentum_buffer"])
        assert got["sampler"] == committed["sampler"] and len(sampler) == 12

    train(state)
    runtime.shutdown()
    return calls


def test_commit_restore_and_resume_from_disk(tmp_path: Path) -> None:
    env = {"TORCHRING_ELASTIC_DIR": str(tmp_path)}
    committed = run_alone(_commit_and_restore, env=env)
    assert sorted(os.listdir(tmp_path)) == ["state0-rank0.pt"]
    # the job restarted by its launcher: the commit on disk is resumed, then the reset callbacks
    calls = run_alone(_resume, committed, env=dict(env, TORCHELASTIC_RESTART_COUNT="1"))
    assert calls == ["reset", "train at epoch 1"]
    # a new job (no restart) ignores an earlier job's file, and removes it
    calls = run_alone(_resume, None, env=dict(env, TORCHELASTIC_RESTART_COUNT="0"))
    assert calls == ["train at epoch 0"] and os.listdir(tmp_path) == []


def _launch(tmp_path: Path, name: str, launcher: list[str], script: list[str]) -> str:
    """Runs examples/horovod_elastic.py on 2 ranks; the final model goes to tmp_path/name."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHRING_TIMEOUT="20",
               TORCHRING_ELASTIC_DIR=str(tmp_path / f"commits-{name}"))
    cmd = [sys.executable, "-m", "torchring.run", "-np", "2", *launcher,
           str(ROOT / "examples/horovod_elastic.py"), "--save", str(tmp_path / name), *script]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def test_a_killed_rank_ends_with_the_same_model_as_no_failure(tmp_path: Path) -> None:
    plain = _launch(tmp_path, "plain.pt", [], [])
    assert "resumed" not in plain and "epoch 2 done at step 18" in plain, plain
    # rank 1 dies before step 10 of 18; the last commit was after step 8 (one every 4 steps)
    killed = _launch(tmp_path, "killed.pt", ["--max-restarts", "1"], ["--kill-at-step", "10"])
    assert "resumed from the commit after step 8 (epoch 1) on 2 ranks" in killed, killed
    assert "epoch 2 done at step 18" in killed, killed
    want, got = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "killed.pt")
    assert list(want) == list(got)
    for key in want:
        assert torch.equal(want[key], got[key]), f"{key} differs after the restart"


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["allreduce", "DistributedOptimizer"])
def test_a_killed_rank_recovers_in_process_as_in_horovod(distributed_optimizer: bool) -> None:
    """4 ranks under hvd.elastic, rank 2 SIGKILLed at step 3: the survivors restore, re-form a
    world of 3 in process and end with the weights of an epoch with every sample applied once,
    summing with hvd.allreduce or through hvd.DistributedOptimizer's hooks (which go on in the
    re-formed world)."""
    import signal

    from _elastic_job import check, train_hvd

    outcomes = spawn(4, train_hvd, 2, 3, 0, distributed_optimizer, env={"TORCHRING_TIMEOUT": "10"},
                     expect_fail=True, timeout=120)
    assert outcomes[2].exitcode == -signal.SIGKILL, outcomes[2].describe()
    survivors = [outcomes[r] for r in (0, 1, 3)]
    assert all(o.ok for o in survivors), "\n".join(o.describe() for o in survivors)
    assert check([o.value for o in survivors], 3) == []
