"""Errors a user can act on. The CLI prints them as one line; everything else is a bug."""


class SpecllmError(Exception):
    """A failure caused by input or environment, explained in one line."""


class UsageError(SpecllmError):
    """A flag or argument that cannot work (exit code 2)."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, at most `limit` characters (its type's name when it has none)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
