"""The one exception type that means "the user asked for something we cannot do".

The CLI turns it into a single line on stderr and exit code 2; anything else is a bug and keeps
its traceback.  It subclasses ValueError so library callers can catch it the usual way.
"""


class UsageError(ValueError):
    """Bad input: the message names what is wrong and the flag or file to change."""


def first_line(err: BaseException, limit: int = 160) -> str:
    """A library error's first line (its type's name if it has no text), cut to `limit`
    characters: the reason inside one of our one-line messages."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:limit]
