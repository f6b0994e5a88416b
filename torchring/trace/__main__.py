"""python -m torchring.trace DIR: the diagnosis of a hang or failure from every rank's dump.

    python -m torchring.trace /tmp/torchring-trace/myjob            # a few lines: who, where, why
    python -m torchring.trace DIR --chrome trace.json               # also a Chrome trace, a row per rank

The same dumps open in torch's analyzer: python -m torch.distributed.flight_recorder.fr_trace DIR.
"""

from __future__ import annotations

import argparse
import sys

from . import chrome as _chrome, diagnose as _diagnose


def main(argv: list[str] | None = None) -> int:
    """Prints the diagnosis of DIR's dumps; 1 when DIR holds none."""
    parser = argparse.ArgumentParser(prog="python -m torchring.trace", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where the ranks wrote their dumps (TORCHRING_TRACE_DIR)")
    parser.add_argument("--chrome", metavar="PATH", help="also write the dumps as a Chrome trace here")
    args = parser.parse_args(argv)
    lines, _ = _diagnose.diagnose(args.directory)
    print("\n".join(lines))
    if args.chrome:
        print(f"Chrome trace: {_chrome.write(args.directory, args.chrome)}")
    return 0 if len(lines) > 1 else 1


if __name__ == "__main__":
    sys.exit(main())
