"""python -m torchring.trace DIR: the diagnosis of a hang or failure from every rank's dump.

    python -m torchring.trace /tmp/torchring-trace/myjob            # a few lines: who, where, why
    python -m torchring.trace DIR --chrome trace.json               # also a Chrome trace, a row per rank
    python -m torchring.trace --status DIR                          # the ranks' status table (TORCHRING_STATUS_S)

The same dumps open in torch's analyzer: python -m torch.distributed.flight_recorder.fr_trace DIR.
"""

from __future__ import annotations

import argparse
import sys

from . import chrome as _chrome, diagnose as _diagnose, status as _status


def main(argv: list[str] | None = None) -> int:
    """Prints the diagnosis of DIR's dumps; 1 when DIR holds none."""
    parser = argparse.ArgumentParser(prog="python -m torchring.trace", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where the ranks wrote their dumps (TORCHRING_TRACE_DIR)")
    parser.add_argument("--chrome", metavar="PATH", help="also write the dumps as a Chrome trace here")
    parser.add_argument("--status", action="store_true",
                        help="print the table of the ranks' status files in DIR instead (a job started "
                             "without torchring-run, with TORCHRING_STATUS_S and TORCHRING_TRACE_DIR set)")
    args = parser.parse_args(argv)
    if args.status:
        print("\n".join(_status.lines(args.directory)))
        return 0 if _status.read(args.directory) else 1
    lines, _ = _diagnose.diagnose(args.directory)
    print("\n".join(lines))
    if args.chrome:
        print(f"Chrome trace: {_chrome.write(args.directory, args.chrome)}")
    return 0 if len(lines) > 1 else 1


if __name__ == "__main__":
    sys.exit(main())
