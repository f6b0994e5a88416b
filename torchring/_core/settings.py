"""torchring's settings: the TORCHRING_* environment variables, parsed and checked in one place.

``Settings.from_env(env)`` is a pure function of a dict; ``torchring.init()`` calls it once and
keeps the result (``_context.settings()``), and every module reads that object. The table
below mirrors the README's configuration table. An empty value counts as unset. A value
that does not parse, or lies outside its range, raises ValueError in one shape: the name,
the value received, what is allowed, and what to do, e.g.

    TORCHRING_SHM_SEGMENT_KB='abc': expected an integer number of KiB in [4, 1048576]; unset it
    for the default 1024

A switch (TORCHRING_DEBUG_BUILD, and hvd's HOROVOD_* switches, which use these parsers too) takes
Horovod's rule: an integer, on above 0; or the words true/false, yes/no, on/off, any case.

TORCHRING_SHM_CHUNK_KB, the earlier name of TORCHRING_SHM_SEGMENT_KB, still works (messages
then name it); setting both to different values is an error.

The launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, SLURM_*, ...) are read by
``_env.detect``, not here; TORCHRING_JOB_ID is here and overrides the launcher's job id.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

_WEEK = 7 * 24 * 3600
DEFAULT_TIMEOUT_S = 300.0  # TORCHRING_TIMEOUT's default (torchring-run --start-timeout's too)


@dataclass(frozen=True)
class Settings:
    """Every TORCHRING_* setting; None means 'decided at init()' (see each field)."""

    timeout: float = DEFAULT_TIMEOUT_S  # TORCHRING_TIMEOUT, seconds without progress before failing
    transport: str = "auto"          # TORCHRING_TRANSPORT: auto, shm or tcp
    algo: str = "auto"               # TORCHRING_ALGO: auto, ring, doubling, rabenseifner[:K], radix4, multiplying
    header: str = "auto"             # TORCHRING_HEADER: auto, doubling, multiplying (the header exchange's shape)
    hostname: str | None = None      # TORCHRING_HOSTNAME: None = socket.gethostname()
    addr: str | None = None          # TORCHRING_ADDR: None = the local address routing to MASTER_ADDR
    bind_addr: str | None = None     # TORCHRING_BIND_ADDR: None = loopback for a loopback addr, else all
    shm_segment_kb: int = 1024       # TORCHRING_SHM_SEGMENT_KB (alias TORCHRING_SHM_CHUNK_KB)
    shm_arena_mb: int = 2048         # TORCHRING_SHM_ARENA_MB (0: torchring.empty uses plain memory)
    shm_stores: str = "auto"         # TORCHRING_SHM_STORES: auto, cached or streaming staging writes
    spin: int | None = None          # TORCHRING_SPIN: None = 20000, or 0 when ranks outnumber cores
    grad_pool_mb: float | None = None  # TORCHRING_GRAD_POOL_MB: None = auto, 0 = off
    cache_dir: str = dataclasses.field(default_factory=lambda: str(cache_dir({})))  # TORCHRING_CACHE_DIR
    cuda_path: str = "auto"          # TORCHRING_CUDA_PATH: auto, nccl, staged or off
    device: int | None = None        # TORCHRING_DEVICE: None = torch's current device, else local rank
    job_id: str | None = None        # TORCHRING_JOB_ID: None = the launcher's run id
    debug_build: bool = False        # TORCHRING_DEBUG_BUILD: -O0 -g with ASan and UBSan
    ssh: str | None = None           # TORCHRING_SSH: None = `ssh` (torchring-run -H's client command)
    elastic_dir: str | None = None   # TORCHRING_ELASTIC_DIR: None = one per run under the temp dir
    min_np: int = 1                  # TORCHRING_MIN_NP: a re-formed world needs this many ranks
    trace: int = 512                 # TORCHRING_TRACE: operations the flight recorder keeps (0: off)
    trace_frames: bool = True        # TORCHRING_TRACE_FRAMES: record the Python line of each operation
    trace_dir: str | None = None     # TORCHRING_TRACE_DIR: None = one per job under the temp dir
    status_s: float = 0.0            # TORCHRING_STATUS_S: seconds between status files (0: none)
    straggler_ms: float = 100.0      # TORCHRING_STRAGGLER_MS: persistent-lateness warning threshold (0: off)
    data_wait: bool = True           # TORCHRING_DATA_WAIT: time torch DataLoader batches (the data phase)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Parses and checks every variable of `env` (a dict such as os.environ)."""
        values: dict[str, Any] = {}
        for var in _VARIABLES:
            name, raw = var.name, env.get(var.name, "").strip()
            for alias in (a for a, current in ALIASES.items() if current == var.name):
                old = env.get(alias, "").strip()
                if old and raw and old != raw:
                    raise ValueError(f"{alias}={old!r} and {var.name}={raw!r} disagree ({alias} is "
                                     f"the earlier name of {var.name}); set only {var.name}")
                if old and not raw:
                    name, raw = alias, old
            if raw:
                values[var.field] = var.parse(name, raw, var.default)
        values["cache_dir"] = str(cache_dir(env))  # with XDG_CACHE_HOME and HOME from env
        return cls(**values)

    @classmethod
    def for_build(cls, env: Mapping[str, str]) -> Settings:
        """The settings the engine build reads (before init(); TORCHRING_CACHE_DIR and
        TORCHRING_DEBUG_BUILD), parsed like the rest; the others keep their defaults."""
        keys = ("TORCHRING_DEBUG_BUILD", *_PATH_VARIABLES)
        return cls.from_env({k: env[k] for k in keys if k in env})

    def spin_iters(self, ranks_here: int, cpus: int) -> int:
        """Busy-wait iterations: TORCHRING_SPIN, else 20000, or 0 when this host's ranks
        outnumber its CPUs (spinning would then steal the CPU the awaited rank needs)."""
        if self.spin is not None:
            return self.spin
        return 20000 if ranks_here <= cpus else 0

    def trace_directory(self, job_id: str) -> Path:
        """Where the flight recorder's dumps go: TORCHRING_TRACE_DIR, else torchring-trace/<job>
        under the temporary directory."""
        if self.trace_dir:
            return Path(_home(self.trace_dir, os.environ))
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id) or "job"
        return Path(tempfile.gettempdir()) / "torchring-trace" / safe


def cache_dir(env: Mapping[str, str]) -> Path:
    """Where engine builds are cached: TORCHRING_CACHE_DIR, else $XDG_CACHE_HOME/torchring,
    else ~/.cache/torchring (needed before init(): the build runs first)."""
    explicit = env.get("TORCHRING_CACHE_DIR", "").strip()
    if explicit:
        return Path(_home(explicit, env))
    xdg = env.get("XDG_CACHE_HOME", "").strip()
    return Path(_home(xdg, env)) / "torchring" if xdg else Path(_home("~/.cache/torchring", env))


def _home(path: str, env: Mapping[str, str]) -> str:
    """`path` with a leading ~ replaced by env's HOME (the process's home if env has none)."""
    if path == "~" or path.startswith("~/"):
        return (env.get("HOME") or os.path.expanduser("~")) + path[1:]
    return os.path.expanduser(path)  # ~user/...


def invalid(name: str, raw: str, expected: str, fix: str) -> ValueError:
    """The one message shape for a variable that does not parse: name, value, what is allowed, what to do."""
    return ValueError(f"{name}={raw!r}: expected {expected}; {fix}")


def fail(name: str, raw: str, expected: str, default: str) -> ValueError:
    """`invalid` for a setting: what to do is to unset it for its `default`."""
    return invalid(name, raw, expected, f"unset it for the default {default}")


def number(name: str, raw: str, default: str, convert: Callable[[str], Any],
           allowed: Callable[[Any], bool], expected: str) -> Any:
    """`raw` converted, if it converts and the result is allowed; else the one message shape."""
    try:
        value = convert(raw)
    except ValueError:
        raise fail(name, raw, expected, default) from None
    if not allowed(value):
        raise fail(name, raw, expected, default)
    return value


def _integer(lo: int, hi: int, unit: str) -> Callable[[str, str, str], int]:
    def parse(name: str, raw: str, default: str) -> int:
        return number(name, raw, default, int, lambda v: lo <= v <= hi,
                      f"an integer {unit} in [{lo}, {hi}]")
    return parse


def _seconds(name: str, raw: str, default: str) -> float:
    return number(name, raw, default, float, lambda v: math.isfinite(v) and 0 < v <= _WEEK,
                  f"a number of seconds > 0 and at most {_WEEK} (a week)")


def _interval(name: str, raw: str, default: str) -> float:
    return number(name, raw, default, float, lambda v: v == 0 or 0.1 <= v <= 3600,
                  "0 (off) or a number of seconds from 0.1 to 3600")


def _milliseconds(name: str, raw: str, default: str) -> float:
    return number(name, raw, default, float, lambda v: math.isfinite(v) and 0 <= v <= _WEEK * 1000,
                  "a number of milliseconds >= 0 (0: off)")


def _pool_mb(name: str, raw: str, default: str) -> float | None:
    lowered = raw.lower()
    if lowered == "auto":
        return None
    if lowered == "off":
        return 0.0
    return number(name, raw, default, float, lambda v: math.isfinite(v) and 0 <= v <= 1 << 20,
                  "'auto', 'off' or 0 (no pool), or a number of MiB in [0, 1048576]")


def choice(*choices: str) -> Callable[[str, str, str], str]:
    """A parser taking one of `choices`, in any case (it returns the lower-case word)."""
    def parse(name: str, raw: str, default: str) -> str:
        value = raw.lower()
        if value not in choices:
            raise fail(name, raw, "one of " + ", ".join(choices), default)
        return value
    return parse


def _algo(name: str, raw: str, default: str) -> str:
    """TORCHRING_ALGO: auto, ring, doubling, rabenseifner, rabenseifner:K (K halvings, K >= 1), radix4 or multiplying."""
    value = raw.lower()
    word, colon, levels = value.partition(":")
    if colon and word == "rabenseifner" and levels.isdigit() and int(levels) >= 1:
        return f"rabenseifner:{int(levels)}"
    if not colon and word in ("auto", "ring", "doubling", "rabenseifner", "radix4", "multiplying"):
        return value
    raise fail(name, raw, "one of auto, ring, doubling, rabenseifner, rabenseifner:K (K halvings, K >= 1), radix4, "
               "multiplying", default)


def _word(what: str) -> Callable[[str, str, str], str]:
    def parse(name: str, raw: str, default: str) -> str:
        if any(c.isspace() for c in raw):
            raise fail(name, raw, f"{what} without spaces", default)
        return raw
    return parse


def text(name: str, raw: str, default: str) -> str:
    """Any text, as it is (a path, a command line)."""
    return raw


def _ipv4(name: str, raw: str, default: str) -> str:
    try:
        ipaddress.IPv4Address(raw)
    except ValueError:
        raise fail(name, raw, "a local IPv4 address such as 198.18.0.1 (the TCP links listen on IPv4)",
                   default) from None
    return raw


_ON, _OFF = ("true", "yes", "on"), ("false", "no", "off")


def switch(name: str, raw: str, default: str) -> bool:
    """On or off by Horovod's rule (an integer, on above 0), or true/false, yes/no, on/off."""
    word = raw.lower()
    if word in _ON or word in _OFF:
        return word in _ON
    return number(name, raw, default, int, lambda v: True,
                  "1 or 0 (an integer: on above 0), or true/false, yes/no, on/off") > 0


@dataclass(frozen=True)
class _Variable:
    name: str
    field: str
    parse: Callable[[str, str, str], Any]
    default: str  # as the message names it


_VARIABLES = (
    _Variable("TORCHRING_TIMEOUT", "timeout", _seconds, f"{DEFAULT_TIMEOUT_S:g}"),
    _Variable("TORCHRING_TRANSPORT", "transport", choice("auto", "shm", "tcp"), "auto"),
    _Variable("TORCHRING_ALGO", "algo", _algo, "auto"),
    _Variable("TORCHRING_HEADER", "header", choice("auto", "doubling", "multiplying"), "auto"),
    _Variable("TORCHRING_HOSTNAME", "hostname", _word("a host identity"), "(this host's name)"),
    _Variable("TORCHRING_ADDR", "addr", _word("a host name or IP address"), "(the route to MASTER_ADDR)"),
    _Variable("TORCHRING_BIND_ADDR", "bind_addr", _ipv4, "(all interfaces)"),
    _Variable("TORCHRING_SHM_SEGMENT_KB", "shm_segment_kb", _integer(4, 1 << 20, "number of KiB"), "1024"),
    _Variable("TORCHRING_SHM_ARENA_MB", "shm_arena_mb", _integer(0, 1 << 20, "number of MiB"), "2048"),
    _Variable("TORCHRING_SHM_STORES", "shm_stores", choice("auto", "cached", "streaming"), "auto"),
    _Variable("TORCHRING_SPIN", "spin", _integer(0, 10 ** 8, "number of iterations"),
              "(20000, or 0 when ranks outnumber cores)"),
    _Variable("TORCHRING_GRAD_POOL_MB", "grad_pool_mb", _pool_mb, "auto"),
    _Variable("TORCHRING_CACHE_DIR", "cache_dir", text, "~/.cache/torchring"),
    _Variable("TORCHRING_CUDA_PATH", "cuda_path", choice("auto", "nccl", "staged", "off"), "auto"),
    _Variable("TORCHRING_DEVICE", "device", _integer(0, 1023, "CUDA device index"), "(the local rank)"),
    _Variable("TORCHRING_JOB_ID", "job_id", _word("a job name"), "(the launcher's run id)"),
    _Variable("TORCHRING_DEBUG_BUILD", "debug_build", switch, "0"),
    _Variable("TORCHRING_SSH", "ssh", text, "ssh"),
    _Variable("TORCHRING_ELASTIC_DIR", "elastic_dir", text,
              "(a directory per run under the temporary directory)"),
    _Variable("TORCHRING_MIN_NP", "min_np", _integer(1, 1 << 20, "number of ranks"), "1"),
    _Variable("TORCHRING_TRACE", "trace", _integer(0, 1 << 20, "number of operations (0: off)"), "512"),
    _Variable("TORCHRING_TRACE_FRAMES", "trace_frames", switch, "1"),
    _Variable("TORCHRING_STRAGGLER_MS", "straggler_ms", _milliseconds, "100"),
    _Variable("TORCHRING_TRACE_DIR", "trace_dir", text, "(torchring-trace/<job id> under the temporary directory)"),
    _Variable("TORCHRING_STATUS_S", "status_s", _interval, "0 (torchring-run: 1)"),
    _Variable("TORCHRING_DATA_WAIT", "data_wait", switch, "1"),
)
# What cache_dir() reads.
_PATH_VARIABLES = ("TORCHRING_CACHE_DIR", "XDG_CACHE_HOME", "HOME")

# Earlier names that still work: alias -> current name.
ALIASES = {"TORCHRING_SHM_CHUNK_KB": "TORCHRING_SHM_SEGMENT_KB"}

VARIABLES: tuple[str, ...] = tuple(v.name for v in _VARIABLES)
