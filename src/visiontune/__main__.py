"""Entry point for ``python -m visiontune``: hands the command line to the CLI."""

import sys

from visiontune.cli.commands import command, entry

if __name__ == "__main__":
    if globals() is vars(sys.modules["__main__"]):  # the program itself, `python -m visiontune`
        # ``command`` ends the process (``leave``); a worker forked by torchrun runs this file as a function
        # (``--run-path``), and its agent counts a worker done only when that function returns: ``command``
        # returns there, success as a return, not SystemExit(0).
        command()
    else:  # run by another program's runpy (`python -m cProfile -m visiontune`), which goes on after it
        code = entry()
        if code:
            sys.exit(code)
