"""The models and the timed training loop that more than one benchmark measures.

mlp is the reference MLP of train_step.py and ddp_backend.py's step section; timed_steps times
its training steps (MSE loss, SGD lr 1e-3, a fixed batch per rank, every step started together).
"""

from __future__ import annotations

import resource
import time
from typing import Callable

import torch
from torch import nn


def mlp(width: int) -> nn.Module:
    """The 1024 -> 4x -> 4x -> 1024 MLP of the reference measurements (25.18M params at 1024)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, 4 * width),
                         nn.ReLU(), nn.Linear(4 * width, width))


def timed_steps(model: nn.Module, batch: int, width: int, steps: int, warmup: int,
                barrier: Callable[[], None], pooled: bool = False) -> tuple[list[float], float]:
    """Seconds per training step on this rank (after warmup), each step started together, and
    this rank's minor page faults per step."""
    from torchring._wrap import memory
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x, y = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)
    times, faults = [], 0

    def pool_this_backward(grad: torch.Tensor) -> None:
        task = memory.grad_pool_begin()
        torch.autograd.Variable._execution_engine.queue_callback(lambda: memory.grad_pool_end(task))
    for step in range(warmup + steps):
        barrier()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        opt.zero_grad()
        pred = model(x)
        if pooled:  # as in a wrapped backward: pooled from the output's gradient on
            pred.register_hook(pool_this_backward)
        nn.functional.mse_loss(pred, y).backward()
        opt.step()
        sync()
        if step >= warmup:
            times.append(time.perf_counter() - start)
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return times, faults / steps
