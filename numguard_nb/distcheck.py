"""`python -m numguard_nb.distcheck`: the network check's command (it lives in `distributed.check`)."""

import sys

from .distributed.check import main, run

__all__ = ["main", "run"]

if __name__ == "__main__":
    sys.exit(main())
