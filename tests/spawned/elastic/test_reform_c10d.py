"""A job on torch.distributed alone (DDP on init_process_group("torchring")) survives a killed
rank in process: the survivors restore the last commit, re-form the default process group
(torchring.elastic.reform_process_group), wrap the model in DDP again, sync and go on, ending
at a float reference's weights (tests/support/_elastic_job.py)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

from _dist import spawn


def _ddp_job(rank: int, victim: int, at_step: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import torchring.c10d
    import torchring.elastic as elastic
    from _elastic_job import BATCH, LR, SAMPLES, Linear, x

    torchring.c10d.register()  # import torchring does it too
    dist.init_process_group("torchring")
    model = Linear()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=5)
    state = elastic.State(model=model, optimizer=optimizer, sampler=sampler, step=0)
    trained: list[list[int]] = []
    failures: list[str] = []
    while True:
        try:
            state.sync()
            indices = list(iter(sampler))
            for b in range(0, len(indices), BATCH):
                if dist.get_rank() == victim and state.step == at_step and elastic.epoch() == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                chunk = indices[b:b + BATCH]
                optimizer.zero_grad()
                ddp(sum(x(i) for i in chunk)).backward()  # DDP averages the gradient
                optimizer.step()
                sampler.record_batch(b // BATCH, BATCH)
                state.step += 1
                trained.append([elastic.epoch(), *chunk])
                state.commit()
            break
        except RuntimeError as exc:  # DDP's allreduce failed: a peer is gone
            failures.append(str(exc).splitlines()[0][:200])
            state.restore()
            elastic.reform_process_group()
            sampler.reset()
            ddp = DistributedDataParallel(model)
    result = {"w": model.w.detach().tolist(), "rank": dist.get_rank(), "size": dist.get_world_size(),
              "epoch": elastic.epoch(), "trained": trained, "failures": failures}
    dist.destroy_process_group()
    return result


def test_ddp_on_the_torchring_backend_re_forms_in_process() -> None:
    from _elastic_job import averaged_reference

    outcomes = spawn(4, _ddp_job, 2, 3, env={"TORCHRING_TIMEOUT": "10"}, expect_fail=True, timeout=180)
    assert outcomes[2].exitcode == -signal.SIGKILL, outcomes[2].describe()
    survivors = [outcomes[r] for r in (0, 1, 3)]
    assert all(o.ok for o in survivors), "\n".join(o.describe() for o in survivors)
    results = [o.value for o in survivors]
    assert [(r["rank"], r["size"], r["epoch"]) for r in results] == [(0, 3, 1), (1, 3, 1), (2, 3, 1)]
    assert all(len(r["failures"]) == 1 for r in results), [r["failures"] for r in results]
    want = averaged_reference(results, 4)
    for r in results:
        got = torch.tensor(r["w"], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-12, atol=0), (r["rank"], got.tolist(), want.tolist())
