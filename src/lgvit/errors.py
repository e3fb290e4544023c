"""User-facing errors: the CLI prints ``str(err)`` as one line and exits non-zero."""


class LgvitError(Exception):
    """A problem with the user's input (a file, a key, a shape), not a bug in lgvit."""
