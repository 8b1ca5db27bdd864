"""cli: the ``visiontune`` command, its subcommands and flags -- the only wing that sees argparse.

Owns: parsing a command line into a ``TrainConfig`` or a command's own options, and handing it to
the wing that does the work. May import every other wing. ``main(argv)`` takes a list, so tests
and scripts call the CLI in-process; ``command`` is the console script
(``entry``, then ``leave``: the process's exit without the interpreter's teardown).
"""

from visiontune.cli.commands import command, entry, main

__all__ = ["command", "entry", "main"]
