"""pytest setup: make torchring and the helpers importable; give collectives a short default timeout."""

import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS, os.path.dirname(_TESTS)]  # tests/ for _dist, the repo root for torchring
# Spawned ranks inherit TORCHRING_* from here; a hang then fails in seconds, not 5 minutes.
os.environ.setdefault("TORCHRING_TIMEOUT", "30")

# GPU tests need a CUDA device; on machines without one they are not collected at all
# (benchmarks/gpu_suite.sh runs them where a GPU exists).
try:
    import torch as _torch
    _HAS_CUDA = _torch.cuda.is_available()
except ImportError:
    _HAS_CUDA = False
collect_ignore_glob = [] if _HAS_CUDA else ["gpu/*"]
