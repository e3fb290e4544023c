"""User-facing errors: the CLI prints ``str(err)`` as one line and exits non-zero."""

import contextlib
from collections.abc import Iterator


class LgvitError(Exception):
    """A problem with the user's input (a file, a key, a shape), not a bug in lgvit."""


def error_lines(e: BaseException) -> list[str]:
    """The non-blank lines of ``str(e)``, stripped."""
    return [line.strip() for line in str(e).splitlines() if line.strip()]


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, or its type name when the message is blank.

    Library errors often run to paragraphs; quoting one line keeps our own errors one line.
    """
    lines = error_lines(e)
    return lines[0] if lines else type(e).__name__


def last_line(e: BaseException) -> str:
    """The last line of ``e``'s message (where a chained OS error says what failed), or its
    type name when the message is blank."""
    lines = error_lines(e)
    return lines[-1] if lines else type(e).__name__


@contextlib.contextmanager
def refuse_deep_nesting(where: str, kind: str) -> Iterator[None]:
    """Python's JSON reader recurses once per nesting level: a document nested thousands deep
    (no real annotation or label file is) raises RecursionError, here one line naming
    ``where`` (the file, and the flag that named it)."""
    try:
        yield
    except RecursionError:
        raise LgvitError(f"{where}: {kind} nested too deeply to read") from None


class Preempted(LgvitError):
    """Stopped by SIGTERM/SIGINT (training after saving, or decoding); ``exit_code`` is 128 +
    the signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum
