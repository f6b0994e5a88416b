"""engine_call_probe: the engine's allreduce call alone, without torchring.allreduce's Python
wrapper: nanoseconds per call of a small allreduce through the function torchring.allreduce
calls for a plain tensor (bindings.cpp, allreduce_now), on a communicator of its own.

    torchring-run -np 1 python benchmarks/probes/engine_call_probe.py     # the software path alone
    torchring-run -np 2 python benchmarks/probes/engine_call_probe.py     # and one exchange
    PROBE_NUMEL=1024 PROBE_TRACE=512 torchring-run -np 2 python benchmarks/probes/engine_call_probe.py

PROBE_NUMEL float32 elements (default 1: 4 bytes), PROBE_CALLS timed calls (default 2000000)
after 100000 untimed ones, PROBE_TRACE the communicator's flight recorder entries (default 0:
none). Rank 0 prints one line. To compare two checkouts, alternate their jobs (PYTHONPATH), as
the VM's fast and slow spells last seconds.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import torchring

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _harness
import _harness  # noqa: E402


def main() -> None:
    """Times PROBE_CALLS calls and has rank 0 print ns per call."""
    torchring.init()
    trace = int(os.environ.get("PROBE_TRACE", "0"))
    engine, comm = _harness.world_communicator("engine-call-probe", trace)
    call = engine.allreduce_now_function(comm)
    t = torch.zeros(int(os.environ.get("PROBE_NUMEL", "1")))
    calls = int(os.environ.get("PROBE_CALLS", "2000000"))
    for _ in range(100000):
        call(t, 0)
    start = time.perf_counter()
    for _ in range(calls):
        call(t, 0)
    ns = (time.perf_counter() - start) / calls * 1e9
    if torchring.rank() == 0:
        print(f"world {torchring.size()}, {t.numel() * 4} B, trace {trace}: {ns:.1f} ns per call")
    comm.shutdown()
    torchring.shutdown()


if __name__ == "__main__":
    main()
