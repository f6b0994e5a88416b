"""Horovod's HOROVOD_* environment variables, read into one frozen ``Knobs`` object.

``current()`` reads the environment at call time (``hvd.init(process_sets="dynamic")`` sets
HOROVOD_DYNAMIC_PROCESS_SETS just before it asks), with Horovod's defaults:

    HOROVOD_FUSION_THRESHOLD              bytes per fused bucket        128 MiB (0: no fusion)
    HOROVOD_CYCLE_TIME                    negotiation tick, ms          1
    HOROVOD_CACHE_CAPACITY                accepted and checked only     1024
    HOROVOD_STALL_CHECK_DISABLE           1: no stall warnings          0
    HOROVOD_STALL_CHECK_TIME_SECONDS      warn after, seconds           60
    HOROVOD_STALL_SHUTDOWN_TIME_SECONDS   fail after, seconds           0 (never)
    HOROVOD_TIMELINE                      trace file, or DYNAMIC        unset
    HOROVOD_TIMELINE_MARK_CYCLES          CYCLE_START marks             0
    HOROVOD_ELASTIC                       elastic mode                  0
    HOROVOD_DYNAMIC_PROCESS_SETS          add/remove sets after init    0
    HOROVOD_LOG_LEVEL                     torchring logger's level      unset (logger unchanged)

The values are parsed by torchring's settings parsers (_core/settings.py), so both families
follow one set of rules: an empty value counts as unset; a switch takes an integer (above 0
means on, as in Horovod) or true/false, yes/no, on/off; a value that does not parse is a
ValueError naming the variable, the value, what is allowed and the default, where Horovod
would silently read a 0.
``report_unused()`` (called by ``hvd.init()``) logs every other HOROVOD_* variable that is
set, and why torchring does not apply it.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .._core import context as _context
from .._core.log import logger
from .._core.settings import choice, number, switch, text

__all__ = ["Knobs", "current", "unused", "report_unused", "DEFAULT_FUSION_THRESHOLD"]

DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024  # Horovod's since 0.21


@dataclass(frozen=True)
class Knobs:
    """The HOROVOD_* settings torchring.horovod applies (see the module's table)."""

    fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    stall_check: bool = True
    stall_warning_s: float = 60.0
    stall_shutdown_s: float = 0.0
    timeline: str | None = None
    timeline_mark_cycles: bool = False
    elastic: bool = False
    dynamic_process_sets: bool = False
    log_level: str | None = None  # trace, debug, info, warning, error or fatal


def _count(name: str, raw: str, default: str) -> int:
    return number(name, raw, default, int, lambda v: v >= 0, "a whole number >= 0")


def _amount(name: str, raw: str, default: str) -> float:
    return number(name, raw, default, float, lambda v: math.isfinite(v) and v >= 0, "a number >= 0")


_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO,
           "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}
_level = choice(*_LEVELS)

# variable -> (Knobs field, parser, the default as messages name it)
_APPLIED: dict[str, tuple[str, Callable[[str, str, str], Any], str]] = {
    "HOROVOD_FUSION_THRESHOLD": ("fusion_threshold_bytes", _count, str(DEFAULT_FUSION_THRESHOLD)),
    "HOROVOD_CYCLE_TIME": ("cycle_time_ms", _amount, "1"),
    "HOROVOD_CACHE_CAPACITY": ("cache_capacity", _count, "1024"),
    "HOROVOD_STALL_CHECK_DISABLE": ("stall_check", switch, "0"),
    "HOROVOD_STALL_CHECK_TIME_SECONDS": ("stall_warning_s", _amount, "60"),
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": ("stall_shutdown_s", _amount, "0"),
    "HOROVOD_TIMELINE": ("timeline", text, "(no timeline)"),
    "HOROVOD_TIMELINE_MARK_CYCLES": ("timeline_mark_cycles", switch, "0"),
    "HOROVOD_ELASTIC": ("elastic", switch, "0"),
    "HOROVOD_DYNAMIC_PROCESS_SETS": ("dynamic_process_sets", switch, "0"),
    "HOROVOD_LOG_LEVEL": ("log_level", _level, "(torchring's logger unchanged)"),
}


def current(env: Mapping[str, str] | None = None) -> Knobs:
    """The knobs of `env` (os.environ when None), read now."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for name, (field, parse, default) in _APPLIED.items():
        raw = env.get(name, "").strip()
        if raw:
            values[field] = parse(name, raw, default)
    if "stall_check" in values:
        values["stall_check"] = not values["stall_check"]  # the variable disables it
    return Knobs(**values)


_NO_MPI = "torchring runs no MPI"
_ENGINE = ("torchring's engine is both the controller and the data plane (choose its transport "
           "with TORCHRING_TRANSPORT=auto|shm|tcp)")
_LAUNCH = "horovodrun's rendezvous; torchring meets through torchrun's MASTER_ADDR/MASTER_PORT"
_BUILD = ("a variable of Horovod's build; torchring compiles its engine itself on first use "
          "(see torchring-run --check-build)")
_AUTOTUNE = ("torchring does not autotune; set HOROVOD_FUSION_THRESHOLD and HOROVOD_CYCLE_TIME "
             "(or --fusion-threshold-mb, --cycle-time-ms) yourself")

# Variables torchring accepts without applying them, and why.
_NOT_APPLIED: dict[str, str] = {
    "HOROVOD_CACHE_CAPACITY": "torchring keeps no response cache (operations are negotiated by "
                              "name every time), so the capacity has no effect",
    "HOROVOD_BATCH_D2D_MEMCOPIES": "torchring packs CUDA buckets its own way; there is no switch",
    "HOROVOD_DISABLE_GROUP_FUSION": "torchring has no switch for fusing across explicit groups",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "the engine already uses shared memory within a host and "
                                      "TCP between hosts; there is no separate hierarchical mode",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "the engine already uses shared memory within a host and "
                                      "TCP between hosts; there is no separate hierarchical mode",
    "HOROVOD_TORUS_ALLREDUCE": "the engine has no 2-D torus algorithm",
    "HOROVOD_NUM_NCCL_STREAMS": "the engine manages its own CUDA stream",
    "HOROVOD_THREAD_AFFINITY": "torchring does not pin threads; pin the ranks with taskset or numactl",
    "HOROVOD_ENABLE_ASYNC_COMPLETION": "not applicable to torchring's CUDA path",
    "HOROVOD_DISABLE_NVTX_RANGES": "torchring adds no NVTX ranges of its own (it marks collectives "
                                   "with torch.profiler.record_function)",
    "HOROVOD_ENABLE_XLA_OPS": "XLA ops exist only in Horovod's TensorFlow binding",
    "HOROVOD_MPI_THREADS_DISABLE": _NO_MPI,
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "hvd.Adasum is not implemented by torchring",
    "HOROVOD_AUTOTUNE": _AUTOTUNE,
    "HOROVOD_AUTOTUNE_LOG": _AUTOTUNE,
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": _AUTOTUNE,
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": _AUTOTUNE,
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": _AUTOTUNE,
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": _AUTOTUNE,
    "HOROVOD_CONTROLLER": _ENGINE,
    "HOROVOD_CPU_OPERATIONS": _ENGINE,
    "HOROVOD_CCL_CACHE": _ENGINE,
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "Gloo is not used; torchring's timeout is TORCHRING_TIMEOUT "
                                    "(seconds, torchring-run --start-timeout sets it)",
    "HOROVOD_GLOO_IFACE": "torchring uses the address that routes to MASTER_ADDR; set "
                          "TORCHRING_ADDR (and TORCHRING_BIND_ADDR) to choose another interface",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR": _LAUNCH,
    "HOROVOD_GLOO_RENDEZVOUS_PORT": _LAUNCH,
    "HOROVOD_LOG_HIDE_TIME": "torchring's log lines carry no time stamp",
    "HOROVOD_START_TIMEOUT": "horovodrun's, not the ranks'; torchring-run --start-timeout sets "
                             "TORCHRING_TIMEOUT, which init() waits for the other ranks",
}

# Set by launchers (horovodrun, or torchring.horovod itself from torchrun's variables): not
# settings, so never reported.
_LAUNCH_CONTRACT = {"HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                    "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME"}

_BUILD_PREFIXES = ("HOROVOD_WITH_", "HOROVOD_WITHOUT_", "HOROVOD_GPU", "HOROVOD_NCCL_",
                   "HOROVOD_CUDA_", "HOROVOD_ROCM_", "HOROVOD_BUILD_", "HOROVOD_CPU_OPERATIONS_DEFAULT",
                   "HOROVOD_CMAKE", "HOROVOD_DEBUG", "HOROVOD_ALLOW_MIXED_GPU_IMPL",
                   "HOROVOD_LOCAL_VERSION", "HOROVOD_SKIP_COMPILE")


def unused(env: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(variable, value, why) for each set HOROVOD_* variable torchring does not apply."""
    env = os.environ if env is None else env
    out = []
    for name in sorted(n for n in env if n.startswith("HOROVOD_")):
        raw = env[name].strip()
        if not raw or name in _LAUNCH_CONTRACT:
            continue
        if name in _NOT_APPLIED:
            why = _NOT_APPLIED[name]
        elif name in _APPLIED:
            continue
        elif name.startswith(_BUILD_PREFIXES):
            why = _BUILD
        else:
            why = "torchring does not know this variable (Horovod's are listed in torchring/horovod/knobs.py)"
        out.append((name, raw, why))
    return out


_reported: set[tuple[str, str]] = set()  # (variable, value) already logged by this process


def report_unused(env: Mapping[str, str] | None = None) -> None:
    """Applies HOROVOD_LOG_LEVEL to the torchring logger, then logs each set HOROVOD_* variable
    torchring does not apply and why: once per variable and value, on rank 0 only."""
    knobs = current(env)  # also checks every applied variable's value
    if knobs.log_level is not None:
        logger.setLevel(_LEVELS[knobs.log_level])
    if _context.is_initialized() and _context.rank() != 0:
        return
    for name, raw, why in unused(env):
        if (name, raw) not in _reported:
            _reported.add((name, raw))
            logger.info("%s=%s is not applied: %s", name, raw, why)
