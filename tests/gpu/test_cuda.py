"""The GPU path, on a machine with a CUDA device (benchmarks/gpu_suite.sh runs this file).

World 1 goes over NCCL; worlds 2-4 share the one GPU, which NCCL refuses, so they take the
staged path (pinned host buffers through the CPU engine). Every result is compared with a
single-process reference computed on the GPU. The collectives job also runs every collective of
torchring.__all__ in its blocking, in-place and _async forms (tests/gpu/_device_collectives.py);
the torch.distributed backend, torchring.horovod and the failure paths on CUDA have files of
their own (test_cuda_c10d.py, test_cuda_horovod.py, test_cuda_failures.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _checks import DTYPES, assert_no_failures, expected_allreduce, rank_input, valid_ops
from _device_collectives import device_checks
from _dist import spawn


def _collectives(rank: int, expected_path: str) -> list[str]:
    import torchring
    torchring.init()
    bad = []
    try:
        world = torchring.size()
        if torchring.cuda.path() != expected_path:
            bad.append(f"path {torchring.cuda.path()} ({torchring.cuda.reason()}), expected {expected_path}")
        dev = torchring.cuda.device()
        for dtype in DTYPES:
            for op in valid_ops(dtype):
                for n in (0, 1, 7, 1000, 2**20 + 3):
                    t = rank_input(rank, world, n, dtype, op).to(dev)
                    torchring.allreduce(t, getattr(torchring.ReduceOp, op))
                    want = expected_allreduce(world, n, dtype, op).to(dev)
                    if not torch.allclose(t.double(), want.double(), rtol=1e-3 if op == "AVG" else 0, atol=0):
                        bad.append(f"allreduce {dtype}[{n}] {op}")
        h = torchring.allreduce_async(torch.ones(1 << 20, device=dev))
        out = h.wait()          # stream-ordered: the next kernel on this stream sees the result
        if out.sum().item() != world * (1 << 20):
            bad.append("async allreduce + wait")
        if not torch.equal(h.synchronize(), out):
            bad.append("synchronize")
        for src in range(world):
            b = torch.arange(1000, device=dev, dtype=torch.float32) * (rank == src)
            torchring.broadcast(b, src)
            if not torch.equal(b, torch.arange(1000, device=dev, dtype=torch.float32)):
                bad.append(f"broadcast from {src}")
        g = torchring.allgather(torch.full((rank + 1, 3), float(rank), device=dev))
        want = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(world)]).to(dev)
        if not torch.equal(g, want):
            bad.append("allgather")
        x = torch.arange(world * 4 * 2, device=dev, dtype=torch.float32).reshape(world * 4, 2) + rank
        got = torchring.reduce_scatter(x)
        full = sum(torch.arange(world * 8, dtype=torch.float32).reshape(world * 4, 2) + r for r in range(world))
        if not torch.equal(got.cpu(), full[rank * 4:(rank + 1) * 4]):
            bad.append("reduce_scatter")
        return bad + device_checks(rank, world, dev)
    finally:
        torchring.shutdown()


class _Mixed(nn.Module):
    """First layer on the CPU, second on the GPU: autograd runs their backward (and wrap's
    hooks) on two threads."""

    def __init__(self, dev: torch.device) -> None:
        super().__init__()
        self.dev = dev
        self.first, self.second = nn.Linear(16, 64), nn.Linear(64, 4).to(dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x.cpu())).to(self.dev))


def _wrap_parity(rank: int, mixed: bool = False) -> list[str]:
    import torchring
    torchring.init()
    try:
        world, dev = torchring.size(), torchring.cuda.device()

        def make() -> nn.Module:
            torch.manual_seed(0)
            if mixed:
                return _Mixed(dev)
            return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(dev)
        ref = make()
        model = torchring.wrap(make(), bucket_cap_mb=0.002, first_bucket_mb=0.001)
        model.load_state_dict(ref.state_dict())
        opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        bad = []
        for step in range(4):
            x = torch.randint(-3, 4, (4 * world, 16), generator=g).float().to(dev)
            y = torch.randint(-3, 4, (4 * world, 4), generator=g).float().to(dev)
            opt_ref.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            opt_ref.step()
            opt.zero_grad()
            nn.functional.mse_loss(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
            opt.step()
            for (name, a), b in zip(model.module.named_parameters(), ref.parameters()):
                if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                    bad.append(f"step {step}: {name} differs from single-process training")
        return bad
    finally:
        torchring.shutdown()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_on_cuda(world: int) -> None:
    path = "nccl" if world == 1 or torch.cuda.device_count() >= world else "staged"
    assert_no_failures(spawn(world, _collectives, path, timeout=600))


def test_forced_staged_path() -> None:
    assert_no_failures(spawn(1, _collectives, "staged", env={"TORCHRING_CUDA_PATH": "staged"}))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_wrap_parity_on_cuda(world: int) -> None:
    for failures in spawn(world, _wrap_parity, timeout=600):
        assert failures == []


@pytest.mark.parametrize("world", [1, 2])
def test_wrap_parity_cpu_and_cuda_model(world: int) -> None:
    for failures in spawn(world, _wrap_parity, True, timeout=600):
        assert failures == []


def _watchdog(rank: int) -> dict:
    """An NCCL allreduce queued behind a GPU kernel that outlasts TORCHRING_TIMEOUT: the
    watchdog must abort NCCL, and the next wait() must raise instead of hanging."""
    import time

    import torchring
    torchring.init()
    try:
        assert torchring.cuda.path() == "nccl", (torchring.cuda.path(), torchring.cuda.reason())
        dev = torchring.cuda.device()
        t = _warmed_up(dev)
        torch.cuda._sleep(int(60e9))  # 60e9 GPU clock cycles: about 30 s at 2 GHz
        handle = torchring.allreduce_async(t)
        start, error = time.monotonic(), None
        try:
            while time.monotonic() - start < 25:
                time.sleep(0.1)
                handle.wait()  # raises once the watchdog aborted; stream-waits until then
        except torchring.TorchringError as e:
            error = str(e)
        return {"error": error, "elapsed": time.monotonic() - start}
    finally:
        torchring.shutdown()


def test_nccl_watchdog_aborts_a_stuck_collective() -> None:
    # 5 s: NCCL's first setup on a node must fit in it too. (At world 1 NCCL's in-place
    # allreduce is a no-op, so this tests the timeout and the abort, not ending a live kernel.)
    (r,) = spawn(1, _watchdog, env={"TORCHRING_TIMEOUT": "5"}, timeout=180)
    assert r["error"] is not None, "no TorchringError while the collective could not complete"
    assert "did not complete within 5" in r["error"] and "allreduce" in r["error"], r["error"]
    assert r["elapsed"] < 15, f"the watchdog took {r['elapsed']:.1f} s"


def _warmed_up(dev: torch.device) -> torch.Tensor:
    """A tensor of 16 ones on `dev` after one finished allreduce: the first collective's setup
    (NCCL's lazy connection, the first allocations) may wait for the whole device, so it must
    not come after the kernel a test queues to hold the collective back."""
    import torchring

    torchring.allreduce(torch.zeros(16, device=dev))
    t = torch.ones(16, device=dev)
    torch.cuda.synchronize(dev)
    return t


def _timed_wait(rank: int) -> dict:
    """Handle.wait(timeout) on the NCCL path: expires with WaitTimeoutError while a GPU kernel
    holds the collective back, aborts nothing, and the collective then completes; queuing the
    collective does not wait for the kernel (launch_s)."""
    import time

    import torchring
    torchring.init()
    try:
        assert torchring.cuda.path() == "nccl", (torchring.cuda.path(), torchring.cuda.reason())
        dev = torchring.cuda.device()
        t = _warmed_up(dev)
        torch.cuda._sleep(int(4e9))  # about 2 s at 2 GHz, ahead of the collective on the stream
        start = time.monotonic()
        handle = torchring.allreduce_async(t)
        launch_s = time.monotonic() - start
        try:
            handle.wait(timeout=0.2)
            expired = None
        except torchring.WaitTimeoutError as e:
            expired = str(e)
        result = handle.synchronize().cpu().tolist()
        again = torchring.allreduce(torch.full((4,), 2.0, device=dev)).cpu().tolist()
        return {"expired": expired, "result": result, "again": again, "launch_s": launch_s}
    finally:
        torchring.shutdown()


def test_nccl_timed_wait_expires_without_aborting() -> None:
    (r,) = spawn(1, _timed_wait, env={"TORCHRING_TIMEOUT": "60"}, timeout=180)
    assert r["launch_s"] < 1.0, f"allreduce_async blocked {r['launch_s']:.2f} s behind the queued kernel"
    assert r["expired"] is not None and "Handle.wait(timeout=0.2) expired" in r["expired"], r
    assert r["result"] == [1.0] * 16 and r["again"] == [2.0] * 4, r
