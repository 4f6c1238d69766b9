"""``python -m hicache.cli``: the ``hicache`` command line."""
import sys

from hicache.cli import main

sys.exit(main())
