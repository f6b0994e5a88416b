"""Compile-check the engine's CUDA and NCCL sources on a machine without a GPU or a CUDA build of torch.

    python benchmarks/cuda_syntax.py          # exit 0: every source that the NCCL build changes parses

The GPU machine builds the engine with TORCHRING_WITH_NCCL, which adds sources (torchring/csrc/cuda/)
and code paths that a CPU build of torch never compiles, so a typo there would cost a GPU run its
build step. This runs the compiler's front end (-fsyntax-only), with TORCHRING_WITH_NCCL defined,
on the engine sources that test that define or include CUDA's headers, against this torch's
headers (a CPU build ships c10/cuda's headers but not the one CMake generates,
cuda_cmake_macros.h, which is written here), the CUDA toolkit's (the one the engine's build takes:
torchring._core.build.cuda_home) and NCCL's (build.nccl_roots: NCCL_HOME, else the nvidia-nccl
wheel of a CUDA torch; else that wheel downloaded once into ~/.cache/torchring/nccl-headers). It
checks syntax and types against those headers, not linking, and not torch's CUDA-only symbols
that a CPU build lacks. Without a CUDA toolkit it prints NOT CHECKED and exits 0.
benchmarks/gpu_suite.py --dry-run (and so the test tier, tests/spawned/bench) runs it as the
build step's check.
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch.utils.cpp_extension as cpp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from torchring._core import build  # noqa: E402  (this checkout's, as the GPU suite runs it)

CSRC = ROOT / "torchring" / "csrc"
NCCL_WHEEL = "nvidia-nccl-cu13"


def nccl_include() -> Path:
    """A directory holding nccl.h (see the module docstring for where it is looked for)."""
    candidates = [root / "include" for root in build.nccl_roots()]
    cache = Path.home() / ".cache" / "torchring" / "nccl-headers"
    candidates += [Path(p).parent for p in glob.glob(str(cache / "**" / "nccl.h"), recursive=True)]
    for c in candidates:
        if (c / "nccl.h").exists():
            return c
    cache.mkdir(parents=True, exist_ok=True)
    print(f"(downloading {NCCL_WHEEL} for its headers into {cache})", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", NCCL_WHEEL, "-d", str(cache)],
                   check=True)
    wheel = sorted(cache.glob("nvidia_nccl*.whl"))[-1]
    subprocess.run([sys.executable, "-m", "zipfile", "-e", str(wheel), str(cache / "unpacked")], check=True)
    found = glob.glob(str(cache / "unpacked" / "**" / "nccl.h"), recursive=True)
    if not found:
        raise SystemExit(f"{wheel.name} holds no nccl.h; set NCCL_HOME to an NCCL with include/nccl.h")
    return Path(found[0]).parent


def check(source: Path, flags: list[str]) -> tuple[Path, str]:
    """(source, the compiler's errors or '')."""
    done = subprocess.run([os.environ.get("CXX", "c++"), "-fsyntax-only", *flags, str(source)],
                          capture_output=True, text=True)
    return source, done.stderr if done.returncode else ""


def main() -> int:
    home = build.cuda_home()  # the toolkit the engine's own build would take
    if home is None:  # a machine without the toolkit cannot check; it says so and does not fail
        print("NOT CHECKED: no CUDA toolkit (cuda.h under CUDA_HOME, CUDA_PATH, nvcc's or /usr/local/cuda)")
        return 0
    cuda = Path(home) / "include"
    with tempfile.TemporaryDirectory() as stub:
        macros = Path(stub) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        macros.parent.mkdir(parents=True)
        macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes = [str(CSRC), stub, *cpp.include_paths(), sysconfig.get_paths()["include"],
                    str(cuda), str(nccl_include())]
        flags = ["-std=c++17", "-DTORCHRING_WITH_NCCL", *(f"-I{p}" for p in includes)]
        # The sources the NCCL build changes: those that test the define or reach CUDA's headers.
        sources = sorted(s for s in CSRC.rglob("*.cpp")
                         if any(k in s.read_text() for k in ("TORCHRING_WITH_NCCL", '#include "cuda/', "c10/cuda")))
        print(f"compile-checking {len(sources)} engine sources with TORCHRING_WITH_NCCL: "
              f"{', '.join(str(s.relative_to(CSRC)) for s in sources)}", flush=True)
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            results = list(pool.map(lambda s: check(s, flags), sources))
    failed = [(s, err) for s, err in results if err]
    for source, err in failed:
        print(f"\n== {source.relative_to(ROOT)}\n{err[-4000:]}")
    print(f"{len(sources) - len(failed)} of {len(sources)} sources parse with the NCCL path")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
