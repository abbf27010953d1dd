"""The command line's own error: the arguments name something that is not there or not usable.

Raised by the commands, turned into a message on stderr and exit status 2 by
:func:`rollfeed.cli.main` (argparse's own usage errors exit 2 too), so a wrong argument is a
sentence naming it, never a traceback.
"""

from __future__ import annotations

from rollfeed.errors import RollfeedError


class UsageError(RollfeedError):
    """A command's argument is wrong: a path that does not exist or holds nothing the command
    reads, a group filter matching no group, flags that do not go together."""
