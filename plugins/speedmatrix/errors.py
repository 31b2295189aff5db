"""The one exception type for a mistake in what a user gave (a flag, a recipe, a conf, a file).

The command line prints an :class:`InputError` as one line and exits 2; anything else is a bug
and shows its traceback. It is a ``ValueError`` so that callers that catch ``ValueError`` around
an input check keep working. Standard library only: the load generator's zipapp ships it.
"""

from __future__ import annotations


class InputError(ValueError):
    """What the user gave is wrong: the message names what and how to fix it."""
