"""benchmarks/allreduce.py's Intel MPI peer without Intel MPI: where its prefix is looked for, the
launch command (a loopback-only namespace, pinning as the other peers are pinned), the rank a
PMI launcher gives, and how a row merged from Intel MPI's world is read (its ratio over the
torchring of its own processes, its wrong elements counted)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _peers  # noqa: E402
import summarize  # noqa: E402


def fake_prefix(path: Path) -> Path:
    """A directory shaped like Intel MPI's prefix: bin/mpiexec.hydra and lib/libmpi.so.12."""
    (path / "bin").mkdir(parents=True)
    (path / "lib").mkdir()
    (path / "bin" / "mpiexec.hydra").write_text("#!/bin/sh\n")
    (path / "bin" / "mpiexec.hydra").chmod(0o755)
    (path / "lib" / "libmpi.so.12").write_text("")
    return path


def test_the_prefix_is_i_mpi_root_else_the_checkouts_impi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_peers, "ROOT", str(tmp_path / "checkout"))
    monkeypatch.delenv("I_MPI_ROOT", raising=False)
    assert _peers.impi_root() is None
    local = fake_prefix(tmp_path / "checkout" / ".impi")
    assert _peers.impi_root() == str(local)
    monkeypatch.setenv("I_MPI_ROOT", str(fake_prefix(tmp_path / "oneapi")))
    assert _peers.impi_root() == str(tmp_path / "oneapi")


@pytest.mark.parametrize("bind", ["none", "core"])
def test_the_launch_is_shared_memory_in_a_namespace_pinned_like_the_others(
        bind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("I_MPI_ROOT", str(fake_prefix(tmp_path / "impi")))
    cmd, env = _peers.impi_command(3, bind, ["python", "allreduce.py", "--rank-of", "{port}:rows"])
    assert cmd[:2] == ["unshare", "--net"] and cmd[-4:] == ["python", "allreduce.py", "--rank-of", "{port}:rows"]
    assert cmd[cmd.index(str(tmp_path / "impi" / "bin" / "mpiexec.hydra")) + 1:][:2] == ["-n", "3"]
    assert env["I_MPI_FABRICS"] == "shm" and env["MPI4PY_LIBMPI"].endswith("lib/libmpi.so.12")
    if bind == "none":
        assert env["I_MPI_PIN"] == "0"
    else:
        cpus = sorted(os.sched_getaffinity(0))
        assert env["I_MPI_PIN"] == "1"
        assert env["I_MPI_PIN_PROCESSOR_LIST"] == ",".join(str(cpus[r % len(cpus)]) for r in range(3))


def test_a_pmi_launcher_names_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    assert _peers.launched_rank() == (1, 2)


def test_impis_ratio_is_over_the_torchring_of_its_own_world() -> None:
    row = {"torchring": {"time_us": 1.0, "wrong": 0}, "mpi": {"time_us": 2.0, "wrong": 0},
           "impi": {"time_us": 3.0, "wrong": 1, "torchring_us": 4.0, "torchring_wrong": 2}}
    libs = ["torchring", "mpi", "impi"]
    assert summarize.peer_ratio(row, "mpi") == 2.0 and summarize.peer_ratio(row, "impi") == 0.75
    assert summarize.peer_ratio(row, "torchring") is None and summarize.peer_ratio(row, "gloo") is None
    assert summarize.time_columns(libs) == ["torchring", "mpi", "impi", "torchring@impi"]
    assert [summarize.time_us(row, c) for c in summarize.time_columns(libs)] == [1.0, 2.0, 3.0, 4.0]
    assert summarize.wrong_in(row, libs) == 3
    alone = {"torchring": {"time_us": 2.0, "wrong": 0}, "impi": {"time_us": 1.0, "wrong": 0}}
    assert summarize.peer_ratio(alone, "impi") == 0.5 and summarize.time_us(alone, "torchring@impi") == 2.0
