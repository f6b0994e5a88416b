"""torchring-run's elastic mode without a process: the discovery script's output read as slots
per host, how many workers each host keeps, and the plan (-np, --min-np, --max-np, -H, the
worker's command) made of the flags."""

from __future__ import annotations

import sys

import pytest

from torchring.launch import cli, elastic


@pytest.mark.parametrize("text,slots", [
    ("localhost:4\n", {"localhost": 4}),
    ("localhost slots=2\n127.0.0.1:3\n", {"localhost": 2, "127.0.0.1": 3}),
    ("# none yet\n\n", {}),
    ("localhost\nlocalhost:2  # grown\n", {"localhost": 3}),
    ("gpu7:4\ngpu2 slots=2\n", {"gpu7": 4, "gpu2": 2}),
])
def test_discovery_output_gives_slots_per_host_in_order(text: str, slots: dict[str, int]) -> None:
    got = elastic.parse_slots(text)
    assert got == slots and list(got) == list(slots)


@pytest.mark.parametrize("slots,lost,max_np,want", [
    ({"a": 2, "b": 2}, {}, 4, {"a": 2, "b": 2}),
    ({"a": 2, "b": 2}, {}, 3, {"a": 2, "b": 1}),      # --max-np: the later hosts give way
    ({"a": 2, "b": 2}, {"a": 1}, 4, {"a": 1, "b": 2}),  # a's failed worker is not replaced
    ({"a": 1, "b": 2}, {"a": 3}, 8, {"a": 0, "b": 2}),
])
def test_placement_fills_the_hosts_in_order(slots: dict, lost: dict, max_np: int, want: dict) -> None:
    assert elastic.placement(slots, lost, max_np) == want


@pytest.mark.parametrize("text,message", [
    ("localhost:four\n", "slots must be a whole number"),
    ("localhost 4 extra\n", "is not 'host:slots' or 'host slots=N'"),
])
def test_bad_discovery_output_is_named_by_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        elastic.parse_slots("localhost:1\n" + text)
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
    assert plan.fixed_slots == {"localhost": 3} and plan.discovery is None
    assert plan.command == [sys.executable, "-u", "train.py", "--lr", "1"]


def test_discovery_alone_starts_max_np_and_polls() -> None:
    plan = _plan(["--max-np", "4", "--host-discovery-script", "./slots.sh", "--discovery-interval", "0.5",
                  "python", "-m", "pkg.train"])
    assert (plan.min_np, plan.initial_np, plan.max_np, plan.fixed_slots) == (1, 4, 4, None)
    assert (plan.discovery, plan.interval) == ("./slots.sh", 0.5)
    assert plan.command == [sys.executable, "-u", "-m", "pkg.train"]


def test_other_hosts_of_h_are_the_slots_and_ssh_options_carry() -> None:
    plan = _plan(["-H", "nodeb:2,nodea:1,nodeb:1", "--min-np", "2", "--ssh-port", "2222",
                  "--ssh-identity-file", "/k", "train.py"])
    assert plan.fixed_slots == {"nodeb": 3, "nodea": 1} and list(plan.fixed_slots) == ["nodeb", "nodea"]
    assert (plan.min_np, plan.initial_np, plan.max_np) == (2, 4, 4)
    assert (plan.ssh_port, plan.ssh_identity) == (2222, "/k")


@pytest.mark.parametrize("argv,message", [
    (["-np", "2", "--min-np", "3", "t.py"], "need --min-np (3) <= -np (2) <= --max-np (2)"),
    (["-np", "5", "--max-np", "4", "t.py"], "<= -np (5) <= --max-np (4)"),
    (["--host-discovery-script", "s.sh", "t.py"], "give -np N or --max-np M"),
])
def test_inconsistent_elastic_flags_exit_2_naming_them(argv: list[str], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        _plan(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
