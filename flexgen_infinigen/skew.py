"""The old name of :mod:`.calibrate` (``python -m flexgen_infinigen.skew``), kept for one
release: it says so on stderr and runs ``calibrate`` with the same arguments."""
from __future__ import annotations

import sys

from .calibrate import main as calibrate_main


def main(argv=None) -> int:
    print("flexgen_infinigen.skew is now flexgen_infinigen.calibrate; this name goes in the next "
          "release", file=sys.stderr)
    return calibrate_main(argv, prog="python -m flexgen_infinigen.skew")


if __name__ == "__main__":
    sys.exit(main())
