"""Entry point for ``python -m visiontune``: hands the command line to the CLI."""

from visiontune.cli.commands import command

if __name__ == "__main__":
    # A worker forked by torchrun runs this file as a function (``--run-path``), and its agent counts a
    # worker done only when that function returns: ``command`` returns there (success is a return, not
    # SystemExit(0)) and ends the process itself everywhere else.
    command()
