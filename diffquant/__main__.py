"""`python -m diffquant`: the same command line as `diffquant` (diffquant_cli)."""

import sys

if __name__ == "__main__":
    from diffquant_cli import main

    sys.exit(main())
