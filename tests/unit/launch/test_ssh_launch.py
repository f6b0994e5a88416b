"""torchring-run -H across hosts, its pure parts: which host gets which ranks, which variables
reach the other hosts, the remote command line (run through a real sh here: quoting), the ssh
command, the node's command line, and torchring-run's flags for it. No ssh, no ranks."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from torchring.launch import remote_env, ssh as sl
from torchring.launch import node as _ssh_node, cli as run


def test_ranks_fill_the_hosts_in_their_order() -> None:
    hosts = [("b", 2), ("a", 3), ("c", 1)]
    assert sl.plan_hosts(hosts, 6) == hosts
    assert sl.plan_hosts(hosts, 4) == [("b", 2), ("a", 2)]  # c gets no rank: not started
    assert sl.plan_hosts(hosts, 1) == [("b", 1)]
    with pytest.raises(ValueError, match="-np 7 is more than the 6 slots"):
        sl.plan_hosts(hosts, 7)


def test_every_variable_is_forwarded_but_the_deny_list_and_host_specific_ones() -> None:
    env = {"TORCHRING_TIMEOUT": "20", "HOROVOD_FUSION_THRESHOLD": "0", "PATH": "/venv/bin:/usr/bin",
           "PYTHONPATH": "/src", "VIRTUAL_ENV": "/venv", "OMP_NUM_THREADS": "2", "NCCL_DEBUG": "INFO",
           "LD_LIBRARY_PATH": "/lib", "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "CUDA_VISIBLE_DEVICES": "0",
           "NVIDIA_VISIBLE_DEVICES": "all", "ROCR_CUDA_VISIBLE_DEVICES": "1",
           "TORCHRING_ADDR": "10.0.0.1", "TORCHRING_BIND_ADDR": "10.0.0.1", "TORCHRING_HOSTNAME": "me",
           "TORCHRING_SSH": "ssh -v", "HOME": "/root", "SSH_AUTH_SOCK": "/tmp/x", "HOSTNAME": "me",
           "MASTER_ADDR": "me", "RANK": "0", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x", "DISPLAY": ":0",
           "OLDPWD": "/", "PWD": "/here", "SHLVL": "2", "BASH_FUNC_f%%": "() { :; }",
           "HF_TOKEN": "secret", "AWS_SECRET_ACCESS_KEY": "secret", "DATA_DIR": "/data", "WANDB_API_KEY": "k"}
    got = remote_env.remote_env(env)
    assert set(got) == {"TORCHRING_TIMEOUT", "HOROVOD_FUSION_THRESHOLD", "PATH", "PYTHONPATH", "VIRTUAL_ENV",
                        "OMP_NUM_THREADS", "NCCL_DEBUG", "LD_LIBRARY_PATH", "TORCH_DISTRIBUTED_DEBUG",
                        "NVIDIA_VISIBLE_DEVICES", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "DATA_DIR", "WANDB_API_KEY"}
    assert all(got[name] == env[name] for name in got)
    keep, values = remote_env.parse_settings(["HOME", "EXTRA=a=b c"])
    got = remote_env.remote_env(env, deny=["AWS_*", "HF_TOKEN"], keep=keep, values=values)
    assert "AWS_SECRET_ACCESS_KEY" not in got and "HF_TOKEN" not in got
    assert got["HOME"] == "/root" and got["EXTRA"] == "a=b c" and got["DATA_DIR"] == "/data"
    assert remote_env.bootstrap_env(got) == {"PATH": "/venv/bin:/usr/bin", "PYTHONPATH": "/src",
                                             "VIRTUAL_ENV": "/venv", "LD_LIBRARY_PATH": "/lib"}
    for bad in ("=x", "A B=1", ""):
        with pytest.raises(ValueError, match="expected NAME or NAME=VALUE"):
            remote_env.parse_settings([bad])


def test_the_environment_travels_through_stdin_and_the_lifeline_stays_behind_it(tmp_path: Path) -> None:
    reader = ("import json, os, sys; from torchring.launch import remote_env; got = remote_env.take(); "
              "rest = sys.stdin.buffer.read(); print(json.dumps([os.environ['SECRET'], got, rest.decode()]))")
    proc = subprocess.Popen([sys.executable, "-c", reader], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            cwd=str(Path(sl.__file__).parents[2]), env={"PATH": "/usr/bin:/bin"})
    remote_env.send(proc.stdin, {"SECRET": "s3cr3t \n 'x'", "DATA_DIR": "/d"})
    proc.stdin.write(b"lifeline bytes")
    out, _ = proc.communicate(timeout=60)
    secret, got, rest = json.loads(out)
    assert secret == "s3cr3t \n 'x'" and got == {"SECRET": "s3cr3t \n 'x'", "DATA_DIR": "/d"}
    assert rest == "lifeline bytes"


_ECHO = "import json, os, sys; print(json.dumps([os.getcwd(), sys.argv[1:], dict(os.environ)]))"
_NASTY = ["with space", "it's", 'say "hi"', "$HOME", "`id`", "back\\slash", "new\nline", "*", "-x", ""]


def test_the_remote_command_keeps_words_variables_and_directory_intact(tmp_path: Path) -> None:
    workdir = tmp_path / "a dir with 'quotes'"
    workdir.mkdir()
    env = {"TORCHRING_TEST": "a b $c 'd' \"e\"", "PATH": "/usr/bin:/bin"}
    line = sl.remote_command([sys.executable, "-c", _ECHO, *_NASTY], env, str(workdir))
    out = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=60, cwd="/",
                         env={"PATH": "/usr/bin:/bin"}, check=True).stdout
    cwd, argv, seen = json.loads(out)
    assert Path(cwd) == workdir and argv == _NASTY
    assert seen["TORCHRING_TEST"] == env["TORCHRING_TEST"] and seen["PATH"] == env["PATH"]


def test_the_ssh_command_line() -> None:
    assert sl.ssh_argv("h1", "true") == ["ssh", "-T", "-o", "BatchMode=yes", "h1", "true"]
    assert sl.ssh_argv("h1", "cmd", port=2222, identity="/k/id") == \
        ["ssh", "-T", "-o", "BatchMode=yes", "-p", "2222", "-i", "/k/id", "h1", "cmd"]
    custom = sl.ssh_argv("h1", "cmd", ssh="'/opt/my ssh/ssh' -o 'ProxyJump=a b' -v", port=22)
    assert custom == ["/opt/my ssh/ssh", "-o", "ProxyJump=a b", "-v", "-p", "22", "h1", "cmd"]


def test_the_store_lives_on_the_first_host_under_a_name_the_others_can_reach() -> None:
    assert sl.master_address("node7", is_this_host=False) == "node7"
    assert sl.master_address("localhost", is_this_host=True) == socket.gethostname()
    assert sl.master_address("127.0.0.1", is_this_host=True) == socket.gethostname()
    assert sl.master_address(socket.gethostname(), is_this_host=True) == socket.gethostname()


def test_a_local_first_host_is_named_by_its_address_towards_the_others(monkeypatch) -> None:
    # this host's name may resolve to a loopback address here (Debian: 127.0.1.1), which the other
    # hosts cannot reach and which would bind the ranks' ring to loopback
    monkeypatch.setattr(sl, "_address_towards", lambda host: {"node1": "198.18.5.1"}.get(host))
    assert sl.master_address("localhost", is_this_host=True, towards="node1") == "198.18.5.1"
    assert sl.master_address("node0", is_this_host=True, towards="node1") == "198.18.5.1"
    assert sl.master_address("node0", is_this_host=False, towards="node1") == "node0"
    monkeypatch.undo()
    assert sl._address_towards("127.0.0.1") is None  # a loopback route names nothing reachable


def test_the_node_reads_back_what_the_launcher_wrote() -> None:
    argv = sl.node_argv(host="h 1", node_rank=1, nnodes=3, nproc=2, master="h0", port=29511, job="j1",
                        monitor_interval=0.25, prefix=False, rank0_only=True,
                        command=["train.py", "--epochs", "3", "--", "-x y"])
    assert argv[:4] == [sys.executable, "-u", "-m", "torchring.launch.node"]
    args = _ssh_node._parser().parse_args(argv[4:])
    assert (args.host, args.node_rank, args.nnodes, args.nproc, args.master, args.port, args.job) == \
        ("h 1", 1, 3, 2, "h0", 29511, "j1")
    assert (args.monitor_interval, args.no_prefix, args.rank0_only) == (0.25, True, True)
    assert args.command == ["--", "train.py", "--epochs", "3", "--", "-x y"]


def _parsed(argv: list[str]) -> object:
    parser = run._parser()
    args = parser.parse_args(argv)
    run._resolve(parser, args)
    return args


def test_another_host_in_hosts_makes_a_multi_host_job(tmp_path: Path) -> None:
    args = _parsed(["-H", "zz-elsewhere:2,localhost:3", "-p", "2222", "-i", "/k", "train.py", "a b"])
    assert args.remote_hosts == [("zz-elsewhere", 2), ("localhost", 3)] and args.num_proc == 5
    assert (args.ssh_port, args.ssh_identity_file, args.script_args) == (2222, "/k", ["a b"])
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=2\nn2 slots=2\n")
    args = _parsed(["-np", "3", "--hostfile", str(hostfile), "python", "train.py"])
    assert args.remote_hosts == [("n1", 2), ("n2", 2)] and args.num_proc == 3
    assert _parsed(["-H", "localhost:2,127.0.0.1:1", "train.py"]).remote_hosts == []


def test_restarts_across_hosts_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parsed(["-H", "n1:1,n2:1", "--max-restarts", "2", "train.py"])
    assert "--max-restarts works on one host" in capsys.readouterr().err


def test_the_hosts_wait_for_each_other_as_long_as_the_start_timeout_says() -> None:
    assert _ssh_node._start_timeout({}) == 300  # TORCHRING_TIMEOUT's default, not torch's 600
    assert _ssh_node._start_timeout({"TORCHRING_TIMEOUT": "900"}) == 900
    assert _ssh_node._start_timeout({"TORCHRING_TIMEOUT": "10"}) == 120  # hosts start torch at their pace
