"""The NCCL communicator through an in-process re-forming (torchring/_core/nccl_shrink.py) on a
real GPU. One GPU allows one NCCL rank (NCCL refuses a duplicate GPU), so no rank can be left
out here and ncclCommShrink itself needs two GPUs: NCCL 2.28 answers a shrink that excludes
nothing with "invalid argument". What one GPU does check: a re-forming with nothing to exclude
keeps the parent (no NCCL call), a refused shrink raises a CommFailedError that names
ncclCommShrink, and the parent survives it and still runs collectives. The decisions for larger
worlds are tested without a GPU (tests/unit/core/test_nccl_shrink.py)."""

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
        kept = nccl_shrink.shrunk(engine, (parent, []), None, 0, 1, parent.device, 30.0)
        refused = None
        try:
            engine.NcclComm(parent, [], False, 30.0).close()
        except torchring.TorchringError as e:
            refused = str(e)
        dev = torchring.cuda.device()
        total = torchring.allreduce(torch.arange(8, dtype=torch.float32, device=dev)).cpu().tolist()
        return {"supported": supported, "kept": kept is parent, "refused": refused,
                "parent_failed": parent.failed(), "total": total}
    finally:
        torchring.shutdown()


def test_nccl_shrink_decisions_and_a_refused_shrink_on_one_gpu() -> None:
    (r,) = spawn(1, _shrink_at_world_1, env={"TORCHRING_TIMEOUT": "60"}, timeout=180)
    assert r["supported"], "this NCCL has no ncclCommShrink (2.27 or newer needed)"
    assert r["kept"], "a re-forming with nothing to exclude must keep the parent communicator"
    # NCCL may one day accept an empty exclusion; then the child is closed and only the parent is checked.
    assert r["refused"] is None or "ncclCommShrink" in r["refused"], r
    assert not r["parent_failed"], "a refused shrink marked the parent communicator failed"
    assert r["total"] == [float(i) for i in range(8)], r
