"""pytest setup: make torchring and the helpers importable; give collectives a short default timeout."""

import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS, os.path.dirname(_TESTS)]  # tests/ for _dist, the repo root for torchring
# Spawned ranks inherit TORCHRING_* from here; a hang then fails in seconds, not 5 minutes.
os.environ.setdefault("TORCHRING_TIMEOUT", "30")
