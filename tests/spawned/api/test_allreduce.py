"""allreduce: every dtype x op x size on worlds 1-4, over shm, tcp and hybrid (fake two hosts).

Each spawned job sweeps many cases inside its ranks (a spawn costs 1-2 s here) and returns the
list of mismatches against a single-process torch reference; the test asserts that it is empty.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from _checks import (DTYPES, Checker, assert_no_failures, check_transport, expected_allreduce, rank_input,
                     valid_ops)
from _dist import hybrid_env, session, spawn

SIZES = [0, 1, 7, 1000]
BIG = 2**20 + 3


def _allreduce_cases(rank: int, sizes: list[int], big: bool) -> list[str]:
    """Allreduce every dtype/op/size (and a few big and multi-dim tensors); return mismatches."""
    import torchring
    from torchring import ReduceOp

    with session():
        world = torchring.size()
        chk = Checker(rank)
        chk.true("size()", world == int(os.environ["WORLD_SIZE"]), f"size() = {world}")
        check_transport(chk)
        cases = [(d, op, n) for d in DTYPES + [torch.bool] for op in valid_ops(d) for n in sizes]
        if big:
            cases += [(d, op, BIG) for d in (torch.float32, torch.bfloat16) for op in ("SUM", "AVG")]
        for dtype, op, n in cases:
            t = rank_input(rank, world, n, dtype, op)
            out = torchring.allreduce(t, getattr(ReduceOp, op))
            what = f"allreduce({dtype}[{n}], {op})"
            chk.true(what, out is t, "did not return its input tensor")
            chk.equal(what, t, expected_allreduce(world, n, dtype, op), exact=op != "AVG")
        for dtype, op, shape in [(torch.float32, "SUM", (3, 5, 7)), (torch.int32, "MAX", (2, 1, 9))]:
            t = rank_input(rank, world, math.prod(shape), dtype, op, shape)
            torchring.allreduce(t, getattr(ReduceOp, op))
            want = expected_allreduce(world, t.numel(), dtype, op, shape)
            chk.equal(f"allreduce({dtype}{list(shape)}, {op})", t, want)
        t = rank_input(rank, world, 1000, torch.float32)
        torchring.allreduce(t)
        chk.equal("allreduce with the default op", t, expected_allreduce(world, 1000, torch.float32, "SUM"))
        return chk.failures


def _staging_store_cases(rank: int) -> list[str]:
    """The paths whose staging writes TORCHRING_SHM_STORES picks (set by the test): the one-sync
    copy-in from 64 KiB (20 001 float32/int32, 40 000 bf16) and the chunked staged path (several
    segments, a partial last one), each also for a tensor that starts 4 bytes into its storage,
    in every dtype family."""
    import torchring
    from torchring import ReduceOp

    with session():
        world = torchring.size()
        chk = Checker(rank)
        for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int32, torch.uint8):
            for op in [o for o in ("SUM", "MAX", "AVG") if o in valid_ops(dtype)]:
                for n in (20_001, 40_000, 3 * 2**18 + 5):
                    for skip in (0, 1):
                        base = rank_input(rank, world, n + skip, dtype, op)
                        t = base[skip:]
                        torchring.allreduce(t, getattr(ReduceOp, op))
                        want = expected_allreduce(world, n + skip, dtype, op)[skip:]
                        chk.equal(f"allreduce({dtype}[{n}] at element {skip}, {op})", t, want,
                                  exact=op != "AVG")
        return chk.failures


def _wide_accumulation_cases(rank: int) -> list[str]:
    """16-bit SUMs accumulate in float32: big + 1 + 1 (+ 1) must round once, at the end.

    With big = 256 (bf16) or 2048 (fp16) the spacing is 2, so adding the 1s one at a time in 16 bits
    gives big again; the rank holding big varies per element, so every reduction order is hit.
    """
    import torchring

    with session():
        world = torchring.size()
        chk = Checker(rank)
        for dtype, big in ((torch.bfloat16, 256), (torch.float16, 2048)):
            i = torch.arange(3000)
            t = torch.where(i % world == rank, big, 1).to(dtype)
            torchring.allreduce(t)
            want = torch.full((3000,), big + world - 1, dtype=torch.float64).to(dtype)
            chk.equal(f"allreduce({dtype}[3000]) of {big} and 1s", t, want)
        return chk.failures


def _fast_call_cases(rank: int) -> list[str]:
    """The engine's allreduce entry without pybind (bindings.cpp allreduceNowFast), called
    directly: it runs what it can, declines (False, tensor untouched) what the checked path
    must word, and refuses a wrong call with TypeError."""
    import torchring
    from torchring import ReduceOp
    from torchring._core import context as _context

    with session():
        world = torchring.size()
        chk = Checker(rank)
        fast = _context._state.allreduce_now
        t = rank_input(rank, world, 1000, torch.int64, "MAX")
        chk.true("fast call, int64 MAX", fast(t, ReduceOp.MAX) is True, "did not run")
        chk.equal("fast call, int64 MAX", t, expected_allreduce(world, 1000, torch.int64, "MAX"))
        t = rank_input(rank, world, 10, torch.float32)
        chk.true("fast call, op as a plain int", fast(t, int(ReduceOp.SUM)) is True, "did not run")
        chk.equal("fast call, op as a plain int", t, expected_allreduce(world, 10, torch.float32, "SUM"))
        strided = torch.arange(20, dtype=torch.float32)[::2]
        declined = [("a list", [1.0], 0), ("a strided tensor", strided, 0),
                    ("AVG of int32", torch.ones(4, dtype=torch.int32), int(ReduceOp.AVG)),
                    ("op 99", torch.ones(4), 99), ("op -1", torch.ones(4), -1)]
        for what, arg, op in declined:
            before = arg.clone() if isinstance(arg, torch.Tensor) else None
            chk.true(f"fast call with {what}", fast(arg, op) is False, "was not declined")
            if before is not None:
                chk.equal(f"fast call with {what} (left alone)", arg, before)
        for what, args in [("one argument", (torch.ones(2),)), ("a float op", (torch.ones(2), 0.5)),
                           ("three arguments", (torch.ones(2), 0, 0))]:
            try:
                fast(*args)
                chk.true(f"fast call with {what}", False, "raised nothing")
            except TypeError:
                pass
        t = rank_input(rank, world, 5, torch.float32)
        torchring.allreduce(t)  # the ranks are still in step after the refused calls
        chk.equal("allreduce after the fast calls", t, expected_allreduce(world, 5, torch.float32, "SUM"))
        return chk.failures


def _fast_call_group_cases(rank: int) -> list[str]:
    """The engine's allreduce entry on a group's communicator (torchring.allreduce takes it for
    the world only): an allreduce run inline has no handle, so its failure must still carry the
    group's words and leave the group usable; one issued behind a running allreduce_async (the
    last rank comes late to it, so on the others it is still running) gets a handle and waits its
    turn."""
    import torchring
    from torchring import ReduceOp
    from torchring._core import context as _context

    with session():
        world = torchring.size()
        chk = Checker(rank)
        group = torchring.new_group(list(range(world)))
        fast = _context._state.engine.allreduce_now_function(group._comm)
        try:
            fast(torch.ones(3 + rank), int(ReduceOp.SUM))
            chk.true("fast call with shapes that differ", False, "raised nothing")
        except torchring.CollectiveMismatchError as e:
            words = f"group {group._gid} of world ranks"
            chk.true("fast call with shapes that differ", str(e).startswith(words) and "does not match" in str(e),
                     f"the message does not start with {words!r} or name the mismatch: {e}")
        t = rank_input(rank, world, 7, torch.int32)
        chk.true("fast call after the mismatch", fast(t, int(ReduceOp.SUM)) is True, "did not run")
        chk.equal("fast call after the mismatch", t, expected_allreduce(world, 7, torch.int32, "SUM"))
        for n in (BIG, 1000):
            queued = rank_input(rank, world, n, torch.float32)
            if rank == world - 1:  # the others' allreduce_async waits for this rank: their fast call queues
                time.sleep(0.3)
            handle = group.allreduce_async(queued)
            t = rank_input(rank, world, 9, torch.int64, "MAX")
            chk.true(f"fast call behind allreduce_async([{n}])", fast(t, int(ReduceOp.MAX)) is True, "did not run")
            chk.equal(f"fast call behind allreduce_async([{n}])", t, expected_allreduce(world, 9, torch.int64, "MAX"))
            handle.wait()
            chk.equal(f"allreduce_async([{n}]) before the fast call", queued,
                      expected_allreduce(world, n, torch.float32, "SUM"))
        return chk.failures


def _async_cases(rank: int) -> list[str]:
    """Issue several allreduce_async, one sync allreduce in between, then wait in order."""
    import torchring
    from torchring import ReduceOp

    with session():
        world = torchring.size()
        chk = Checker(rank)
        specs = [(torch.float32, "SUM", 1000), (torch.int64, "MAX", 7), (torch.bfloat16, "AVG", 4097),
                 (torch.uint8, "PRODUCT", 33), (torch.float64, "MIN", 0), (torch.float32, "SUM", BIG),
                 (torch.int8, "SUM", 1), (torch.float16, "PRODUCT", 999)]
        pending = []
        for dtype, op, n in specs:
            t = rank_input(rank, world, n, dtype, op)
            pending.append((torchring.allreduce_async(t, getattr(ReduceOp, op)), t, dtype, op, n))
        mid = rank_input(rank, world, 100, torch.int32)
        torchring.allreduce(mid)
        want = expected_allreduce(world, 100, torch.int32, "SUM")
        chk.equal("sync allreduce between async ones", mid, want)
        for i, (handle, t, dtype, op, n) in enumerate(pending):
            what = f"handle {i}: allreduce_async({dtype}[{n}], {op})"
            handle.is_completed()  # asks the engine while the op may still run; either answer is right
            out = handle.wait(timeout=60) if i % 2 else handle.wait()
            chk.true(what, out is t, "wait() did not return the input tensor")
            chk.true(what, handle.is_completed() is True, "is_completed() is not True after wait()")
            chk.equal(what, t, expected_allreduce(world, n, dtype, op), exact=op != "AVG")
        t = rank_input(rank, world, 10, torch.float32)
        torchring.allreduce_async(t).wait()
        want = expected_allreduce(world, 10, torch.float32, "SUM")
        chk.equal("allreduce_async with the default op", t, want)
        return chk.failures


def _shm_tensor_cases(rank: int) -> list[str]:
    """torchring.empty tensors behave like torch tensors and allreduce to the same results."""
    import torchring
    from torchring import ReduceOp

    with session():
        world = torchring.size()
        chk = Checker(rank)
        kept = []
        for shape, dtype, op in [((1000,), torch.float32, "SUM"), ((4, 250), torch.bfloat16, "MAX"),
                                 ((BIG,), torch.float32, "SUM"), ((0,), torch.float32, "SUM"),
                                 ((3, 7), torch.int64, "PRODUCT"), ((5,), torch.float64, "AVG")]:
            what = f"torchring.empty({shape}, {dtype}) {op}"
            t = torchring.empty(shape, dtype=dtype)
            chk.true(what, tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous(),
                     f"got {t.dtype}{list(t.shape)} contiguous={t.is_contiguous()}")
            n = t.numel()
            t.copy_(rank_input(rank, world, n, dtype, op, shape))
            chk.equal(what + " holds what was copied in", t * 1, rank_input(rank, world, n, dtype, op, shape))
            out = torchring.allreduce(t, getattr(ReduceOp, op))
            chk.true(what, out is t, "did not return its input tensor")
            chk.equal(what, t, expected_allreduce(world, n, dtype, op, shape), exact=op != "AVG")
            kept.append(t)
        default = torchring.empty((8,))
        chk.true("torchring.empty default dtype", default.dtype == torch.float32, f"got {default.dtype}")
        del kept  # freeing and allocating again must work
        t = torchring.empty((1000,), dtype=torch.float32)
        t.copy_(rank_input(rank, world, 1000, torch.float32))
        torchring.allreduce(t)
        want = expected_allreduce(world, 1000, torch.float32, "SUM")
        chk.equal("torchring.empty after freeing others", t, want)
        # A forked child (a DataLoader worker) that frees its copy must leave the parent's be.
        forked = torchring.empty((BIG,), dtype=torch.float32)
        forked.fill_(rank + 1)
        pid = os.fork()
        if pid == 0:
            del forked
            os._exit(0)
        os.waitpid(pid, 0)
        chk.equal("torchring.empty after a forked child freed its copy", forked,
                  torch.full((BIG,), float(rank + 1)))
        return chk.failures


def _fast_path_cases(rank: int) -> list[str]:
    """torchring.allreduce's common call goes straight to the engine; what its Python checks
    refuse must still be refused with their words, and the profiler must still see the call."""
    import torchring
    from torchring import ReduceOp

    with session():
        world, chk = torchring.size(), Checker(rank)
        want = expected_allreduce(world, 10, torch.float32, "SUM")
        with torch.profiler.profile() as prof:
            got = torchring.allreduce(rank_input(rank, world, 10, torch.float32))
        chk.equal("allreduce under the profiler", got, want)
        names = {e.name for e in prof.events()}
        chk.true("profiler range", "torchring.allreduce" in names, f"no torchring.allreduce in {sorted(names)[:20]}")
        param = torch.nn.Parameter(rank_input(rank, world, 10, torch.float32), requires_grad=False)
        chk.equal("allreduce of a Parameter (a Tensor subclass)", torchring.allreduce(param).data, want)
        chk.equal("allreduce with an int prescale_factor=1 (the checked path)",
                  torchring.allreduce(rank_input(rank, world, 10, torch.float32), prescale_factor=1), want)
        refused = [
            ("a non-contiguous tensor", lambda: torchring.allreduce(torch.zeros(4, 4).t()), ValueError,
             "is not contiguous"),
            ("AVG of int32", lambda: torchring.allreduce(torch.zeros(4, dtype=torch.int32), ReduceOp.AVG),
             ValueError, "AVG needs a floating-point tensor"),
            ("SUM of bool", lambda: torchring.allreduce(torch.zeros(4, dtype=torch.bool)), TypeError,
             "bool tensors support ReduceOp.MIN, MAX, BAND, BOR and BXOR only"),
            ("BXOR of float32", lambda: torchring.allreduce(torch.zeros(4), ReduceOp.BXOR), TypeError,
             "ReduceOp.BXOR needs an integer or bool tensor, got float32[4]"),
            ("op given as an int", lambda: torchring.allreduce(torch.zeros(4), 0), TypeError,
             "op must be a torchring.ReduceOp"),
            ("prescale_factor=True", lambda: torchring.allreduce(torch.zeros(4), prescale_factor=True), ValueError,
             "prescale_factor must be a finite number"),
            ("a complex tensor", lambda: torchring.allreduce(torch.zeros(4, dtype=torch.complex64)), TypeError,
             "has a dtype torchring does not support"),
            ("a list", lambda: torchring.allreduce([1.0, 2.0]), TypeError, "expects a torch.Tensor"),
        ]
        for what, call, kind, words in refused:
            try:
                call()
                chk.fail(what, "was not refused")
            except kind as exc:
                chk.true(what, words in str(exc) and f"rank {rank}" in str(exc), f"message: {exc}")
        chk.equal("allreduce after the refusals", torchring.allreduce(rank_input(rank, world, 10, torch.float32)),
                  want)
        return chk.failures


@pytest.mark.parametrize("world", [1, 2])
def test_fast_path_keeps_the_checks_and_the_profiler_range(world: int) -> None:
    assert_no_failures(spawn(world, _fast_path_cases))


def test_world1() -> None:
    assert_no_failures(spawn(1, _allreduce_cases, SIZES, True))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sweep(transport: str, world: int) -> None:
    results = spawn(world, _allreduce_cases, SIZES, world < 4, env={"TORCHRING_TRANSPORT": transport})
    assert_no_failures(results)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stores", ["cached", "streaming", "auto"])
def test_staging_stores(stores: str, world: int) -> None:
    env = {"TORCHRING_TRANSPORT": "shm", "TORCHRING_SHM_STORES": stores}
    assert_no_failures(spawn(world, _staging_store_cases, env=env))


@pytest.mark.parametrize("hosts", ["aabb", "abb"])
def test_hybrid(hosts: str) -> None:
    results = spawn(len(hosts), _allreduce_cases, SIZES, hosts == "abb", rank_env=hybrid_env(hosts))
    assert_no_failures(results)


@pytest.mark.parametrize("setup", ["shm", "tcp", "hybrid"])
def test_16bit_accumulates_in_fp32(setup: str) -> None:
    if setup == "hybrid":
        results = spawn(4, _wide_accumulation_cases, rank_env=hybrid_env("aabb"))
    else:
        results = spawn(3, _wide_accumulation_cases, env={"TORCHRING_TRANSPORT": setup})
    assert_no_failures(results)


@pytest.mark.parametrize("world", [1, 3])
def test_fast_call(world: int) -> None:
    assert_no_failures(spawn(world, _fast_call_cases))


@pytest.mark.parametrize("world", [2, 3])
def test_fast_call_on_a_group(world: int) -> None:
    assert_no_failures(spawn(world, _fast_call_group_cases))


@pytest.mark.parametrize("world,transport", [(2, "tcp"), (3, "shm")])
def test_async(world: int, transport: str) -> None:
    assert_no_failures(spawn(world, _async_cases, env={"TORCHRING_TRANSPORT": transport}))


@pytest.mark.parametrize("world,transport", [(2, "shm"), (3, "tcp")])
def test_shm_tensors(world: int, transport: str) -> None:
    assert_no_failures(spawn(world, _shm_tensor_cases, env={"TORCHRING_TRANSPORT": transport}))
