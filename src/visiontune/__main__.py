"""Entry point for ``python -m visiontune``: hands the command line to the CLI."""

import sys

from visiontune.cli.commands import entry

if __name__ == "__main__":
    sys.exit(entry())
