"""torchring.horovod.knobs: HOROVOD_* variables read with Horovod's defaults, and every set
variable torchring does not apply reported once with a reason. The parsing rules the knobs
share with the TORCHRING_* settings (switches, empty values, bad values' messages) are tested
once for both families in test_settings.py."""

from __future__ import annotations

import logging
from typing import Iterator

import pytest

from torchring._core.log import logger
from torchring.horovod import knobs

MIB = 1024 * 1024


def test_defaults_are_horovods() -> None:
    # Horovod 0.21+: 128 MiB fusion buffer, 1 ms cycle, cache of 1024, stall warning after 60 s.
    k = knobs.current({})
    assert (k.fusion_threshold_bytes, k.cycle_time_ms, k.cache_capacity) == (128 * MIB, 1.0, 1024)
    assert (k.stall_check, k.stall_warning_s, k.stall_shutdown_s) == (True, 60.0, 0.0)
    assert (k.timeline, k.timeline_mark_cycles, k.elastic, k.dynamic_process_sets) == (None, False, False, False)
    assert k.log_level is None


@pytest.mark.parametrize("name,raw,field,expected", [
    ("HOROVOD_FUSION_THRESHOLD", "67108864", "fusion_threshold_bytes", 64 * MIB),
    ("HOROVOD_FUSION_THRESHOLD", "0", "fusion_threshold_bytes", 0),
    ("HOROVOD_CYCLE_TIME", "2.5", "cycle_time_ms", 2.5),
    ("HOROVOD_CYCLE_TIME", "0", "cycle_time_ms", 0.0),
    ("HOROVOD_CACHE_CAPACITY", "0", "cache_capacity", 0),
    ("HOROVOD_STALL_CHECK_DISABLE", "1", "stall_check", False),
    ("HOROVOD_STALL_CHECK_DISABLE", "0", "stall_check", True),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "15", "stall_warning_s", 15.0),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "120", "stall_shutdown_s", 120.0),
    ("HOROVOD_TIMELINE", "/tmp/t.json", "timeline", "/tmp/t.json"),
    ("HOROVOD_TIMELINE", "DYNAMIC", "timeline", "DYNAMIC"),
    ("HOROVOD_TIMELINE_MARK_CYCLES", "1", "timeline_mark_cycles", True),
    ("HOROVOD_ELASTIC", "1", "elastic", True),
    ("HOROVOD_DYNAMIC_PROCESS_SETS", "1", "dynamic_process_sets", True),
    ("HOROVOD_LOG_LEVEL", "DEBUG", "log_level", "debug"),
    ("HOROVOD_ELASTIC", "0", "elastic", False),
    ("HOROVOD_TIMELINE", "  /tmp/x.json ", "timeline", "/tmp/x.json"),
])
def test_each_variable_sets_its_field(name: str, raw: str, field: str, expected: object) -> None:
    k = knobs.current({name: raw})
    assert getattr(k, field) == expected
    others = {f: v for f, v in vars(k).items() if f != field}
    assert others == {f: v for f, v in vars(knobs.Knobs()).items() if f != field}


def test_reads_os_environ_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOROVOD_DYNAMIC_PROCESS_SETS", raising=False)
    assert not knobs.current().dynamic_process_sets
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    assert knobs.current().dynamic_process_sets


def test_unused_lists_only_set_variables_torchring_does_not_apply() -> None:
    env = {
        "HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_TIMELINE": "t.json",  # applied
        "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2",  # launch contract: not settings
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_CACHE_CAPACITY": "0",
        "HOROVOD_WITH_PYTORCH": "1", "HOROVOD_FUSION_TRESHOLD": "5",  # build-time; a typo
        "HOROVOD_AUTOTUNE": "",  # empty: unset
        "PATH": "/bin",
    }
    found = {name: (raw, why) for name, raw, why in knobs.unused(env)}
    assert sorted(found) == ["HOROVOD_CACHE_CAPACITY", "HOROVOD_FUSION_TRESHOLD",
                             "HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_WITH_PYTORCH"]
    assert found["HOROVOD_CACHE_CAPACITY"][0] == "0" and "no response cache" in found["HOROVOD_CACHE_CAPACITY"][1]
    assert "does not know" in found["HOROVOD_FUSION_TRESHOLD"][1]
    assert "build" in found["HOROVOD_WITH_PYTORCH"][1]
    assert all(why for _, why in found.values())


def test_every_variable_of_horovods_table_is_applied_or_explained() -> None:
    # Horovod's runtime variables (horovod.md §2); none may fall through to "does not know".
    runtime = ["FUSION_THRESHOLD", "CYCLE_TIME", "CACHE_CAPACITY", "BATCH_D2D_MEMCOPIES",
               "DISABLE_GROUP_FUSION", "HIERARCHICAL_ALLREDUCE", "HIERARCHICAL_ALLGATHER",
               "TORUS_ALLREDUCE", "NUM_NCCL_STREAMS", "THREAD_AFFINITY", "ENABLE_ASYNC_COMPLETION",
               "MPI_THREADS_DISABLE", "ADASUM_MPI_CHUNK_SIZE", "AUTOTUNE", "AUTOTUNE_LOG",
               "AUTOTUNE_WARMUP_SAMPLES", "AUTOTUNE_STEPS_PER_SAMPLE", "AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
               "AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "TIMELINE", "TIMELINE_MARK_CYCLES",
               "STALL_CHECK_DISABLE", "STALL_CHECK_TIME_SECONDS", "STALL_SHUTDOWN_TIME_SECONDS",
               "CONTROLLER", "CPU_OPERATIONS", "GLOO_TIMEOUT_SECONDS", "GLOO_IFACE", "LOG_LEVEL",
               "LOG_HIDE_TIME", "ELASTIC", "DYNAMIC_PROCESS_SETS", "GPU_OPERATIONS", "NCCL_HOME",
               "START_TIMEOUT"]
    env = {f"HOROVOD_{name}": "1" for name in runtime} | {"HOROVOD_TIMELINE": "t.json", "HOROVOD_LOG_LEVEL": "info"}
    unknown = [name for name, _, why in knobs.unused(env) if "does not know" in why]
    assert unknown == []


@pytest.fixture
def fresh_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """report_unused's once-per-process memory emptied, the logger's level restored after."""
    monkeypatch.setattr(knobs, "_reported", set())
    level = logger.level
    yield
    logger.setLevel(level)


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "torchring"]


def test_report_unused_logs_each_variable_once_with_its_reason(
        fresh_log: None, caplog: pytest.LogCaptureFixture) -> None:
    env = {"HOROVOD_TORUS_ALLREDUCE": "1", "HOROVOD_FUSION_THRESHOLD": "0"}
    with caplog.at_level(logging.INFO, logger="torchring"):
        knobs.report_unused(env)
        knobs.report_unused(env)  # hvd.init() after hvd.shutdown(): not again
    assert _lines(caplog) == ["HOROVOD_TORUS_ALLREDUCE=1 is not applied: the engine has no 2-D torus algorithm"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torchring"):
        knobs.report_unused({"HOROVOD_TORUS_ALLREDUCE": "2"})  # a new value is news
    assert len(_lines(caplog)) == 1 and _lines(caplog)[0].startswith("HOROVOD_TORUS_ALLREDUCE=2 ")


def test_report_unused_applies_the_log_level(fresh_log: None) -> None:
    knobs.report_unused({"HOROVOD_LOG_LEVEL": "warning"})
    assert logger.level == logging.WARNING
    knobs.report_unused({"HOROVOD_LOG_LEVEL": "trace"})
    assert logger.level == logging.DEBUG


def test_report_unused_checks_the_applied_values(fresh_log: None) -> None:
    with pytest.raises(ValueError, match="HOROVOD_CYCLE_TIME='x'"):
        knobs.report_unused({"HOROVOD_CYCLE_TIME": "x"})
