"""Commits on disk, so that a job restarted by torchrun's agent continues from its last commit.

torchring-run --max-restarts K (torchrun's elastic agent) restarts every rank when one fails:
what a TorchState committed in memory dies with the processes. So each commit is also written
by every rank to its own file, ``<dir>/state<n>-rank<r>.pt`` (n: the n-th TorchState of the
process), written to a temporary name and renamed, so a rank killed mid-write leaves the
previous commit intact. ``<dir>`` is ``$TORCHRING_ELASTIC_DIR``, or a directory for the job
under the system's temporary directory, named after torchrun's run id.

Files are written when a launcher can restart the ranks (torchrun's agent sets
``TORCHELASTIC_RUN_ID``) or when ``TORCHRING_ELASTIC_DIR`` is set. They are read back only by a
later incarnation of the same job: the first commit marks the job in the launcher's rendezvous
store (which lives as long as the agent, across restarts), so files left by an earlier job that
reused the run id are never resumed from. With one rank there is no store; there,
``TORCHELASTIC_RESTART_COUNT > 0`` says the job was restarted.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any

import torch

from ..._core import context as _context

__all__ = ["enabled", "directory", "path", "write", "read", "mark_job", "job_was_marked", "remove"]


def enabled() -> bool:
    """Whether commits go to disk: under torchrun's agent, or with TORCHRING_ELASTIC_DIR set."""
    return bool(_context.settings().elastic_dir or os.environ.get("TORCHELASTIC_RUN_ID"))


def directory() -> str:
    """Where this job's commit files live."""
    explicit = _context.settings().elastic_dir
    if explicit:
        return explicit
    run_id = re.sub(r"[^A-Za-z0-9_.-]", "_", os.environ.get("TORCHELASTIC_RUN_ID") or "job")
    return os.path.join(tempfile.gettempdir(), f"torchring-elastic-{run_id}")


def path(index: int, rank: int) -> str:
    """The file of this process's `index`-th TorchState on world rank `rank`."""
    return os.path.join(directory(), f"state{index}-rank{rank}.pt")


def write(file: str, payload: dict[str, Any]) -> None:
    """Saves `payload` to `file` atomically (a temporary file, then a rename)."""
    os.makedirs(os.path.dirname(file), exist_ok=True)
    tmp = f"{file}.tmp{os.getpid()}"
    try:
        torch.save(payload, tmp)
        os.replace(tmp, file)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read(file: str) -> dict[str, Any] | None:
    """The payload in `file`, or None when there is none (or it cannot be read)."""
    try:
        return torch.load(file, map_location=None, weights_only=False)
    except FileNotFoundError:
        return None


def remove(file: str) -> None:
    """Deletes `file` if it exists (a commit of an earlier job)."""
    try:
        os.remove(file)
    except FileNotFoundError:
        pass


def _key() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or "job"
    return f"torchring-elastic/{run_id}/committed"


def mark_job() -> None:
    """Records in the rendezvous store that this job has committed (seen by its restarts)."""
    state = _context._state
    if state is not None and state.store is not None:
        state.store.set(_key(), "1")


def job_was_marked() -> bool:
    """Whether an earlier incarnation of this job committed (so its files are worth resuming)."""
    state = _context._state
    if state is not None and state.store is not None:
        return bool(state.store.check([_key()]))
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
