"""``python -m specjax``: the ``specjax`` console script."""

import sys

from specjax.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
