"""The mismatch cases both mismatch tiers run (tests/spawned/api/test_mismatch.py across processes,
tests/engine/test_engine_mismatch.py on threads), and how a mismatch error must name them."""

from __future__ import annotations

import re

import torch

from torchring._core.types import dtype_name

# One collective call: (kind, dtype, shape, op, src).
Call = tuple[str, torch.dtype, tuple[int, ...], str, int]
_AR: Call = ("allreduce", torch.float32, (1000,), "SUM", 0)
_AG: Call = ("allgather", torch.float32, (2, 3), "SUM", 0)
# case -> (calls of the ranks that agree, calls of the odd rank, words the error must contain)
MISMATCHES: dict[str, tuple[list[Call], list[Call], list[str]]] = {
    "count": ([_AR], [("allreduce", torch.float32, (999,), "SUM", 0)], ["float32[1000]", "float32[999]"]),
    "shape": ([("allreduce", torch.float32, (10, 100), "SUM", 0)],
              [("allreduce", torch.float32, (100, 10), "SUM", 0)], ["[10, 100]", "[100, 10]"]),
    "dtype": ([_AR], [("allreduce", torch.float64, (1000,), "SUM", 0)], ["float32", "float64"]),
    "op": ([_AR], [("allreduce", torch.float32, (1000,), "MAX", 0)], ["SUM", "MAX"]),
    "root": ([("broadcast", torch.float32, (10,), "SUM", 0)],
             [("broadcast", torch.float32, (10,), "SUM", 1)], ["root=0", "root=1"]),
    "broadcast_shape": ([("broadcast", torch.int64, (4, 6), "SUM", 0)],
                        [("broadcast", torch.int64, (6, 4), "SUM", 0)], ["int64[4, 6]", "int64[6, 4]"]),
    "kind": ([_AR], [("broadcast", torch.float32, (1000,), "SUM", 0)], ["allreduce", "broadcast"]),
    "order": ([_AR, _AG], [_AG, _AR], ["allreduce", "allgather"]),
    "allgather_rows": ([_AG], [("allgather", torch.float32, (2, 4), "SUM", 0)],
                       ["float32[2, 3]", "float32[2, 4]"]),
    # dim 0 of 12 and 24 rows divides every world size used here
    "reduce_scatter_shape": ([("reduce_scatter", torch.int32, (12, 2), "SUM", 0)],
                             [("reduce_scatter", torch.int32, (24, 1), "SUM", 0)],
                             ["int32[12, 2]", "int32[24, 1]"]),
    "barrier": ([("barrier", torch.float32, (), "SUM", 0)], [_AR], ["barrier", "allreduce"]),
}
# The async case: a 7-element allreduce on the odd rank, 8 elements on the others.
ASYNC_CASE: tuple[list[Call], list[Call]] = ([("allreduce", torch.float32, (8,), "SUM", 0)],
                                             [("allreduce", torch.float32, (7,), "SUM", 0)])


def call_text(call: Call, world: int) -> str:
    """How a mismatch error names one call: kind, dtype[shape], then the op or the root."""
    kind, dtype, shape, op, src = call
    if kind == "barrier":
        return "barrier"
    text = f"{kind} {dtype_name(dtype)}{list(shape)}"
    if kind in ("allreduce", "reduce_scatter"):
        text += f" {op}"
    elif kind == "broadcast":
        text += f" root={min(src, world - 1)}"
    return text


def expected_pair(agree: list[Call], differ: list[Call], odd: int, world: int,
                  i: int) -> tuple[int, str, str]:
    """(first differing rank, rank 0's call, that rank's call) for the i-th call of a case."""
    first = odd if odd != 0 else 1  # the lowest rank whose header differs from rank 0's
    mine = differ if odd == 0 else agree
    theirs = differ if odd != 0 else agree
    return first, call_text(mine[i], world), call_text(theirs[i], world)


_SENT = re.compile(r"rank (\d+) sent ")


def message_problem(err: str | None, rank: int, pair: tuple[int, str, str]) -> str | None:
    """What is wrong with rank `rank`'s mismatch message, or None if it names exactly `pair`."""
    if err is None:
        return "no CollectiveMismatchError"
    first, mine, theirs = pair
    if not err.startswith(f"rank {rank}: "):
        return f"the message does not start with 'rank {rank}: ': {err!r}"
    want = f"rank 0 sent {mine}, rank {first} sent {theirs}; "
    if want not in err:
        return f"expected it to contain {want!r}: {err!r}"
    named = _SENT.findall(err)
    if named != ["0", str(first)]:
        return f"it names ranks {named} as senders, expected ['0', '{first}']: {err!r}"
    return None
