"""hvd.init() and hvd.shutdown().

``init()`` joins the job through ``torchring.init()`` (torchrun's, Open MPI's, PMI's or SLURM's
variables; a single process without any), sets up the global process set and those passed as
``process_sets=``, applies the HOROVOD_* variables (knobs.py: ``HOROVOD_TIMELINE`` starts the
timeline on rank 0; ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` becomes the engine's timeout unless
``TORCHRING_TIMEOUT`` is set) and registers ``shutdown`` to run at exit. ``shutdown()`` stops every
process set's negotiation thread, drops their groups and leaves the job; ``init()`` works again
afterwards (a new torchring session). Under an elastic launch (``HOROVOD_ELASTIC=1``, which
torchring-run --min-np/--max-np sets, as horovodrun's elastic mode does) it joins through
``torchring.elastic.init()`` instead, so a worker started while the job runs (a replacement, a
host added) joins it as a newcomer at the members' next commit.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from .._core import context as _context
from ..elastic import world as _elastic_world
from . import basics, handles, knobs, process_sets, timeline

__all__ = ["init", "shutdown", "start_timeline", "stop_timeline"]

_atexit_registered = False


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Joins the job (idempotent) and sets up the global process set and `process_sets`."""
    global _atexit_registered
    ranks = None
    if comm is not None:
        if not isinstance(comm, (list, tuple, range)):
            raise ValueError("hvd.init(comm=...): torchring takes the world from its launcher and "
                             "does not take an mpi4py communicator; use hvd.add_process_set(ranks) "
                             "for collectives over a subset")
        ranks = sorted(comm)
    if basics.is_initialized():
        return
    if process_sets == "dynamic":
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    k = knobs.current()
    timeout = None
    if k.stall_check and k.stall_shutdown_s > 0 and not os.environ.get("TORCHRING_TIMEOUT"):
        timeout = k.stall_shutdown_s
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        _elastic_world.init(timeout)
    else:
        _context.init(timeout=timeout)
    if ranks is not None and ranks != list(range(_context.size())):
        me, world = _context.rank(), _context.size()
        _context.shutdown()
        raise ValueError(f"rank {me}: hvd.init(comm={ranks}): torchring runs Horovod over the "
                         f"whole world of {world} ranks; for a subset use hvd.add_process_set(ranks)")
    process_sets_module_start(process_sets)
    basics._started = True
    knobs.report_unused()
    if k.timeline and k.timeline.upper() != "DYNAMIC":
        start_timeline(k.timeline, k.timeline_mark_cycles)
    if not _atexit_registered:
        atexit.register(shutdown)
        _atexit_registered = True


def process_sets_module_start(sets: Any) -> None:
    """Sets up the process sets, leaving the job again if that fails (init() is all or nothing)."""
    try:
        process_sets.start(sets)
    except BaseException:
        process_sets.stop()
        _context.shutdown()
        raise


def shutdown() -> None:
    """Stops every process set's negotiation, drops their groups and leaves the job."""
    basics._started = False
    timeline.stop()
    process_sets.stop()  # fails every operation still in flight
    handles.clear()
    _context.shutdown()


def reform(settle: float | None = None, gather: float = 0.0, joiners: int = 0) -> Any:
    """Re-forms the world in process (torchring.elastic.reform: the survivors, and `joiners`
    waiting processes; `settle` and `gather` as there) with Horovod's side stopped around it;
    returns the epoch joined."""
    from ..elastic import world as _world  # here: elastic sits below hvd, and only elastic jobs re-form

    basics._started = False
    timeline.stop()
    process_sets.stop()
    handles.clear()
    joined = _world.reform(joiners=joiners, gather=gather,
                           settle=_world.DEFAULT_SETTLE_S if settle is None else settle)
    process_sets_module_start(None)
    basics._started = True
    return joined


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing the timeline to `file_path` on rank 0 (other ranks write none)."""
    if basics.rank() == 0:
        timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stops writing the timeline and closes its file as valid JSON."""
    timeline.stop()
