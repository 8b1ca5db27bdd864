"""Entry point for ``python -m visiontune``: hands the command line to the CLI."""

import sys

from visiontune.cli.commands import entry

if __name__ == "__main__":
    code = entry()
    # Success is a return, not SystemExit(0): a worker forked by torchrun runs this file as a function
    # (``--run-path``), and its agent counts a worker done only when that function returns.
    if code:
        sys.exit(code)
