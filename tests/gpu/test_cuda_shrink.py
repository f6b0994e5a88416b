"""The NCCL communicator shrunk in process (torchring/_core/nccl_shrink.py) on a real GPU. One
GPU allows one NCCL rank (NCCL refuses a duplicate GPU), so this runs ncclCommShrink with
nothing to exclude at world 1 and drives a collective through the shrunk communicator; the
decisions for larger worlds are tested without a GPU (tests/unit/core/test_nccl_shrink.py)."""

from __future__ import annotations

import torch

from _dist import spawn


def _shrink_at_world_1(rank: int) -> dict:
    import torchring
    from torchring._core import build, gpu_path, nccl_shrink

    torchring.init()
    try:
        assert torchring.cuda.path() == "nccl", (torchring.cuda.path(), torchring.cuda.reason())
        engine = build.load()
        parent = gpu_path.nccl_comm()
        supported = bool(engine.NcclComm.shrink_supported())
        child = engine.NcclComm(parent, [], False, 30.0)
        gpu_path._comm = child  # the world's collectives now run on the shrunk communicator
        nccl_shrink.release(parent, child)
        dev = torchring.cuda.device()
        total = torchring.allreduce(torch.arange(8, dtype=torch.float32, device=dev)).cpu().tolist()
        return {"supported": supported, "rank": child.rank, "size": child.size, "failed": child.failed(),
                "total": total}
    finally:
        torchring.shutdown()


def test_nccl_shrink_makes_a_working_communicator() -> None:
    (r,) = spawn(1, _shrink_at_world_1, env={"TORCHRING_TIMEOUT": "60"}, timeout=180)
    assert r["supported"], "this NCCL has no ncclCommShrink (2.27 or newer needed)"
    assert (r["rank"], r["size"], r["failed"]) == (0, 1, False), r
    assert r["total"] == [float(i) for i in range(8)], r
