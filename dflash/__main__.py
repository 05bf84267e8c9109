"""`python -m dflash ...` is the `dflash` command."""

import sys

from dflash.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
