"""Failure handling (mismatches: test_mismatch.py): a killed or stopped rank, hostile connections, bad calls.

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
import subprocess
import sys
import time
import uuid
from typing import Any, Callable

import pytest
import torch

from _checks import Checker, expected_allreduce, rank_input
from _dist import Job, StoreGate, free_port, hybrid_env, launch_env, run_alone, session, spawn

KILL_TIMEOUT = 4.0  # TORCHRING_TIMEOUT for the dead and silent peer tests
KILL_MARGIN = 8.0  # how much later than the timeout the survivors may raise


def _gpu_check_job(rank: int, odd: int) -> dict[str, Any]:
    """The engine's side of NCCL's header checks (submit_check), on CPU "like" tensors: agreeing
    checks pass in order with CPU collectives; a count mismatch, and a check against a CPU
    collective, fail on every rank."""
    import torchring
    from torchring._core import context as _context
    from torchring._core.types import OpKind as _Kind, ReduceOp

    def check(kind: _Kind, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, root: int = -1) -> Any:
        return _context.communicator("test").submit_check(int(kind), t, int(op), root)

    def error_of(work: Any) -> str | None:
        try:
            work.wait(20.0)
        except torchring.TorchringError as e:
            return str(e)
        return None

    out: dict[str, Any] = {}
    with session():
        world = torchring.size()
        first = check(_Kind.ALLREDUCE, torch.zeros(10))
        t = rank_input(rank, world, 100, torch.float32)
        torchring.allreduce(t)
        second = check(_Kind.BROADCAST, torch.zeros(5), root=world - 1)
        out["agree"] = [error_of(first), error_of(second)]
        out["cpu_result_ok"] = torch.equal(t, expected_allreduce(world, 100, torch.float32, "SUM"))
        out["count"] = error_of(check(_Kind.ALLREDUCE, torch.zeros(11 if rank == odd else 10)))
    with session():  # a fresh communicator for the CPU-vs-CUDA case
        if rank == odd:
            try:
                torchring.allreduce(torch.zeros(10))
                out["cpu_vs_gpu"] = None
            except torchring.TorchringError as e:
                out["cpu_vs_gpu"] = str(e)
        else:
            out["cpu_vs_gpu"] = error_of(check(_Kind.ALLREDUCE, torch.zeros(10)))
    return out


@pytest.mark.parametrize("world,transport", [(2, "shm"), (3, "shm"), (3, "tcp")])
def test_gpu_header_checks(world: int, transport: str) -> None:
    odd = world - 1
    env = {"TORCHRING_TIMEOUT": "20", "TORCHRING_TRANSPORT": transport}
    for rank, r in enumerate(spawn(world, _gpu_check_job, odd, env=env)):
        assert r["agree"] == [None, None], f"rank {rank}: agreeing checks failed: {r['agree']}"
        assert r["cpu_result_ok"], f"rank {rank}: CPU allreduce between checks gave a wrong result"
        err = r["count"]
        assert err is not None, f"rank {rank}: no error for a count mismatch"
        for word in ("float32[10]", "float32[11]", "on CUDA", f"rank {odd}"):
            assert word in err, f"rank {rank}: {word!r} missing from {err!r}"
        err = r["cpu_vs_gpu"]
        assert err is not None and "on CUDA" in err, f"rank {rank}: CPU vs CUDA collective: {err!r}"


_PIDNS_RANK = """
import time, torch, torchring
torchring.init()
assert torchring.transport() == "shm", torchring.transport()
rank = torchring.rank()
for slow in (1, 0):  # each rank in turn makes the other wait well past the 50 ms liveness check
    if rank == slow:
        time.sleep(1.0)
    t = torch.full((1000,), float(rank + 1))
    torchring.allreduce(t)
    assert torch.equal(t, torch.full((1000,), 3.0)), t[:4]
torchring.shutdown()
print("ok", flush=True)
"""


def test_peer_in_another_pid_namespace() -> None:
    """Ranks in separate PID namespaces that share /dev/shm (containers of one pod): each sees the
    other's pid as meaningless, which must not be taken for a dead peer."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a PID namespace here (unshare: {probe.stderr.decode().strip()})")
    base = {**os.environ, "TORCHRING_TIMEOUT": "30", "TORCHRING_TRANSPORT": "shm"}
    base.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 hosts the store
    port, job_id = free_port(), f"pidns-{uuid.uuid4().hex[:8]}"
    cmds = [[sys.executable, "-c", _PIDNS_RANK],
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _PIDNS_RANK]]
    procs = [subprocess.Popen(cmd, env={**base, **launch_env(r, 2, port, job_id)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r, cmd in enumerate(cmds)]
    try:
        outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and out.rstrip().endswith("ok"), f"rank {r} (exit {p.returncode}):\n{out}"


def _kill_job(rank: int, victim: int, sig: int, use_async: bool,
              init_timeout: float | None) -> dict[str, Any]:
    """The victim sends itself ``sig`` after two good allreduces; the others time their failure.

    A SIGSTOPped victim is SIGKILLed by the survivors once they have raised.
    """
    import torchring

    if init_timeout:
        torchring.init(init_timeout)
    else:
        torchring.init()
    pids = torchring.allgather_object(os.getpid())
    for _ in range(2):
        torchring.allreduce(torch.ones(1000))
    if rank == victim:
        time.sleep(0.5)  # let the others block in the next allreduce first
        os.kill(os.getpid(), sig)
    start, error = time.monotonic(), None
    try:
        for _ in range(5):
            t = torch.ones(1000)
            if use_async:
                torchring.allreduce_async(t).wait()
            else:
                torchring.allreduce(t)
    except torchring.TorchringError as e:
        error = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - start
    if sig == signal.SIGSTOP:
        try:
            os.kill(pids[victim], signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        torchring.allreduce(torch.ones(4))
        after = "no error"
    except Exception as e:  # noqa: BLE001 - the type is the result
        after = type(e).__name__
    torchring.shutdown()
    return {"error": error, "elapsed": elapsed, "after": after}


@pytest.mark.parametrize("world,victim,setup,sig", [
    (3, 1, "shm", "SIGKILL"), (3, 1, "tcp", "SIGKILL"), (4, 2, "hybrid", "SIGKILL"),
    (2, 1, "shm", "SIGSTOP"), (3, 2, "tcp", "SIGSTOP")])
def test_dead_or_silent_peer(world: int, victim: int, setup: str, sig: str) -> None:
    use_async = setup == "shm"
    init_timeout = KILL_TIMEOUT if setup == "tcp" else None  # tcp: init(timeout) beats the env
    env = {"TORCHRING_TIMEOUT": "60" if init_timeout else str(KILL_TIMEOUT)}
    if setup != "hybrid":
        env["TORCHRING_TRANSPORT"] = setup
    rank_env = hybrid_env("aabb") if setup == "hybrid" else None
    outcomes = spawn(world, _kill_job, victim, getattr(signal, sig), use_async, init_timeout, env=env,
                     rank_env=rank_env, timeout=60, expect_fail=True)
    assert outcomes[victim].exitcode == -signal.SIGKILL, outcomes[victim].describe()
    survivors = [o for o in outcomes if o.rank != victim]
    for o in survivors:
        assert o.ok, o.describe()
        r = o.value
        assert r["error"] is not None, f"rank {o.rank}: no TorchringError after {sig} to rank {victim}"
        assert r["elapsed"] < KILL_TIMEOUT + KILL_MARGIN, f"rank {o.rank}: raised after {r['elapsed']:.1f} s"
        assert r["error"].startswith("CommunicatorFailedError: "), f"rank {o.rank}: {r['error']}"
        assert r["after"] == "CommunicatorFailedError", \
            f"rank {o.rank}: the op after a failure gave {r['after']}"
    # A dead peer must be named by everyone; a silent (stopped) one is only seen by its ring
    # neighbours, whose own peers then look silent, so there one survivor naming it is enough.
    errors = {o.rank: o.value["error"] for o in survivors}
    unnamed = {r: e for r, e in errors.items() if not re.search(rf"\b(rank|peer) {victim}\b", e)}
    if sig == "SIGKILL":
        assert not unnamed, f"killed rank {victim} not named by ranks {sorted(unnamed)}: {unnamed}"
    else:
        assert len(unnamed) < len(errors), f"stopped rank {victim} named by no survivor: {errors}"


def _hostile_job(rank: int) -> list[str]:
    """A few allreduces once the ring is up (despite the attacker); return the mismatches, and
    on rank 0 also check that each refused connection was reported through the logger."""
    import logging

    import torchring

    refused: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: refused.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchring").addHandler(handler)
    with session():
        world = torchring.size()
        chk = Checker(rank)
        for dtype, op, n in [(torch.float32, "SUM", 1000), (torch.int64, "MAX", 7),
                             (torch.bfloat16, "SUM", 70000)]:
            t = rank_input(rank, world, n, dtype, op)
            torchring.allreduce(t, getattr(torchring.ReduceOp, op))
            chk.equal(f"allreduce({dtype}[{n}], {op})", t, expected_allreduce(world, n, dtype, op))
    # Only rank 0 listens for the attacker (and the rank that connects to it is never refused).
    pattern = re.compile(rf"rank 0: refused connection from 127\.0\.0\.1:\d+: .+")
    if rank == 0:
        chk.true("refused connections logged", len(refused) >= 1, "no warning was logged")
    chk.true("log lines", all(pattern.fullmatch(m) for m in refused) and (rank == 0 or not refused),
             f"unexpected warnings: {refused}")
    return chk.failures


def _attack(job: Job, gate: StoreGate) -> None:
    """While rank 0's left neighbour is frozen before publishing its info, connect to rank 0's
    listening port with garbage, a wrong-secret handshake and nothing; then let the job go on and
    expect rank 0 to close all three (it must accept them before the real neighbour's)."""
    gate.open(job.store.port)
    key = job.key_prefix() + "info/0"
    job.store.wait([key], datetime.timedelta(seconds=30))
    info = json.loads(job.store.get(key))
    assert {"host", "addr", "port", "pid"} <= set(info), f"info/0 lacks fields: {info}"
    assert isinstance(info["port"], int), f"no TCP port published with TORCHRING_TRANSPORT=tcp: {info}"
    assert gate.held.wait(30), "the late rank never published its info"
    garbage = random.Random(0).randbytes(4096)
    # Shaped like a handshake (8-byte magic, 64-byte secret, from and to rank) with a made-up secret;
    # should the real layout differ, this is just more garbage.
    secret = b"not-the-job-secret".ljust(64, b"\0")
    wrong_secret = b"TRING001" + secret + struct.pack("<ii", job.world_size - 1, 0)
    socks = {}
    for name, payload in (("garbage", garbage), ("wrong secret", wrong_secret), ("empty", b"")):
        s = socket.create_connection((info["addr"], info["port"]), timeout=5)
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            socks[name] = s
        except OSError:  # rank 0 was already accepting, read enough, and reset the connection
            s.close()
    gate.release()
    for name, s in socks.items():
        s.settimeout(30)
        try:
            while s.recv(65536):
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass
        except socket.timeout:
            pytest.fail(f"the {name} connection to rank 0 was still open after 30 s")
        finally:
            s.close()


@pytest.mark.parametrize("world", [2, 3])
def test_hostile_connection(world: int) -> None:
    late = world - 1  # rank 0's left neighbour: the one rank 0 accepts a connection from
    gate = StoreGate(f"/info/{late}".encode())
    rank_env = [{} for _ in range(world)]
    rank_env[late] = {"MASTER_PORT": str(gate.port)}
    results = spawn(world, _hostile_job, env={"TORCHRING_TRANSPORT": "tcp", "TORCHRING_TIMEOUT": "20"},
                    rank_env=rank_env, on_start=lambda job: _attack(job, gate))
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
    import torchring as tr

    return {"allreduce": lambda: tr.allreduce(t), "allreduce_async": lambda: tr.allreduce_async(t),
            "broadcast": lambda: tr.broadcast(t), "allgather": lambda: tr.allgather(t),
            "reduce_scatter": lambda: tr.reduce_scatter(t), "barrier": tr.barrier,
            "broadcast_object": lambda: tr.broadcast_object(1),
            "allgather_object": lambda: tr.allgather_object(1)}


def _bad_calls_job(rank: int) -> tuple[list[str], list[str]]:
    """Before init, after init with bad arguments, after shutdown; then a good allreduce."""
    import torchring as tr

    chk = Checker(rank)
    chk.true("is_initialized() before init()", tr.is_initialized() is False)
    for name, op in _all_ops(torch.ones(4)).items():
        _raises(chk, f"{name} before init()", RuntimeError, op, "init")
    tr.init()
    world = tr.size()
    ones, strided, column = torch.ones(4), torch.ones(4, 4).t(), torch.ones(4, 4)[:, 1]
    sparse, cplx = torch.eye(3).to_sparse(), torch.ones(2 * world, dtype=torch.complex64)
    flags, ints = torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.int32)
    bad = [("non-contiguous allreduce", ValueError, lambda: tr.allreduce(strided), ["contiguous"]),
           ("non-contiguous allreduce_async", ValueError, lambda: tr.allreduce_async(strided).wait(),
            ["contiguous"]),
           ("non-contiguous broadcast", ValueError, lambda: tr.broadcast(column), ["contiguous"]),
           ("sparse CSR allreduce", TypeError, lambda: tr.allreduce(sparse.to_sparse_csr()), ["sparse_csr"]),
           ("sparse COO allreduce with MAX", ValueError, lambda: tr.allreduce(sparse, tr.ReduceOp.MAX),
            ["sparse", "SUM or AVG only", "MAX"]),
           ("sparse allgather", TypeError, lambda: tr.allgather(sparse), ["sparse"]),
           ("complex64 allreduce", TypeError, lambda: tr.allreduce(cplx), ["complex64"]),
           ("complex64 reduce_scatter", TypeError, lambda: tr.reduce_scatter(cplx), ["complex64"]),
           ("bool SUM", TypeError, lambda: tr.allreduce(flags), ["bool"]),
           ("int32 AVG", ValueError, lambda: tr.allreduce(ints, tr.ReduceOp.AVG), ["avg"]),
           ("broadcast src=size()", ValueError, lambda: tr.broadcast(ones, src=world), [str(world)]),
           ("broadcast src=-1", ValueError, lambda: tr.broadcast(ones, src=-1), ["-1"]),
           ("allreduce(list)", TypeError, lambda: tr.allreduce([1.0, 2.0]), ["tensor", "list"]),
           ("broadcast(int)", TypeError, lambda: tr.broadcast(3), ["tensor", "int"]),
           ("reduce_scatter of a 0-dim tensor", ValueError, lambda: tr.reduce_scatter(torch.tensor(1.0)),
            ["float32[]", "dim 0"])]
    for what, exc, fn, words in bad:
        _raises(chk, what, exc, fn, *words)
    usable = Checker(rank)
    t = rank_input(rank, world, 100, torch.float32)
    tr.allreduce(t)
    usable.equal("allreduce after the bad calls", t, expected_allreduce(world, 100, torch.float32, "SUM"))
    tr.shutdown()
    chk.true("is_initialized() after shutdown()", tr.is_initialized() is False)
    _raises(chk, "allreduce after shutdown()", RuntimeError, lambda: tr.allreduce(ones), "init")
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
                 (torchring.is_initialized(), torchring.rank(), world)
                 == (True, rank, int(os.environ["WORLD_SIZE"])))
        t = rank_input(rank, world, 1000 + gen, torch.float32)
        torchring.allreduce(t)
        want = expected_allreduce(world, 1000 + gen, torch.float32, "SUM")
        chk.equal(f"generation {gen}: allreduce", t, want)
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
    with session():
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
        objects = (torchring.broadcast_object({"a": 1}), torchring.allgather_object(2))
        chk.true("objects", objects == ({"a": 1}, [2]), f"got {objects}")
    return chk.failures


def test_world1_without_env() -> None:
    failures = run_alone(_alone_job)
    assert not failures, "\n".join(failures)


def _forked_child_job(rank: int) -> list[str]:
    """Rank 0 forks a child that tries a collective and then exits normally (running the
    atexit shutdown): the child gets a clear error, and the parents' job carries on."""
    import atexit
    import warnings

    import torchring

    with session():
        chk = Checker(rank)
        world = torchring.size()
        if rank == 0:
            with warnings.catch_warnings():  # Python 3.12+ warns about fork() with threads
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                try:
                    torchring.allreduce(torch.ones(4))
                    code = 1  # ran a collective in the child
                except torchring.TorchringError as e:
                    code = 0 if "forked child" in str(e) and "rank 0" in str(e) else 2
                # What a normal exit runs (torchring.shutdown() among it), without unwinding
                # into the test harness, whose result pipe the child shares with its parent.
                atexit._run_exitfuncs()
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            chk.true("child's collective raised a clear error", os.WEXITSTATUS(status) == 0,
                     f"child exit code {os.WEXITSTATUS(status)} (1: it ran, 2: wrong message)")
        for n in (1000, BIG_AFTER_FORK):
            t = rank_input(rank, world, n, torch.float32)
            torchring.allreduce(t)
            chk.equal(f"allreduce of {n} after a forked child exited", t,
                      expected_allreduce(world, n, torch.float32, "SUM"))
        return chk.failures


BIG_AFTER_FORK = 3 << 18  # 3 MiB of float32: several TCP segments and staging chunks


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_forked_child_cannot_break_the_job(transport: str) -> None:
    for failures in spawn(2, _forked_child_job, env={"TORCHRING_TRANSPORT": transport}):
        assert failures == []
