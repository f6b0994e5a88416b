"""What the peer-suite runners read of a pytest JUnit XML report: each test case's outcome."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path


def outcomes(path: Path) -> Iterator[tuple[str, str, str]]:
    """(test name, pass/FAIL/skip, the failure's or skip's message) for each test case of the
    report at `path`; a failure or error outranks a skip of the same case (a teardown error)."""
    for case in ET.parse(path).getroot().iter("testcase"):
        status, why = "pass", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status, why = "FAIL", (child.get("message") or child.text or "").strip()
            elif child.tag == "skipped" and status != "FAIL":
                status, why = "skip", (child.get("message") or "").strip()
        yield case.get("name", "?"), status, why
