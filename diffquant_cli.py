"""The `diffquant` command's entry point, outside the package so that it can start the command line before
`import diffquant` registers the designs with transformers (which loads torch): `diffquant --help` and argument
errors answer at once; a command that runs registers them itself (diffquant.commands._lazy)."""

import sys


def main(argv=None) -> int:
    sys._diffquant_command_line = True
    from diffquant.cli import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
