"""Message sizes as the benchmarks read and print them: '64K' <-> 65536 bytes <-> '64 KiB'.

No imports beyond the standard library, so summarize.py stays quick without torch."""

from __future__ import annotations

UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """'64K' -> 65536 bytes; a bare number is bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def fmt_size(nbytes: int) -> str:
    """65536 -> '64 KiB': the largest binary unit that divides the size, else bytes."""
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}iB"
    return f"{nbytes} B"
