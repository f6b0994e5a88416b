"""What Python shares with the C++ engine: reduce ops, op kinds, dtypes, and the Handle.

One definition each. The engine has its own copies of the enums (its wire format and kernels
are keyed by them); ``check_engine()`` compares the two when the engine is loaded, so a
mismatch fails at import instead of reducing with the wrong op.
"""

from __future__ import annotations

import enum
import functools
import time
from typing import Any, Callable, NamedTuple, TypeVar

import torch

__all__ = ["ReduceOp", "Handle", "Works"]


class ReduceOp(enum.IntEnum):
    """How allreduce and reduce_scatter combine the ranks' values (BAND, BOR, BXOR: integer and bool only)."""

    SUM = 0
    AVG = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4
    BAND = 5
    BOR = 6
    BXOR = 7

    @property
    def bitwise(self) -> bool:
        """BAND, BOR or BXOR: combines the bits of integer and bool tensors."""
        return self in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


class OpKind(enum.IntEnum):
    """The kinds of collective the engine runs (part of every collective's header)."""

    ALLREDUCE = 0
    BROADCAST = 1
    ALLGATHER = 2
    REDUCE_SCATTER = 3
    BARRIER = 4
    REDUCE = 5
    GATHER = 6
    SCATTER = 7
    ALLTOALL = 8
    ALLREDUCE_MANY = 9
    SEND = 10  # names point-to-point handles; never queued as a collective
    RECV = 11

    @property
    def reduces(self) -> bool:
        """Combines the ranks' values with a ReduceOp."""
        return OP_SPECS[self].reduces

    @property
    def rooted(self) -> bool:
        """Has a root rank (src or dst)."""
        return OP_SPECS[self].rooted

    @property
    def scalable(self) -> bool:
        """Takes prescale and postscale factors."""
        return OP_SPECS[self].scalable

    @property
    def in_place(self) -> bool:
        """Its result is written into its input tensor."""
        return OP_SPECS[self].in_place

    @property
    def nccl(self) -> bool:
        """The NCCL path can run it (the world's CUDA tensors)."""
        return OP_SPECS[self].nccl

    @property
    def ragged(self) -> bool:
        """Its tensor's dim 0 may differ per rank (the rows' shape may not)."""
        return OP_SPECS[self].ragged


class OpSpec(NamedTuple):
    """What a kind of collective is: the properties its checks and its header comparison read."""

    reduces: bool
    rooted: bool
    scalable: bool
    in_place: bool
    nccl: bool
    ragged: bool


# One row per OpKind, the engine's OpSpec table (csrc/core/common.cpp kOpSpecs) in Python;
# check_engine() compares the two when the engine loads.
_T, _F = True, False
OP_SPECS: dict[OpKind, OpSpec] = {
    #                                reduces rooted scalable in_place nccl ragged
    OpKind.ALLREDUCE:        OpSpec(_T,     _F,    _T,      _T,      _T,  _F),
    OpKind.BROADCAST:        OpSpec(_F,     _T,    _F,      _T,      _T,  _F),
    OpKind.ALLGATHER:        OpSpec(_F,     _F,    _F,      _F,      _T,  _T),
    OpKind.REDUCE_SCATTER:   OpSpec(_T,     _F,    _T,      _F,      _T,  _F),
    OpKind.BARRIER:          OpSpec(_F,     _F,    _F,      _F,      _F,  _F),
    OpKind.REDUCE:           OpSpec(_T,     _T,    _F,      _T,      _F,  _F),
    OpKind.GATHER:           OpSpec(_F,     _T,    _F,      _F,      _F,  _F),
    OpKind.SCATTER:          OpSpec(_F,     _T,    _F,      _T,      _F,  _F),
    OpKind.ALLTOALL:         OpSpec(_F,     _F,    _F,      _F,      _F,  _T),
    OpKind.ALLREDUCE_MANY:   OpSpec(_T,     _F,    _T,      _T,      _F,  _F),
    OpKind.SEND:             OpSpec(_F,     _F,    _F,      _F,      _F,  _F),
    OpKind.RECV:             OpSpec(_F,     _F,    _F,      _T,      _F,  _F),
}


# The engine's dtype enum, in its order.
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
                                   torch.int16)
FLOATS: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def reduction_refusal(kind: OpKind, dtype: torch.dtype, op: ReduceOp | None, scaled: bool) -> str | None:
    """The dtype x op rule of every reduction (the engine's reductionRefusal, common.cpp): which
    rule a `kind` collective of `dtype` reducing with `op` (None: not in question), `scaled`
    by factors other than 1, breaks: "bool" (bool reduces with MIN, MAX, BAND, BOR and BXOR
    only), "bitwise" (BAND, BOR and BXOR need an integer or bool dtype), "avg" (AVG needs a
    floating dtype), "scale" (so do the factors); None when it breaks none."""
    if not OP_SPECS[kind].reduces:
        return None
    floating = dtype in FLOATS
    if op is not None and dtype == torch.bool and op not in (ReduceOp.MIN, ReduceOp.MAX) and not op.bitwise:
        return "bool"
    if op is not None and op.bitwise and floating:
        return "bitwise"
    if op == ReduceOp.AVG and not floating:
        return "avg"
    if scaled and not floating:
        return "scale"
    return None


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the spelling every torchring message uses."""
    return str(dtype).replace("torch.", "")


def describe(t: torch.Tensor) -> str:
    """A tensor as messages name it: dtype and shape, e.g. 'float32[10, 100]'."""
    return f"{dtype_name(t.dtype)}{list(t.shape)}"


def check_engine(engine: Any) -> None:
    """Raises ImportError if the engine's REDUCE_OPS, OP_KINDS, OP_SPECS or DTYPES differ from these.

    An attribute the engine lacks (a build older than these attributes) is not checked."""
    expected: dict[str, Any] = {
        "REDUCE_OPS": {op.name: op.value for op in ReduceOp},
        "OP_KINDS": {kind.name: kind.value for kind in OpKind},
        "OP_SPECS": {kind.name: spec._asdict() for kind, spec in OP_SPECS.items()},
        "DTYPES": [dtype_name(d) for d in DTYPES],
    }
    for attr, ours in expected.items():
        theirs = getattr(engine, attr, None)
        if theirs is None:
            continue
        if attr == "OP_SPECS":
            theirs = {str(name).upper(): {str(k): bool(v) for k, v in dict(row).items()}
                      for name, row in dict(theirs).items()}
        elif isinstance(ours, dict):
            theirs = {str(name).upper(): int(value) for name, value in dict(theirs).items()}
        else:
            theirs = [str(name).lower() for name in theirs]
        if theirs != ours:
            raise ImportError(
                f"the torchring engine's {attr} is {theirs}, but torchring/_core/types.py says {ours}; "
                "the compiled engine and the Python package come from different versions: "
                "reinstall torchring, or delete its build cache (TORCHRING_CACHE_DIR) to rebuild")


F = TypeVar("F", bound=Callable[..., Any])
_profiler_on = torch._C._autograd._profiler_enabled


def profiled(fn: F, name: str = "") -> F:
    """`fn` shown in torch.profiler as a ``torchring.<name>`` range (name: fn's own unless
    given) while a profiler records (the check costs well under a microsecond when none does).
    A blocking collective's range spans the whole operation; an ``*_async`` one's the
    submission, and ``Handle.wait`` adds a ``torchring.wait`` range for the wait."""
    label = f"torchring.{name or fn.__name__}"

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not _profiler_on():
            return fn(*args, **kwargs)
        with torch.autograd.profiler.record_function(label):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


class Works:
    """Several engine Works waited for as one, under one deadline: what a Handle holds for an
    operation made of several (allreduce_many of several dtypes, a sparse allreduce)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works
        self.seq = works[0].seq if works else -1

    def _each(self, method: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout if timeout > 0 else None
        results = []
        for work in self.works:  # a timeout of 0 waits for ever, so a spent deadline waits 1 us
            left = 0.0 if deadline is None else max(deadline - time.monotonic(), 1e-6)
            results.append(getattr(work, method)(left))
        return results

    def wait(self, timeout: float = 0.0) -> list[Any]:
        """Every work's result, in order."""
        return self._each("wait", timeout)

    def synchronize(self, timeout: float = 0.0) -> list[Any]:
        """Like wait(); device work is also finished on the device."""
        return self._each("synchronize", timeout)

    def is_completed(self) -> bool:
        """True once every work finished."""
        return all(work.is_completed() for work in self.works)


class Handle:
    """An operation in flight: ``wait()`` returns its result or raises its failure."""

    def __init__(self, work: Any, finish: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.work = work  # the engine's Work (an NcclWork on the NCCL path)
        self._finish = finish
        self._done = False
        self._result: Any = None

    @profiled
    def wait(self, timeout: float | None = None) -> Any:
        """Blocks until the operation is done (the GIL is released) and returns its result."""
        if not self._done:
            out = self.work.wait(0.0 if timeout is None else float(timeout))
            self._result = self._finish(out) if self._finish else out
            self._done = True
        return self._result

    def synchronize(self, timeout: float | None = None) -> Any:
        """Like wait(), but for CUDA work also blocks the host until the GPU finished it."""
        if not self._done:
            self.work.synchronize(0.0 if timeout is None else float(timeout))
        return self.wait(timeout)

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not (wait() tells which)."""
        return self._done or self.work.is_completed()

    def source_rank(self) -> int:
        """A recv's sender (for ``src=None``: the rank whose message it took), once wait() returned."""
        source = getattr(self.work, "source", -1)
        if not self._done or source < 0:
            raise RuntimeError(f"torchring.Handle #{self.work.seq}: source_rank() is known for a recv once "
                               "wait() returned; this handle is not a completed recv")
        return int(source)

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<torchring.Handle #{self.work.seq} {state}>"

