"""The C++ engine's boundary: only the bindings files (csrc/bindings*.cpp) know about Python,
so the engine under them builds and reads as plain C++ (torch's ATen, no pybind11)."""

from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "torchring" / "csrc"

# Headers that bring in pybind11 or the CPython API (torch/extension.h includes both).
PYTHON_HEADER = re.compile(
    r'^\s*#\s*include\s*[<"](pybind11/[^>"]*|Python\.h|torch/extension\.h|torch/python\.h|'
    r'torch/csrc/utils/pybind\.h)[>"]',
    re.MULTILINE,
)


def python_includes(root: Path) -> dict[str, list[str]]:
    """Each C++ file under `root` outside bindings*.cpp that includes a Python header, with those headers."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.suffix not in {".cpp", ".h", ".cu", ".cuh", ".hpp"}:
            continue
        if path.parent == root and path.name.startswith("bindings") and path.suffix == ".cpp":
            continue
        headers = PYTHON_HEADER.findall(path.read_text())
        if headers:
            found[str(path.relative_to(root))] = headers
    return found


def test_only_the_bindings_files_include_python_headers() -> None:
    """No engine source but csrc/bindings*.cpp includes pybind11, Python.h or torch/extension.h."""
    assert (CSRC / "bindings.cpp").exists() and (CSRC / "bindings_testing.cpp").exists()
    offenders = python_includes(CSRC)
    assert not offenders, (
        f"these engine files include Python headers: {offenders}; only csrc/bindings*.cpp may "
        "(move the Python-facing part there and keep the engine plain C++)")


def test_the_rule_finds_an_offender(tmp_path: Path) -> None:
    """The scan itself: a header including pybind11 is reported, bindings*.cpp at the top is not."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "x.h").write_text('#pragma once\n#include <pybind11/pybind11.h>\n')
    (tmp_path / "core" / "y.cpp").write_text('#include "core/x.h"\n  #  include <Python.h>\n')
    (tmp_path / "core" / "bindings_z.cpp").write_text("#include <torch/extension.h>\n")
    (tmp_path / "bindings_more.cpp").write_text("#include <torch/extension.h>\n")
    (tmp_path / "plain.cpp").write_text("#include <ATen/ATen.h>\n// #include <Python.h> in a comment\n")
    assert python_includes(tmp_path) == {
        "core/bindings_z.cpp": ["torch/extension.h"],
        "core/x.h": ["pybind11/pybind11.h"],
        "core/y.cpp": ["Python.h"],
    }
