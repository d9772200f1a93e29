"""User-facing errors.

Owns: `UserError`, the one exception type for mistakes a user can cause (bad config, bad path,
bad scenario, corrupt checkpoint). The CLI turns it into one line on stderr and exit code 2.
`NothingToDo`: what the command was asked to do is done already (e.g. `--resume` of a finished
run); one line, exit code 0.
Must not import anything from gwtf.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; printed as one line, exit code 2, never a traceback."""


class NothingToDo(Exception):
    """The work asked for is done already; printed as one line, exit code 0."""
