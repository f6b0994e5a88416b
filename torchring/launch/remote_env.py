"""The environment the ranks on other hosts get, and how it travels: horovodrun's contract.

horovodrun gives every host the launcher's whole environment, less a short deny-list; so does
torchring-run -H (and its elastic mode over ssh). ``remote_env`` is the launcher's environment
less

- ``DEFAULT_DENY``: what names one host or one shell (HOSTNAME, PWD, OLDPWD, SHLVL, ``_``, HOME,
  USER, LOGNAME, SHELL, TERM, DISPLAY, MAIL, SSH_*), exported shell functions (BASH_FUNC_*), a
  device choice (*CUDA_VISIBLE_DEVICES: each host has its own GPUs), the variables a launcher
  gives each process (RANK, LOCAL_*, WORLD_SIZE, MASTER_*, TORCHELASTIC_*, GROUP_*, OMPI_*,
  PMIX_*, when torchring-run itself runs inside a job) and torchring's per-host settings
  (TORCHRING_ADDR, TORCHRING_BIND_ADDR, TORCHRING_HOSTNAME, TORCHRING_SSH);
- the user's ``--env-deny PATTERN`` (shell-style patterns, repeatable);

plus ``-x NAME`` (forwarded even where a pattern denies it) and ``-x NAME=VALUE`` (set for every
rank, on this host too). Values never go on a command line, where ``ps`` on either host would
show a secret: the remote command carries only what starting Python needs (``BOOTSTRAP``: PATH,
PYTHONPATH, PYTHONHOME, VIRTUAL_ENV, CONDA_PREFIX, LD_LIBRARY_PATH, LD_PRELOAD), and the rest is
written to the remote process's standard input — its lifeline (lifeline.py), which stays open
after it — as one header line ``TORCHRING-ENV <bytes>`` and that many bytes of JSON; the remote
side (``take``, ``--env-stdin``) reads it before anything else and sets it in its environment.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Mapping, Sequence
from typing import IO

__all__ = ["BOOTSTRAP", "DEFAULT_DENY", "remote_env", "bootstrap_env", "parse_settings", "send", "take"]

BOOTSTRAP = ("PATH", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH", "LD_PRELOAD")
DEFAULT_DENY = ("HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "DISPLAY",
                "MAIL", "SSH_*", "BASH_FUNC_*", "*CUDA_VISIBLE_DEVICES",
                "RANK", "LOCAL_*", "WORLD_SIZE", "MASTER_*", "TORCHELASTIC_*", "GROUP_*", "ROLE_*", "OMPI_*", "PMIX_*",
                "TORCHRING_ADDR", "TORCHRING_BIND_ADDR", "TORCHRING_HOSTNAME", "TORCHRING_SSH")
_HEADER = b"TORCHRING-ENV "


def parse_settings(items: Sequence[str]) -> tuple[set[str], dict[str, str]]:
    """-x values: (names forwarded even where denied, NAME=VALUE settings)."""
    names, values = set(), {}
    for item in items:
        name, eq, value = item.partition("=")
        if not name or any(c in name for c in " \t\n"):
            raise ValueError(f"-x {item!r}: expected NAME or NAME=VALUE")
        if eq:
            values[name] = value
        else:
            names.add(name)
    return names, values


def _denied(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def remote_env(environ: Mapping[str, str], deny: Sequence[str] = (), keep: set[str] | frozenset[str] = frozenset(),
               values: Mapping[str, str] | None = None) -> dict[str, str]:
    """What another host's ranks get from `environ` (see the module's docstring)."""
    patterns = (*DEFAULT_DENY, *deny)
    out = {name: value for name, value in environ.items() if name in keep or not _denied(name, patterns)}
    out.update(values or {})
    return dict(sorted(out.items()))


def bootstrap_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of `env` the remote command line carries: what starting Python needs."""
    return {name: env[name] for name in BOOTSTRAP if name in env}


def send(stream: IO[bytes], env: Mapping[str, str]) -> None:
    """Writes `env` to a remote process's stdin (its lifeline stays open after it)."""
    blob = json.dumps(dict(env)).encode()
    stream.write(_HEADER + str(len(blob)).encode() + b"\n" + blob)
    stream.flush()


def _read_exactly(fd: int, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = os.read(fd, count - len(data))
        if not chunk:
            raise EOFError(f"the launcher's environment ended after {len(data)} of {count} bytes")
        data += chunk
    return data


def take(fd: int = 0) -> dict[str, str]:
    """Reads the environment send() wrote from `fd` (nothing past it) and sets it in os.environ."""
    line = b""
    while not line.endswith(b"\n"):
        if len(line) > 64:
            raise ValueError(f"expected the launcher's environment on stdin, got {line!r}")
        line += _read_exactly(fd, 1)
    if not line.startswith(_HEADER):
        raise ValueError(f"expected the launcher's environment on stdin, got {line!r}")
    env = json.loads(_read_exactly(fd, int(line[len(_HEADER):].strip())))
    os.environ.update(env)
    return env
