"""``python -m torchring.run``: the launcher's command line (torchring.launch.cli)."""

import sys

from .launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
