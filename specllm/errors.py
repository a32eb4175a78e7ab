"""Errors a user can act on. The CLI prints them as one line; everything else is a bug."""


class SpecllmError(Exception):
    """A failure caused by input or environment, explained in one line."""


class UsageError(SpecllmError):
    """A flag or argument that cannot work (exit code 2)."""
