"""The launcher's side of the flight recorder: where the ranks dump, and the diagnosis it prints.

torchring-run gives every rank of a run one TORCHRING_TRACE_DIR (unless the user chose one).
When the job fails, the rank that failed has dumped its record, and torch's agent has stopped
the others with SIGTERM, on which each dumps before it ends (torchring/trace/recorder.py); the
launcher then reads every dump there and prints the diagnosis under its failure line. After a
run that succeeded, the directory it made goes (the ranks' status files in it have been read for
the end-of-job report), unless a rank wrote a dump there on request.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import MutableMapping

from ..trace import diagnose as _diagnose, dump as _dump

VARIABLE = "TORCHRING_TRACE_DIR"
_PREFIX = "torchring-trace-"


def choose_directory(env: MutableMapping[str, str]) -> str:
    """The run's dump directory: the user's TORCHRING_TRACE_DIR, else a new one (set in `env`)."""
    if env.get(VARIABLE, "").strip():
        return env[VARIABLE]
    env[VARIABLE] = tempfile.mkdtemp(prefix=_PREFIX)
    return env[VARIABLE]


def clean_up(directory: str, chosen_by_user: bool) -> None:
    """After a run that succeeded: removes the directory this launcher made, unless it holds a
    dump (torchring.dump_trace() or SIGUSR1 during the run); the ranks' status files go with it."""
    if chosen_by_user or not os.path.basename(directory).startswith(_PREFIX):
        return
    try:
        names = os.listdir(directory)
        if any(name.startswith(_dump.PREFIX) for name in names):
            return
        shutil.rmtree(directory, ignore_errors=True)
    except OSError:
        pass


def report(directory: str) -> str:
    """The diagnosis of the dumps in `directory`, for the failure message ("" when none were written)."""
    if not os.path.isdir(directory):
        return ""
    try:
        lines, _ = _diagnose.diagnose(directory)
    except Exception as e:  # a damaged dump must not hide the job's own failure
        return f"torchring-run: could not read the flight-recorder dumps in {directory}: {e}"
    if len(lines) < 2:
        return ""
    return "\n".join(["torchring-run: what the ranks' flight recorders say:", *lines,
                      f"(the dumps: {directory}; python -m torchring.trace {directory} --chrome trace.json; "
                      f"torch's analyzer reads them too)"])
