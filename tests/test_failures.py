"""Failure handling: mismatched collectives, a SIGKILLed rank, hostile connections, bad calls.

Also the life cycle: ops before init(), init() twice, init() after shutdown(), and a world of one
with no launcher environment (which must not touch the network).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import re
import signal
import socket
import struct
import time
from typing import Any, Callable

import pytest
import torch

from _checks import Checker, expected_allreduce, rank_input
from _dist import Job, hybrid_env, run_alone, spawn

# One collective call: (kind, dtype, numel, op, src, inner dims for allgather).
Call = tuple[str, torch.dtype, int, str, int, tuple[int, ...]]
_AR: Call = ("allreduce", torch.float32, 1000, "SUM", 0, ())
# case -> (calls of the ranks that agree, calls of the odd rank, words the error must contain)
MISMATCHES: dict[str, tuple[list[Call], list[Call], list[str]]] = {
    "count": ([_AR], [("allreduce", torch.float32, 999, "SUM", 0, ())], ["1000", "999"]),
    "dtype": ([_AR], [("allreduce", torch.float64, 1000, "SUM", 0, ())], ["float32", "float64"]),
    "op": ([_AR], [("allreduce", torch.float32, 1000, "MAX", 0, ())], ["SUM", "MAX"]),
    "root": ([("broadcast", torch.float32, 10, "SUM", 0, ())], [("broadcast", torch.float32, 10, "SUM", 1, ())],
             ["broadcast"]),
    "kind": ([_AR], [("broadcast", torch.float32, 1000, "SUM", 0, ())], ["allreduce", "broadcast"]),
    "order": ([_AR, ("allgather", torch.float32, 6, "SUM", 0, (3,))],
              [("allgather", torch.float32, 6, "SUM", 0, (3,)), _AR], ["allreduce", "allgather"]),
    "allgather_dims": ([("allgather", torch.float32, 6, "SUM", 0, (3,))],
                       [("allgather", torch.float32, 8, "SUM", 0, (4,))], ["allgather"]),
}
KILL_TIMEOUT = 4.0  # TORCHRING_TIMEOUT for the SIGKILL tests
KILL_MARGIN = 8.0  # how much later than the timeout the survivors may raise


def _issue(call: Call, rank: int) -> None:
    import torchring

    kind, dtype, n, op, src, inner = call
    t = rank_input(rank, 2, n, dtype, "SUM", (n // max(1, inner[0]), *inner) if inner else None)
    if kind == "allreduce":
        torchring.allreduce(t, getattr(torchring.ReduceOp, op))
    elif kind == "broadcast":
        torchring.broadcast(t, src)
    else:
        torchring.allgather(t)


def _mismatch_job(rank: int, case: str, odd: int) -> dict[str, Any]:
    """Two good allreduces, then the case's calls; report the error, the next op, and a re-init."""
    import torchring

    agree, differ, _ = MISMATCHES[case]
    torchring.init()
    world = torchring.size()
    for _ in range(2):
        torchring.allreduce(torch.ones(8))
    start, error = time.monotonic(), None
    try:
        for call in differ if rank == odd else agree:
            _issue(call, rank)
    except torchring.TorchringError as e:
        error = str(e)
    elapsed = time.monotonic() - start
    try:
        torchring.allreduce(torch.ones(8))
        after = "no error"
    except Exception as e:  # noqa: BLE001 - the type is the result
        after = type(e).__name__
    torchring.shutdown()
    torchring.init()
    t = rank_input(rank, world, 100, torch.float32)
    torchring.allreduce(t)
    reinit_ok = torch.equal(t, expected_allreduce(world, 100, torch.float32, "SUM"))
    torchring.shutdown()
    return {"error": error, "elapsed": elapsed, "after": after, "reinit_ok": reinit_ok}


@pytest.mark.parametrize("case,world,transport", [(c, 2, "shm") for c in MISMATCHES] +
                         [("count", 2, "tcp"), ("dtype", 3, "shm"), ("op", 3, "tcp")])
def test_mismatch(case: str, world: int, transport: str) -> None:
    odd = world - 1
    results = spawn(world, _mismatch_job, case, odd, env={"TORCHRING_TRANSPORT": transport, "TORCHRING_TIMEOUT": "20"})
    for rank, r in enumerate(results):
        err = r["error"]
        assert err is not None, f"rank {rank}: no TorchringError for a {case} mismatch"
        others = [p for p in range(world) if p != odd]
        assert f"rank {odd}" in err and any(f"rank {p}" in err for p in others), f"rank {rank}: ranks not named: {err}"
        for word in MISMATCHES[case][2]:
            assert word in err, f"rank {rank}: {word!r} missing from {err!r}"
        assert r["elapsed"] < 10, f"rank {rank}: mismatch took {r['elapsed']:.1f} s to detect"
        assert r["after"] == "TorchringError", f"rank {rank}: the op after a failure gave {r['after']}"
        assert r["reinit_ok"], f"rank {rank}: wrong allreduce result after shutdown() + init()"


def _kill_job(rank: int, victim: int, use_async: bool, init_timeout: float | None) -> dict[str, Any]:
    """The victim SIGKILLs itself after two good allreduces; the others time their failure."""
    import torchring

    if init_timeout:
        torchring.init(init_timeout)
    else:
        torchring.init()
    for _ in range(2):
        torchring.allreduce(torch.ones(1000))
    if rank == victim:
        time.sleep(0.5)  # let the others block in the next allreduce first
        os.kill(os.getpid(), signal.SIGKILL)
    start, error = time.monotonic(), None
    try:
        for _ in range(5):
            t = torch.ones(1000)
            if use_async:
                torchring.allreduce_async(t).wait()
            else:
                torchring.allreduce(t)
    except torchring.TorchringError as e:
        error = str(e)
    elapsed = time.monotonic() - start
    try:
        torchring.allreduce(torch.ones(4))
        after = "no error"
    except Exception as e:  # noqa: BLE001 - the type is the result
        after = type(e).__name__
    torchring.shutdown()
    return {"error": error, "elapsed": elapsed, "after": after}


@pytest.mark.parametrize("world,victim,setup", [(3, 1, "shm"), (3, 1, "tcp"), (4, 2, "hybrid")])
def test_sigkill(world: int, victim: int, setup: str) -> None:
    use_async = setup == "shm"
    init_timeout = KILL_TIMEOUT if setup == "tcp" else None  # tcp: init(timeout) beats the env
    env = {"TORCHRING_TIMEOUT": "60" if init_timeout else str(KILL_TIMEOUT)}
    if setup != "hybrid":
        env["TORCHRING_TRANSPORT"] = setup
    rank_env = hybrid_env("aabb") if setup == "hybrid" else None
    outcomes = spawn(world, _kill_job, victim, use_async, init_timeout, env=env, rank_env=rank_env,
                     timeout=60, expect_fail=True)
    assert outcomes[victim].exitcode == -signal.SIGKILL, outcomes[victim].describe()
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.ok, o.describe()
        r = o.value
        assert r["error"] is not None, f"rank {o.rank}: no TorchringError after rank {victim} was killed"
        assert re.search(rf"\b(rank|peer) {victim}\b", r["error"]), f"rank {o.rank}: victim not named: {r['error']}"
        assert r["elapsed"] < KILL_TIMEOUT + KILL_MARGIN, f"rank {o.rank}: raised after {r['elapsed']:.1f} s"
        assert r["after"] == "TorchringError", f"rank {o.rank}: the op after a failure gave {r['after']}"


def _hostile_job(rank: int, late: int) -> list[str]:
    """Rank ``late`` joins 2 s late so the attacker reaches rank 0 before its left neighbour."""
    import torchring

    if rank == late:
        time.sleep(2.0)
    torchring.init()
    try:
        world = torchring.size()
        chk = Checker(rank)
        for dtype, op, n in [(torch.float32, "SUM", 1000), (torch.int64, "MAX", 7), (torch.bfloat16, "SUM", 70000)]:
            t = rank_input(rank, world, n, dtype, op)
            torchring.allreduce(t, getattr(torchring.ReduceOp, op))
            chk.equal(f"allreduce({dtype}[{n}], {op})", t, expected_allreduce(world, n, dtype, op))
        return chk.failures
    finally:
        torchring.shutdown()


def _attack(job: Job) -> None:
    """Read rank 0's info from the store, open garbage connections to its port, expect them closed."""
    key = job.key_prefix() + "info/0"
    job.store.wait([key], datetime.timedelta(seconds=30))
    info = json.loads(job.store.get(key))
    assert {"host", "addr", "port", "pid"} <= set(info), f"info/0 lacks fields: {info}"
    assert isinstance(info["port"], int), f"no TCP port published with TORCHRING_TRANSPORT=tcp: {info}"
    garbage = random.Random(0).randbytes(4096)
    wrong_secret = struct.pack("<4sqq", b"TRNG", job.world_size - 1, job.world_size) + bytes(64)
    socks = []
    for payload in (garbage, wrong_secret, b""):
        s = socket.create_connection((info["addr"], info["port"]), timeout=5)
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        socks.append(s)
    for name, s in zip(("garbage", "wrong secret", "empty"), socks):
        s.settimeout(30)
        try:
            while s.recv(65536):
                pass
        except ConnectionResetError:
            pass
        except socket.timeout:
            pytest.fail(f"the {name} connection to rank 0 was still open after 30 s")
        finally:
            s.close()


@pytest.mark.parametrize("world", [2, 3])
def test_hostile_connection(world: int) -> None:
    results = spawn(world, _hostile_job, world - 1, env={"TORCHRING_TRANSPORT": "tcp", "TORCHRING_TIMEOUT": "20"},
                    on_start=_attack)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures)


def _raises(chk: Checker, what: str, exc: type[BaseException], fn: Callable[[], Any], *words: str) -> None:
    """Record a failure unless fn() raises ``exc`` whose message mentions every word."""
    try:
        fn()
    except exc as e:
        missing = [w for w in words if w.lower() not in str(e).lower()]
        chk.true(what, not missing, f"{type(e).__name__}({str(e)!r}) does not mention {missing}")
    except Exception as e:  # noqa: BLE001
        chk.fail(what, f"raised {type(e).__name__}({str(e)!r}), expected {exc.__name__}")
    else:
        chk.fail(what, f"did not raise {exc.__name__}")


def _all_ops(t: torch.Tensor) -> dict[str, Callable[[], Any]]:
    import torchring

    return {"allreduce": lambda: torchring.allreduce(t), "allreduce_async": lambda: torchring.allreduce_async(t),
            "broadcast": lambda: torchring.broadcast(t), "allgather": lambda: torchring.allgather(t),
            "reduce_scatter": lambda: torchring.reduce_scatter(t), "barrier": torchring.barrier,
            "broadcast_object": lambda: torchring.broadcast_object(1), "allgather_object": lambda: torchring.allgather_object(1)}


def _bad_calls_job(rank: int) -> tuple[list[str], list[str]]:
    """Before init, after init with bad arguments, after shutdown; then a good allreduce."""
    import torchring
    from torchring import ReduceOp

    chk = Checker(rank)
    chk.true("is_initialized() before init()", torchring.is_initialized() is False)
    for name, op in _all_ops(torch.ones(4)).items():
        _raises(chk, f"{name} before init()", RuntimeError, op, "init")
    torchring.init()
    world = torchring.size()
    ones = torch.ones(4)
    bad = [("non-contiguous allreduce", ValueError, lambda: torchring.allreduce(torch.ones(4, 4).t()), ["contiguous"]),
           ("non-contiguous allreduce_async", ValueError,
            lambda: torchring.allreduce_async(torch.ones(4, 4).t()).wait(), ["contiguous"]),
           ("non-contiguous broadcast", ValueError, lambda: torchring.broadcast(torch.ones(4, 4)[:, 1]), ["contiguous"]),
           ("sparse allreduce", TypeError, lambda: torchring.allreduce(torch.eye(3).to_sparse()), ["sparse"]),
           ("sparse allgather", TypeError, lambda: torchring.allgather(torch.eye(3).to_sparse()), ["sparse"]),
           ("complex64 allreduce", TypeError, lambda: torchring.allreduce(torch.ones(3, dtype=torch.complex64)), ["complex64"]),
           ("complex64 reduce_scatter", TypeError,
            lambda: torchring.reduce_scatter(torch.ones(2 * world, dtype=torch.complex64)), ["complex64"]),
           ("bool SUM", TypeError, lambda: torchring.allreduce(torch.ones(3, dtype=torch.bool)), ["bool"]),
           ("int32 AVG", ValueError, lambda: torchring.allreduce(torch.ones(3, dtype=torch.int32), ReduceOp.AVG), ["avg"]),
           ("broadcast src=size()", ValueError, lambda: torchring.broadcast(ones, src=world), [str(world)]),
           ("broadcast src=-1", ValueError, lambda: torchring.broadcast(ones, src=-1), ["-1"]),
           ("allreduce(list)", TypeError, lambda: torchring.allreduce([1.0, 2.0]), ["tensor", "list"]),
           ("broadcast(int)", TypeError, lambda: torchring.broadcast(3), ["tensor", "int"]),
           ("reduce_scatter dim 0 not divisible", ValueError, lambda: torchring.reduce_scatter(torch.ones(2 * world + 1)),
            [str(2 * world + 1)])]
    for what, exc, fn, words in bad:
        _raises(chk, what, exc, fn, *words)
    usable = Checker(rank)
    t = rank_input(rank, world, 100, torch.float32)
    torchring.allreduce(t)
    usable.equal("allreduce after the bad calls", t, expected_allreduce(world, 100, torch.float32, "SUM"))
    torchring.shutdown()
    chk.true("is_initialized() after shutdown()", torchring.is_initialized() is False)
    _raises(chk, "allreduce after shutdown()", RuntimeError, lambda: torchring.allreduce(ones), "init")
    return chk.failures, usable.failures


def test_bad_calls() -> None:
    results = spawn(2, _bad_calls_job)
    failures = [f for bad, _ in results for f in bad]
    assert not failures, f"{len(failures)} bad calls mishandled:\n" + "\n".join(failures)
    unusable = [f for _, usable in results for f in usable]
    assert not unusable, "bad calls broke the communicator:\n" + "\n".join(unusable)


def _lifecycle_job(rank: int) -> list[str]:
    """init() twice, then three init()/shutdown() generations with a checked allreduce in each."""
    import torchring

    chk = Checker(rank)
    torchring.init()
    torchring.init()
    for gen in range(3):
        if gen:
            torchring.init()
        world = torchring.size()
        chk.true(f"generation {gen}: is_initialized, rank, size",
                 (torchring.is_initialized(), torchring.rank(), world) == (True, rank, int(os.environ["WORLD_SIZE"])))
        t = rank_input(rank, world, 1000 + gen, torch.float32)
        torchring.allreduce(t)
        chk.equal(f"generation {gen}: allreduce", t, expected_allreduce(world, 1000 + gen, torch.float32, "SUM"))
        torchring.shutdown()
        chk.true(f"generation {gen}: is_initialized() after shutdown()", torchring.is_initialized() is False)
    return chk.failures


@pytest.mark.parametrize("host_store,transport", [(True, "shm"), (False, "tcp")])
def test_init_twice_and_after_shutdown(host_store: bool, transport: str) -> None:
    results = spawn(2, _lifecycle_job, env={"TORCHRING_TRANSPORT": transport}, host_store=host_store)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures)


def _socket_count() -> int:
    fds = os.listdir("/proc/self/fd")
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sum(link.startswith("socket:") for link in links)


def _alone_job(rank: int) -> list[str]:
    """No launcher env: world of one, no new sockets, every collective is the identity."""
    import torchring

    chk = Checker(rank)
    _raises(chk, "allreduce before init()", RuntimeError, lambda: torchring.allreduce(torch.ones(2)), "init")
    before = _socket_count()
    torchring.init()
    chk.true("no sockets", _socket_count() == before, f"{_socket_count() - before} sockets opened")
    got = (torchring.rank(), torchring.size(), torchring.local_rank(), torchring.local_size())
    chk.true("(rank, size, local_rank, local_size)", got == (0, 1, 0, 1), f"got {got}")
    for op in ("SUM", "AVG", "MAX", "PRODUCT"):
        t = rank_input(0, 1, 100, torch.float32, op)
        chk.equal(f"allreduce {op}", torchring.allreduce(t.clone(), getattr(torchring.ReduceOp, op)), t)
    t = rank_input(0, 1, 12, torch.int32, shape=(6, 2))
    chk.equal("broadcast", torchring.broadcast(t.clone()), t)
    chk.equal("allgather", torchring.allgather(t), t)
    chk.equal("reduce_scatter", torchring.reduce_scatter(t), t)
    torchring.barrier()
    chk.true("objects", torchring.broadcast_object({"a": 1}) == {"a": 1} and torchring.allgather_object(2) == [2])
    torchring.shutdown()
    return chk.failures


def test_world1_without_env() -> None:
    failures = run_alone(_alone_job)
    assert not failures, "\n".join(failures)
