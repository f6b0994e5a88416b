"""What the machine is, for the record of a GPU suite run: GPU, driver, CUDA, NCCL, CPU, memory
bandwidth (one thread and every core, host side; device to device on the GPU).

    python3 benchmarks/gpu_machine.py --json machine.json

Copy bandwidths count bytes read plus bytes written (STREAM's counting), medians of 5.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import copy_bandwidth, machine_info, parse_args  # noqa: E402


def gpu_info() -> dict[str, Any]:
    """The GPU as torch and nvidia-smi see it, its device-to-device copy bandwidth; {} without one."""
    if not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {"gpu": props.name, "gpu_memory_GiB": round(props.total_memory / 2**30, 1),
                            "sms": props.multi_processor_count, "cuda": torch.version.cuda,
                            "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvidia_smi"] = f"unavailable: {exc}"
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    info["d2d_copy_GBps"] = 2 * src.numel() * 4 / statistics.median(times) / 1e9
    return info


def cpu_flags() -> dict[str, Any]:
    """AVX-512 and AVX2 presence, and the memory size."""
    flags, mem = "", 0
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
        with open("/proc/meminfo") as f:
            mem = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) // 2**20
    except (OSError, StopIteration):
        pass
    return {"avx512f": " avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags, "avx2": " avx2" in flags,
            "memory_GiB": mem}


def toolchain() -> dict[str, Any]:
    """Where the engine's build finds the CUDA toolkit and NCCL (None: it builds without the NCCL
    path), and each candidate compiler's verdict from the build's probe (torchring/_core/toolchain.py)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from torchring._core import toolchain
    from torchring._core.build import cuda_home, nccl_paths

    compilers = {c: toolchain.probe(c, ["-O2"]) or "ok" for c in toolchain.candidates()}
    return {"cuda_home": cuda_home(), "nccl_paths": nccl_paths(), "CXX": os.environ.get("CXX"),
            "compilers (probe)": compilers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the record here")
    args = parse_args(parser)
    info = {**machine_info(), **cpu_flags(), "copy_t1_GBps": copy_bandwidth(),
            "copy_all_cores_GBps": copy_bandwidth(1 << 30, threads=os.cpu_count() or 1), **toolchain(), **gpu_info()}
    for key, value in info.items():
        print(f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
