"""``python -m specjax``: the ``specjax`` console script."""

import sys

from specjax.cli import main

if __name__ == "__main__":
    sys.exit(main())
