"""``python -m torchring.build``: build the engine now and report what was built.

The answer to "was it built with what I think?" before a long job starts: transports,
NCCL yes/no, compiler flags, and where the cached build lives.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ._core import build as _build


def report() -> dict:
    """Builds (or loads) the engine and returns what it was built with."""
    start = time.time()
    engine = _build.load()
    info = dict(engine.build_info())
    info.update(
        torch=torch.__version__,
        flags=" ".join(_build.flags()),
        compiler=_compiler_used(),
        cache=str(_build.build_dir()),
        load_seconds=round(time.time() - start, 2),
    )
    return info


def _compiler_used() -> str:
    """The compiler the cached engine was built with (toolchain.choose's pick), if recorded."""
    recorded = _build.build_dir() / "compiler"
    return recorded.read_text() if recorded.exists() else "unknown (built before it was recorded)"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m torchring.build", description=__doc__)
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    if args.verbose:
        _build.load(verbose=True)
    info = report()
    print("torchring engine")
    print(f"  transports : {', '.join(info['transports'])}")
    if info["nccl"]:
        print(f"  nccl       : yes ({info['nccl_version']})")
    elif torch.version.cuda and _build.cuda_home() is None:
        print("  nccl       : no (CUDA build of torch, but no CUDA toolkit with cuda.h: set CUDA_HOME)")
    elif torch.version.cuda:
        print("  nccl       : no (CUDA build of torch, but no nccl.h found: set NCCL_HOME)")
    else:
        print("  nccl       : no (CPU build of torch; CUDA tensors need a CUDA build)")
    print(f"  cuda       : {'yes' if info['cuda'] else 'no'}")
    print(f"  float16    : {info['float16_kernel']}")
    print(f"  torch      : {info['torch']}")
    print(f"  compiler   : {info['compiler']}")
    print(f"  flags      : {info['flags']}")
    print(f"  cache      : {info['cache']}")
    print(f"  load time  : {info['load_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
