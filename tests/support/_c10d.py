"""Helpers for the tests of torchring as a torch.distributed backend (tests/spawned/c10d/test_c10d_*.py).

Inside a rank spawned by ``_dist.spawn``: :func:`init_pg` runs ``init_process_group`` with the
launcher's env (or a ``file://`` URL) and a short timeout, and :func:`finish` destroys every group.
:func:`state_of` snapshots a module's parameters and buffers; :func:`compare` checks two snapshots
with a :class:`_checks.Checker`, bitwise or within a tolerance.
"""

from __future__ import annotations

import datetime
import os

import torch

from _checks import Checker

TIMEOUT_S = 30.0  # the process group timeout; a hang fails in seconds


def init_pg(backend: str = "torchring", timeout_s: float = TIMEOUT_S, init_method: str | None = None) -> None:
    """In a rank: import torchring (registers the name) and init the default group on ``backend``."""
    import torch.distributed as dist

    import torchring  # noqa: F401 - registers "torchring"

    kw = {}
    if init_method is not None and not init_method.startswith("env://"):
        kw = dict(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, init_method=init_method,
                            timeout=datetime.timedelta(seconds=timeout_s), **kw)


def finish() -> None:
    """In a rank: destroy every process group (a no-op when none is initialized)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``module``'s parameters and buffers, by name (DDP's ``module.`` dropped)."""
    out = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        out[name.removeprefix("module.")] = t.detach().clone()
    return out


def compare(chk: Checker, what: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
            exact: bool, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Record in ``chk`` every tensor of ``got`` that differs from ``want`` (same names expected)."""
    if sorted(got) != sorted(want):
        chk.fail(what, f"names differ: {sorted(got)} vs {sorted(want)}")
        return
    for name in want:
        g, w = got[name], want[name]
        if exact or not g.is_floating_point():
            chk.equal(f"{what}: {name}", g, w)
            continue
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
        except AssertionError as e:
            chk.fail(f"{what}: {name}", " ".join(str(e).split()))


def moved(chk: Checker, what: str, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
          names: list[str] | None = None) -> None:
    """Record a failure for each parameter in ``names`` (default: all) that training did not change."""
    for name in names if names is not None else list(before):
        if torch.equal(before[name], after[name]):
            chk.fail(what, f"{name} did not change: the test would not see a wrong gradient")
