"""``UserError``: the one exception that means "the user asked for something wrong".

The CLI prints its message on one line and exits with code 2. Every wing raises it; it imports
nothing, so it sits below them all.
"""


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""


class NoSpaceError(UserError):
    """A write that ran out of disk space or quota: a ``UserError`` a caller may also catch and work around."""
