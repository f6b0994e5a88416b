"""pytest setup: make torchring and the helpers importable; give collectives a short default timeout."""

import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
# tests/support for the helpers (_dist, _hosts, _fake_world, _world, ...), the repo root for torchring
sys.path[:0] = [os.path.join(_TESTS, "support"), os.path.dirname(_TESTS)]
# Spawned ranks inherit TORCHRING_* from here; a hang then fails in seconds, not 5 minutes.
os.environ.setdefault("TORCHRING_TIMEOUT", "30")

# GPU tests need a CUDA device; on machines without one they are not collected at all
# (benchmarks/gpu_suite.py runs them where a GPU exists; its --dry-run collects them anyway,
# TORCHRING_COLLECT_GPU_TESTS=1, to check their imports).
try:
    import torch as _torch
    _HAS_CUDA = _torch.cuda.is_available()
except ImportError:
    _HAS_CUDA = False
collect_ignore_glob = [] if _HAS_CUDA or os.environ.get("TORCHRING_COLLECT_GPU_TESTS") == "1" else ["gpu/*"]

_SPAWNING = tuple(os.path.join(_TESTS, d) + os.sep for d in ("spawned", "gpu"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests under tests/spawned/ (and tests/gpu/) start ranks in processes of their own: they
    get the `spawned` marker, so `pytest -m "not spawned"` is the fast run."""
    for item in items:
        if str(item.path).startswith(_SPAWNING):
            item.add_marker(pytest.mark.spawned)
