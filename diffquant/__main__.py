"""`python -m diffquant`: the same command line as `diffquant` (diffquant_cli)."""

import sys

from diffquant_cli import main

sys.exit(main())
