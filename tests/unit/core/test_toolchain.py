"""The compiler check before an engine build (torchring/_core/toolchain.py), with this machine's
compiler and with stand-in compilers whose probe library crashes or prints the wrong text,
as a compiler that does not match this Python's C++ library would."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from torchring._core import toolchain

GOOD = shutil.which("c++") or shutil.which("g++") or "g++"  # the engine itself needs one to build


def _stand_in(tmp_path: Path, name: str, body: str) -> str:
    """A 'compiler' that ignores its sources and builds a probe library whose function runs
    `body` (with the real compiler), as a mismatched toolchain's library would misbehave."""
    source = tmp_path / f"{name}.cpp"
    source.write_text('#include <cstring>\nextern "C" int torchring_probe(char* out, int size) {\n'
                      f"{body}\n}}\n")
    script = tmp_path / name
    script.write_text(f'#!/bin/sh\nfor a; do out="$a"; done\nexec {GOOD} -shared -fPIC {source} -o "$out"\n')
    script.chmod(0o755)
    return str(script)


def test_this_machines_compiler_passes() -> None:
    assert toolchain.probe(GOOD, ["-O2"]) is None


def test_a_probe_that_crashes_is_named_with_its_signal(tmp_path: Path) -> None:
    crashing = _stand_in(tmp_path, "crashing-c++", "  return *static_cast<volatile int*>(nullptr);")
    failure = toolchain.probe(crashing, [])
    assert failure is not None and "died of signal 11" in failure and "std::ostringstream" in failure, failure


def test_a_probe_that_prints_the_wrong_text_is_refused(tmp_path: Path) -> None:
    wrong = _stand_in(tmp_path, "wrong-c++", '  std::strcpy(out, "probe 1 42 2.5"); return 14;')
    failure = toolchain.probe(wrong, [])
    assert failure is not None and "'probe 1 42 2.5'" in failure and toolchain.EXPECTED in failure, failure


def test_a_compiler_that_cannot_compile_is_refused(tmp_path: Path) -> None:
    broken = tmp_path / "broken-c++"
    broken.write_text("#!/bin/sh\necho 'no such compiler here' >&2\nexit 3\n")
    broken.chmod(0o755)
    failure = toolchain.probe(str(broken), [])
    assert failure is not None and "could not compile the probe" in failure and "no such compiler" in failure


def test_cxx_comes_first_and_each_compiler_once(tmp_path: Path) -> None:
    fake = _stand_in(tmp_path, "first-c++", "  return 0;")
    found = toolchain.candidates({"CXX": fake, "PATH": os.environ["PATH"]})
    assert found[0] == fake
    assert len({os.path.realpath(c) for c in found}) == len(found)


def test_a_crashing_cxx_is_passed_over_for_the_next_compiler(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    crashing = _stand_in(tmp_path, "crashing-c++", "  return *static_cast<volatile int*>(nullptr);")
    with caplog.at_level(logging.WARNING, logger="torchring"):
        chosen = toolchain.choose([], {"CXX": crashing})
    assert os.path.realpath(chosen) != os.path.realpath(crashing)
    assert toolchain.probe(chosen, []) is None
    assert any(crashing in r.getMessage() and "signal 11" in r.getMessage() for r in caplog.records), caplog.text


def test_no_working_compiler_raises_naming_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    crashing = _stand_in(tmp_path, "crashing-c++", "  return *static_cast<volatile int*>(nullptr);")
    wrong = _stand_in(tmp_path, "wrong-c++", '  std::strcpy(out, "x"); return 1;')
    monkeypatch.setattr(toolchain, "candidates", lambda environ=None: [crashing, wrong])
    with pytest.raises(RuntimeError) as info:
        toolchain.choose([])
    text = str(info.value)
    assert crashing in text and wrong in text and "signal 11" in text and "Set CXX" in text, text
