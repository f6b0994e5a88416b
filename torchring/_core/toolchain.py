"""The C++ compiler the engine is built with, checked against the C++ library of the process
that will load it.

The engine runs inside Python with whichever libstdc++ the process loaded first (importing
torch loads the system's). A compiler whose headers belong to another libstdc++ (a toolchain
under /opt that CXX points at, say) can build an engine that imports cleanly and then crashes
at its first stream formatting: on a GPU machine whose CXX was /opt/gcc/bin/g++, every
`std::ostringstream << int` in the engine ended in SIGSEGV inside std::ostream::_M_insert.

choose() compiles a small probe library with each candidate compiler (CXX, then c++ and g++
on PATH, then /usr/bin's), loads it in a fresh Python that imported torch first, and asks it
to format numbers through a stream. The first candidate whose probe returns the expected text
builds the engine; a rejected one is named with what its probe did.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .log import logger

PROBE_SOURCE = r"""
#include <cstring>
#include <sstream>
#include <string>

extern "C" int torchring_probe(char* out, int size) {
  std::ostringstream s;
  s << "probe " << 1234567890123LL << " " << 42 << " " << 2.5;
  std::string text = s.str();
  if (static_cast<int>(text.size()) + 1 > size) return -1;
  std::memcpy(out, text.c_str(), text.size() + 1);
  return static_cast<int>(text.size());
}
"""
EXPECTED = "probe 1234567890123 42 2.5"
# The probe's loader: torch first, so the probe meets the C++ library the engine will meet.
_LOADER = ("import ctypes, sys, torch\n"
           "lib = ctypes.CDLL(sys.argv[1])\n"
           "buf = ctypes.create_string_buffer(256)\n"
           "lib.torchring_probe(buf, 256)\n"
           "print(buf.value.decode())\n")


def candidates(environ: dict[str, str] | os._Environ = os.environ) -> list[str]:
    """The compilers to try, in order, each once (by its real path): CXX, c++ and g++ on
    PATH, /usr/bin/c++ and /usr/bin/g++."""
    found: list[str] = []
    seen: set[str] = set()
    for name in (environ.get("CXX"), "c++", "g++", "/usr/bin/c++", "/usr/bin/g++"):
        path = shutil.which(name) if name else None
        if path and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            found.append(path)
    return found


def probe(compiler: str, flags: list[str]) -> str | None:
    """None if a library built by `compiler` with `flags` formats numbers correctly inside a
    Python that imported torch; else what went wrong (its compile error, its signal, its text)."""
    with tempfile.TemporaryDirectory(prefix="torchring-probe-") as tmp:
        source, library = Path(tmp) / "probe.cpp", Path(tmp) / "probe.so"
        source.write_text(PROBE_SOURCE)
        try:
            built = subprocess.run([compiler, "-std=c++17", "-shared", "-fPIC", *flags, str(source), "-o",
                                    str(library)], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"could not run: {exc}"
        if built.returncode != 0:
            return f"could not compile the probe: {built.stderr.strip()[-400:]}"
        # Without LD_PRELOAD: under a sanitizer's preloaded runtime (TORCHRING_DEBUG_BUILD's tests) a
        # crash would end in the sanitizer's report and exit 1 instead of the signal that names it.
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        try:
            ran = subprocess.run([sys.executable, "-c", _LOADER, str(library)], capture_output=True, text=True,
                                 timeout=120, env=env)
        except subprocess.SubprocessError as exc:
            return f"the probe did not finish: {exc}"
        if ran.returncode < 0:
            return f"the probe died of signal {-ran.returncode} formatting a number through std::ostringstream"
        if ran.returncode != 0 or ran.stdout.strip() != EXPECTED:
            return f"the probe printed {ran.stdout.strip()!r} (exit {ran.returncode}), expected {EXPECTED!r}"
    return None


def choose(flags: list[str], environ: dict[str, str] | os._Environ = os.environ) -> str:
    """The first candidate compiler whose probe passes; raises RuntimeError naming each
    candidate and its failure when none does."""
    rejected: list[str] = []
    for compiler in candidates(environ):
        failure = probe(compiler, flags)
        if failure is None:
            if rejected:
                logger.warning("building the engine with %s instead: %s", compiler, "; ".join(rejected))
            return compiler
        rejected.append(f"{compiler} rejected ({failure})")
    raise RuntimeError("torchring: no C++ compiler here builds code that works inside this Python: "
                       + ("; ".join(rejected) or "none found (set CXX, or install g++)")
                       + ". Set CXX to the compiler that matches the libstdc++ this Python loads "
                       "(usually the system's /usr/bin/g++)")
