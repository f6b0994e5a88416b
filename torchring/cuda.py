"""torchring.cuda: which way this job's CUDA tensors go (set up in torchring._core.gpu_path).

    torchring.cuda.path()    # 'nccl', 'staged' or 'none'
    torchring.cuda.reason()  # why, e.g. 'several ranks share one GPU, which NCCL refuses'
    torchring.cuda.device()  # this rank's CUDA device, or None
"""

from __future__ import annotations

from ._core.gpu_path import device, path, reason

__all__ = ["path", "reason", "device"]
