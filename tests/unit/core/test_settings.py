"""torchring._core.settings: every TORCHRING_* variable's default, good values, and each bad
value's message (name, value received, what is allowed, what to do). hvd's HOROVOD_* knobs use
the same parsers, so the rules both families share (switches, empty values, the message shape)
are tested here once for both; test_hvd_knobs.py tests the knobs' own table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import torchring
from torchring._core.settings import DEFAULT_TIMEOUT_S, VARIABLES, Settings, cache_dir
from torchring.horovod import knobs

ROOT = Path(__file__).resolve().parents[3]

# The README's configuration table, column "default".
README_DEFAULTS = {
    "timeout": 300.0, "transport": "auto", "hostname": None, "addr": None, "bind_addr": None,
    "shm_segment_kb": 1024, "shm_arena_mb": 2048, "spin": None, "grad_pool_mb": None,
    "cuda_path": "auto", "device": None, "job_id": None, "debug_build": False, "ssh": None,
    "elastic_dir": None,
}


def _read(name: str, raw: str) -> object:
    """`name`=`raw` parsed by the family it belongs to: Settings or hvd's Knobs."""
    if name.startswith("HOROVOD_"):
        return knobs.current({name: raw})
    return Settings.from_env({name: raw})


def test_settings_mirror_the_readme_table() -> None:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Configuration"):]
    table = table[:table.index("\n## ")]
    documented = set(re.findall(r"^\| `(TORCHRING_[A-Z_]+)`", table, re.M))
    assert documented == set(VARIABLES)


def test_defaults_without_any_variable() -> None:
    got = Settings.from_env({"HOME": "/home/u"})
    for field, want in README_DEFAULTS.items():
        assert getattr(got, field) == want, field


def test_one_default_timeout() -> None:
    assert DEFAULT_TIMEOUT_S == 300.0 and Settings().timeout == DEFAULT_TIMEOUT_S
    with pytest.raises(ValueError, match="unset it for the default 300$"):
        Settings.from_env({"TORCHRING_TIMEOUT": "soon"})


@pytest.mark.parametrize("name,field", [("TORCHRING_DEBUG_BUILD", "debug_build"),
                                        ("HOROVOD_ELASTIC", "elastic"),
                                        ("HOROVOD_TIMELINE_MARK_CYCLES", "timeline_mark_cycles")])
@pytest.mark.parametrize("raw,want", [("1", True), ("0", False), ("2", True), ("-1", False),
                                      ("true", True), ("True", True), ("YES", True), ("on", True),
                                      ("false", False), ("no", False), ("Off", False)])
def test_switches_take_one_rule_in_both_families(name: str, field: str, raw: str, want: bool) -> None:
    # Horovod's rule (an integer, on above 0) plus the words users reach for.
    assert getattr(_read(name, raw), field) is want


@pytest.mark.parametrize("name", ["TORCHRING_DEBUG_BUILD", "HOROVOD_ELASTIC"])
@pytest.mark.parametrize("raw", ["maybe", "1.0", "y", "enabled"])
def test_a_switch_refuses_what_it_does_not_know(name: str, raw: str) -> None:
    with pytest.raises(ValueError) as caught:
        _read(name, raw)
    assert str(caught.value) == (f"{name}={raw!r}: expected 1 or 0 (an integer: on above 0), or "
                                 f"true/false, yes/no, on/off; unset it for the default 0")


def test_the_build_time_settings() -> None:
    # Read before init(): only the build's own variables, so a bad runtime one cannot stop a build.
    build = Settings.for_build({"TORCHRING_DEBUG_BUILD": "1", "TORCHRING_TIMEOUT": "soon",
                                "TORCHRING_CACHE_DIR": "/tmp/c"})
    assert build.debug_build is True and build.cache_dir == "/tmp/c" and build.timeout == 300.0


def test_the_earlier_segment_name_still_works_and_is_named_in_messages() -> None:
    assert Settings.from_env({"TORCHRING_SHM_CHUNK_KB": "256"}).shm_segment_kb == 256
    assert Settings.from_env({"TORCHRING_SHM_CHUNK_KB": "256",
                              "TORCHRING_SHM_SEGMENT_KB": "256"}).shm_segment_kb == 256
    with pytest.raises(ValueError, match=r"^TORCHRING_SHM_CHUNK_KB='x': expected an integer"):
        Settings.from_env({"TORCHRING_SHM_CHUNK_KB": "x"})
    with pytest.raises(ValueError, match="disagree"):
        Settings.from_env({"TORCHRING_SHM_CHUNK_KB": "256", "TORCHRING_SHM_SEGMENT_KB": "512"})


def test_empty_and_blank_values_count_as_unset() -> None:
    env = {name: "" for name in VARIABLES} | {"TORCHRING_SHM_SEGMENT_KB": "  ", "HOME": "/home/u"}
    assert Settings.from_env(env) == Settings.from_env({"HOME": "/home/u"})
    env = {"HOROVOD_FUSION_THRESHOLD": "", "HOROVOD_TIMELINE": "  ", "HOROVOD_ELASTIC": ""}
    assert knobs.current(env) == knobs.current({})


@pytest.mark.parametrize("name,raw,field,want", [
    ("TORCHRING_TIMEOUT", "20", "timeout", 20.0),
    ("TORCHRING_TIMEOUT", "0.5", "timeout", 0.5),
    ("TORCHRING_TIMEOUT", "604800", "timeout", 604800.0),
    ("TORCHRING_TRANSPORT", "tcp", "transport", "tcp"),
    ("TORCHRING_TRANSPORT", "SHM", "transport", "shm"),
    ("TORCHRING_HOSTNAME", "fake-host-1", "hostname", "fake-host-1"),
    ("TORCHRING_ADDR", "10.0.0.2", "addr", "10.0.0.2"),
    ("TORCHRING_BIND_ADDR", "0.0.0.0", "bind_addr", "0.0.0.0"),
    ("TORCHRING_SHM_SEGMENT_KB", "4", "shm_segment_kb", 4),
    ("TORCHRING_SHM_SEGMENT_KB", " 1048576 ", "shm_segment_kb", 1048576),
    ("TORCHRING_SHM_ARENA_MB", "0", "shm_arena_mb", 0),
    ("TORCHRING_SHM_ARENA_MB", "64", "shm_arena_mb", 64),
    ("TORCHRING_SHM_STORES", "streaming", "shm_stores", "streaming"),
    ("TORCHRING_SHM_STORES", "cached", "shm_stores", "cached"),
    ("TORCHRING_SPIN", "0", "spin", 0),
    ("TORCHRING_SPIN", "200", "spin", 200),
    ("TORCHRING_GRAD_POOL_MB", "8", "grad_pool_mb", 8.0),
    ("TORCHRING_GRAD_POOL_MB", "0.5", "grad_pool_mb", 0.5),
    ("TORCHRING_GRAD_POOL_MB", "0", "grad_pool_mb", 0.0),
    ("TORCHRING_GRAD_POOL_MB", "off", "grad_pool_mb", 0.0),
    ("TORCHRING_GRAD_POOL_MB", "OFF", "grad_pool_mb", 0.0),
    ("TORCHRING_GRAD_POOL_MB", "auto", "grad_pool_mb", None),
    ("TORCHRING_CACHE_DIR", "/tmp/tr-cache", "cache_dir", "/tmp/tr-cache"),
    ("TORCHRING_CUDA_PATH", "staged", "cuda_path", "staged"),
    ("TORCHRING_CUDA_PATH", "Off", "cuda_path", "off"),
    ("TORCHRING_CUDA_PATH", "nccl", "cuda_path", "nccl"),
    ("TORCHRING_DEVICE", "3", "device", 3),
    ("TORCHRING_JOB_ID", "exp-7", "job_id", "exp-7"),
    ("TORCHRING_SSH", "ssh -o StrictHostKeyChecking=no", "ssh", "ssh -o StrictHostKeyChecking=no"),
    ("TORCHRING_ELASTIC_DIR", " /tmp/commits ", "elastic_dir", "/tmp/commits"),
    ("TORCHRING_MIN_NP", "3", "min_np", 3),
])
def test_good_values(name: str, raw: str, field: str, want: object) -> None:
    got = Settings.from_env({name: raw})
    assert getattr(got, field) == want
    others = {f: v for f, v in README_DEFAULTS.items() if f != field}
    assert all(getattr(got, f) == v for f, v in others.items()), "one variable changed another field"


@pytest.mark.parametrize("name,raw,allowed", [
    ("TORCHRING_TIMEOUT", "ten", "seconds"),
    ("TORCHRING_TIMEOUT", "0", "seconds > 0"),
    ("TORCHRING_TIMEOUT", "-3", "seconds > 0"),
    ("TORCHRING_TIMEOUT", "inf", "604800"),
    ("TORCHRING_TIMEOUT", "nan", "604800"),
    ("TORCHRING_TIMEOUT", "1e9", "604800"),
    ("TORCHRING_TRANSPORT", "infiniband", "auto, shm, tcp"),
    ("TORCHRING_HOSTNAME", "node a", "without spaces"),
    ("TORCHRING_ADDR", "10.0.0.1 10.0.0.2", "without spaces"),
    ("TORCHRING_BIND_ADDR", "eth0 lo", "a local IPv4 address"),
    ("TORCHRING_BIND_ADDR", "::1", "a local IPv4 address"),
    ("TORCHRING_BIND_ADDR", "host.example", "a local IPv4 address"),
    ("TORCHRING_SHM_SEGMENT_KB", "abc", "[4, 1048576]"),
    ("TORCHRING_SHM_SEGMENT_KB", "1.5", "integer"),
    ("TORCHRING_SHM_SEGMENT_KB", "2", "[4, 1048576]"),
    ("TORCHRING_SHM_SEGMENT_KB", "1048577", "[4, 1048576]"),
    ("TORCHRING_SHM_ARENA_MB", "-1", "[0, 1048576]"),
    ("TORCHRING_SHM_ARENA_MB", "2G", "integer"),
    ("TORCHRING_SHM_STORES", "nt", "one of auto, cached, streaming"),
    ("TORCHRING_SPIN", "-5", "[0, 100000000]"),
    ("TORCHRING_SPIN", "1e3", "integer"),
    ("TORCHRING_GRAD_POOL_MB", "-5", "'auto', 'off'"),
    ("TORCHRING_GRAD_POOL_MB", "lots", "number of MiB"),
    ("TORCHRING_GRAD_POOL_MB", "nan", "[0, 1048576]"),
    ("TORCHRING_CUDA_PATH", "gpu", "auto, nccl, staged, off"),
    ("TORCHRING_DEVICE", "-1", "device index"),
    ("TORCHRING_DEVICE", "cuda:1", "integer"),
    ("TORCHRING_JOB_ID", "my job", "without spaces"),
    ("HOROVOD_FUSION_THRESHOLD", "64MB", "a whole number >= 0"),
    ("HOROVOD_FUSION_THRESHOLD", "-1", "a whole number >= 0"),
    ("HOROVOD_CACHE_CAPACITY", "1.5", "a whole number >= 0"),
    ("HOROVOD_CYCLE_TIME", "fast", "a number >= 0"),
    ("HOROVOD_CYCLE_TIME", "nan", "a number >= 0"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "-3", "a number >= 0"),
    ("HOROVOD_LOG_LEVEL", "loud", "one of trace, debug"),
])
def test_bad_values_say_name_value_range_and_fix(name: str, raw: str, allowed: str) -> None:
    with pytest.raises(ValueError) as caught:
        _read(name, raw)
    message = str(caught.value)
    assert message.startswith(f"{name}={raw!r}: expected "), message
    assert allowed in message, message
    assert "; unset it for the default " in message, message


def test_the_message_shape_in_full() -> None:
    with pytest.raises(ValueError) as caught:
        Settings.from_env({"TORCHRING_SHM_SEGMENT_KB": "abc"})
    assert str(caught.value) == ("TORCHRING_SHM_SEGMENT_KB='abc': expected an integer number of KiB "
                                 "in [4, 1048576]; unset it for the default 1024")


def test_cache_dir_precedence() -> None:
    assert cache_dir({"HOME": "/home/u"}) == Path("/home/u/.cache/torchring")
    assert cache_dir({"HOME": "/home/u", "XDG_CACHE_HOME": "/xdg"}) == Path("/xdg/torchring")
    assert cache_dir({"HOME": "/home/u", "XDG_CACHE_HOME": ""}) == Path("/home/u/.cache/torchring")
    explicit = {"HOME": "/home/u", "XDG_CACHE_HOME": "/xdg", "TORCHRING_CACHE_DIR": "~/tr"}
    assert cache_dir(explicit) == Path("/home/u/tr")
    assert Settings.from_env(explicit).cache_dir == "/home/u/tr"


def test_spin_iterations_default_depends_on_cores() -> None:
    auto = Settings()
    assert auto.spin_iters(ranks_here=4, cpus=4) == 20000
    assert auto.spin_iters(ranks_here=5, cpus=4) == 0
    assert Settings(spin=7).spin_iters(ranks_here=5, cpus=4) == 7


def test_settings_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Settings().timeout = 1.0  # type: ignore[misc]


def test_init_rejects_a_bad_variable_before_joining(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHRING_GRAD_POOL_MB", "-5")
    with pytest.raises(ValueError, match=r"^rank 0: TORCHRING_GRAD_POOL_MB='-5': expected"):
        torchring.init()
    assert not torchring.is_initialized()


@pytest.mark.parametrize("raw,want", [("auto", "auto"), ("RING", "ring"), ("doubling", "doubling"),
                                      ("rabenseifner", "rabenseifner"), ("Rabenseifner:3", "rabenseifner:3"),
                                      ("rabenseifner:01", "rabenseifner:1"), ("Radix4", "radix4"),
                                      ("Multiplying", "multiplying")])
def test_algo_words(raw: str, want: str) -> None:
    assert Settings.from_env({"TORCHRING_ALGO": raw}).algo == want


def test_header_words() -> None:
    assert Settings.from_env({}).header == "auto"
    assert Settings.from_env({"TORCHRING_HEADER": "Multiplying"}).header == "multiplying"
    with pytest.raises(ValueError, match="TORCHRING_HEADER"):
        Settings.from_env({"TORCHRING_HEADER": "radix4"})


@pytest.mark.parametrize("raw", ["tree", "doubling:2", "rabenseifner:0", "rabenseifner:", "rabenseifner:x",
                                 "ring:1", "radix4:2", "radix", "multiplying:2"])
def test_bad_algo_words(raw: str) -> None:
    with pytest.raises(ValueError, match=r"TORCHRING_ALGO.*rabenseifner:K \(K halvings, K >= 1\), radix4, multiplying"):
        Settings.from_env({"TORCHRING_ALGO": raw})
