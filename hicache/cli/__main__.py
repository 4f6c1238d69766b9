"""``python -m hicache.cli``: the ``hicache`` command line."""
import sys

from hicache.cli import main

if __name__ == "__main__":
    sys.exit(main())
