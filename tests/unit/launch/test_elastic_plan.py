"""torchring-run's elastic mode without a process: the discovery script's output read as this
host's slots, and the plan (-np, --min-np, --max-np, the worker's command) made of the flags."""

from __future__ import annotations

import sys

import pytest

from torchring.launch import cli, elastic


def _this(host: str) -> bool:
    return host in ("localhost", "127.0.0.1")


@pytest.mark.parametrize("text,slots", [
    ("localhost:4\n", 4),
    ("localhost slots=2\n127.0.0.1:3\n", 5),
    ("# none yet\n\n", 0),
    ("localhost\nlocalhost:2  # grown\n", 3),
])
def test_discovery_output_gives_this_hosts_slots(text: str, slots: int) -> None:
    assert elastic.parse_slots(text, _this) == slots


@pytest.mark.parametrize("text,message", [
    ("gpu7:4\n", "host 'gpu7' is not this host"),
    ("localhost:four\n", "slots must be a whole number"),
    ("localhost 4 extra\n", "is not 'host:slots' or 'host slots=N'"),
])
def test_bad_discovery_output_is_named_by_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        elastic.parse_slots("localhost:1\n" + text, _this)
    assert "line 2" in str(error.value)


def _plan(argv: list[str]) -> elastic.ElasticPlan:
    parser = cli._parser()
    args = parser.parse_args(argv)
    cli._resolve(parser, args)
    assert cli._elastic(args)
    return cli._resolve_elastic(parser, args)


def test_plan_of_the_flags() -> None:
    plan = _plan(["-np", "3", "--min-np", "2", "--max-np", "5", "--max-restarts", "1", "train.py", "--lr", "1"])
    assert (plan.min_np, plan.initial_np, plan.max_np, plan.replacements) == (2, 3, 5, 1)
    assert plan.fixed_slots == 3 and plan.discovery is None
    assert plan.command == [sys.executable, "-u", "train.py", "--lr", "1"]


def test_discovery_alone_starts_max_np_and_polls() -> None:
    plan = _plan(["--max-np", "4", "--host-discovery-script", "./slots.sh", "--discovery-interval", "0.5",
                  "python", "-m", "pkg.train"])
    assert (plan.min_np, plan.initial_np, plan.max_np, plan.fixed_slots) == (1, 4, 4, None)
    assert (plan.discovery, plan.interval) == ("./slots.sh", 0.5)
    assert plan.command == [sys.executable, "-u", "-m", "pkg.train"]


@pytest.mark.parametrize("argv,message", [
    (["-np", "2", "--min-np", "3", "t.py"], "need --min-np (3) <= -np (2) <= --max-np (2)"),
    (["-np", "5", "--max-np", "4", "t.py"], "<= -np (5) <= --max-np (4)"),
    (["--host-discovery-script", "s.sh", "t.py"], "give -np N or --max-np M"),
    (["-H", "otherhost:2", "--min-np", "1", "t.py"], "start workers on this host only"),
])
def test_inconsistent_elastic_flags_exit_2_naming_them(argv: list[str], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        _plan(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
