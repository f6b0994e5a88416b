"""Builds the C++ engine on first use and caches it.

The cache key covers the torch version, the Python version, the compiler flags, the
sources and the CPU's instruction set, so a new torch (or a new machine sharing a home
directory) rebuilds instead of failing to import. A file lock makes the ranks of a job
that start together build once: the first takes the lock and builds, the rest wait and
load the result. Progress goes to the "torchring" logger (torchring._core.log).
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from . import settings as _settings, toolchain as _toolchain, types as _types
from .log import logger

_NAME = "torchring_C"
_CSRC = Path(__file__).resolve().parents[1] / "csrc"
# The C++ standard: whatever this torch needs (cpp_extension sets it).
_CFLAGS = ["-O3", "-march=native", "-fwrapv", "-Wall", "-Werror=return-type", "-Wno-unused-function"]
# TORCHRING_DEBUG_BUILD=1: unoptimized, with AddressSanitizer and UBSan (its own cache entry).
_SANITIZE = "-fsanitize=address,undefined"
_DEBUG_CFLAGS = ["-O0", "-g", "-fno-omit-frame-pointer", _SANITIZE, "-fwrapv", "-Wall", "-Werror=return-type",
                 "-Wno-unused-function"]
_module: ModuleType | None = None


def nccl_paths() -> tuple[str, str] | None:
    """(include dir, lib dir) of NCCL for a CUDA build of torch: NCCL_HOME, else the
    nvidia-nccl wheel torch depends on; None on a CPU build of torch, without NCCL, or
    without a CUDA toolkit to compile against."""
    if not torch.version.cuda or cuda_home() is None:
        return None
    for root in nccl_roots():
        if (root / "include" / "nccl.h").exists() and (root / "lib").is_dir():
            return str(root / "include"), str(root / "lib")
    return None


def nccl_roots() -> list[Path]:
    """Where an NCCL may be, in order: NCCL_HOME, then the nvidia-nccl wheel's directories."""
    home = os.environ.get("NCCL_HOME")
    candidates = [Path(home)] if home else []
    try:  # optional: the nvidia-nccl wheel exists only beside a CUDA build of torch
        import nvidia.nccl
        candidates += [Path(p) for p in nvidia.nccl.__path__]
    except ImportError:
        pass
    return candidates


def cuda_home() -> str | None:
    """The CUDA toolkit that has cuda.h: CUDA_HOME or CUDA_PATH, the real location of nvcc
    (a /usr/local/bin/nvcc link would otherwise make cpp_extension guess /usr/local), or
    /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and (Path(home) / "include" / "cuda.h").exists():
            return home
    return None


def sources() -> list[Path]:
    """The engine's C++ sources: the CPU engine, plus the NCCL path when it can be built."""
    found = sorted(p for p in _CSRC.rglob("*.cpp") if p.parent.name != "cuda")
    if nccl_paths() is not None:
        found += sorted(_CSRC.glob("cuda/*.cpp"))
    # cpp_extension names each object file after its source's base name alone.
    names = [p.stem for p in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RuntimeError(f"torchring/csrc: sources share a base name, but each needs an object "
                           f"file of its own: rename one of each {twice}")
    return found


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine()


def cache_key() -> str:
    """Hash of everything the compiled engine depends on."""
    h = hashlib.sha256()
    identity = (torch.__version__, str(torch.version.git_version), str(torch.version.cuda),
                str(torch._C._GLIBCXX_USE_CXX11_ABI), sys.version, " ".join(flags()), _cpu_flags(),
                str(nccl_paths()), str(cuda_home()), os.environ.get("CXX", ""))
    for part in identity:
        h.update(part.encode())
    for path in sources() + sorted(_CSRC.glob("**/*.h")):
        h.update(path.relative_to(_CSRC).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """Where this engine version is (or will be) built."""
    return _settings.cache_dir(os.environ) / f"{torch.__version__.replace('+', '_')}-{cache_key()}"


def _import_built(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(verbose: bool = False) -> ModuleType:
    """Returns the engine module, building it first if this version is not cached; raises
    ImportError if its reduce ops, op kinds or dtypes differ from torchring._core.types'."""
    global _module
    if _module is not None:
        return _module
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    built = directory / f"{_NAME}.so"
    done = directory / "built.ok"  # written after a complete build: never load a half-linked .so
    if not done.exists():
        with open(directory / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                # We hold the build lock: a "lock" file of cpp_extension's own is left over
                # from a build that was killed, and would make this one wait forever.
                (directory / "lock").unlink(missing_ok=True)
                built.unlink(missing_ok=True)
                _compile(directory, verbose)
                done.write_text(cache_key())
    if _debug():
        _require_asan_runtime()
    module = _import_built(built)
    _types.check_engine(module)
    module.set_warning_sink(_engine_warning)
    # At exit (after _context's shutdown(), registered later, stopped the engine's threads),
    # engine warnings go back to stderr: no engine thread takes the GIL while Python finalizes.
    atexit.register(module.set_warning_sink, None)
    _module = module
    return _module


def _compile(directory: Path, verbose: bool) -> None:
    nccl = nccl_paths()
    if nccl is not None:
        os.environ.setdefault("CUDA_HOME", cuda_home() or "")  # read when cpp_extension is imported
        # The engine has no device code, so the arch list changes nothing; but on a machine
        # without a GPU cpp_extension cannot derive one and fails unless it is given.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    # cpp_extension compiles with CXX: for this build, a compiler whose code works inside this
    # Python (toolchain.py); the caller's CXX (part of the cache key) is put back afterwards.
    compiler = _toolchain.choose([f for f in flags() if not f.startswith("-fsanitize")])
    (directory / "compiler").write_text(compiler)
    callers_cxx = os.environ.get("CXX")
    os.environ["CXX"] = compiler
    # Imported here, not at the top: cpp_extension reads CUDA_HOME when it is imported (set
    # just above), and only a build needs it.
    from torch.utils import cpp_extension

    start = time.time()
    logger.info("building the engine in %s (once per torch version)...", directory)
    # Every #include of the engine's own headers is written from csrc/ ("core/common.h").
    cflags, includes, ldflags = flags(), [str(_CSRC)], [_SANITIZE] if _debug() else []
    if nccl is not None:
        include, lib = nccl
        cflags.append("-DTORCHRING_WITH_NCCL")
        includes += [include, os.path.join(cuda_home() or "", "include")]
        try:  # optional: the CUDA headers of the nvidia wheels (some toolkits ship nvcc and little else)
            import nvidia.cu13
            includes += [os.path.join(p, "include") for p in nvidia.cu13.__path__]
        except ImportError:
            pass
        ldflags += [f"-L{lib}", "-l:libnccl.so.2", f"-Wl,-rpath,{lib}"]
    try:
        cpp_extension.load(
            name=_NAME,
            sources=[str(p) for p in sources()],
            extra_cflags=cflags,
            extra_include_paths=includes,
            extra_ldflags=ldflags,
            build_directory=str(directory),
            verbose=verbose,
            with_cuda=nccl is not None,
            is_python_module=True,
        )
    finally:
        if callers_cxx is None:
            os.environ.pop("CXX", None)
        else:
            os.environ["CXX"] = callers_cxx
    logger.info("engine built in %.0f s", time.time() - start)


def _engine_warning(message: str) -> None:
    """Where the engine's warnings (a refused stray connection, the NCCL watchdog) go."""
    logger.warning("%s", message)


def flags() -> list[str]:
    """The compiler flags the engine is built with."""
    return list(_DEBUG_CFLAGS if _debug() else _CFLAGS)


def _debug() -> bool:
    return _settings.Settings.for_build(os.environ).debug_build


def _require_asan_runtime() -> None:
    """A library built with ASan loads only into a process whose first library is ASan's
    runtime; say how to start one instead of failing inside the dynamic loader."""
    with open("/proc/self/maps") as maps:
        if "libasan" in maps.read():
            return
    raise ImportError(
        "TORCHRING_DEBUG_BUILD=1 builds the engine with AddressSanitizer, whose runtime must be "
        "loaded first (and libstdc++ with it, or ASan cannot intercept C++ exceptions): run "
        "LD_PRELOAD=\"$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)\" "
        "ASAN_OPTIONS=detect_leaks=0 python ..., or unset TORCHRING_DEBUG_BUILD")
