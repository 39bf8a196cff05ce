"""What a command's outcome means to the shell, and the errors that are the user's to fix.

Exit codes of every command: 0 done, 1 failed, 2 user error (the message says what to change; no
traceback unless --debug or DFLASH_DEBUG=1), 3 stopped before done (`train`: a stop request or signal
checkpointed the run; continue it with --resume), 130 interrupted (Ctrl-C outside a training loop).
"""

from __future__ import annotations

import os

EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_STOPPED = 3


class UserError(ValueError):
    """A mistake in what the user asked for: one line, exit code 2."""


class ConfigError(UserError):
    """A config that cannot run; the message names the key and what to do. Raised by config/ and by
    model code that finds a config value its model cannot honour."""


class ModelError(UserError):
    """A model folder, checkpoint or exported drafter that cannot be used as asked (a missing or mismatched
    tensor, an unreadable config.json); raised by target/ and architectures/io.py, the message names the file and what
    to do."""


class ResourceError(UserError):
    """A machine without room for the run as configured (device memory, host memory): the message gives the
    numbers and what to change (a smaller batch or drafter, fewer processes on the device)."""


class DamagedFileError(UserError):
    """A file that is cut short or corrupt (truncated, bad compression, a bad header, empty): one line naming
    the file, where reading stopped (rows and bytes read, when known) and what to do. Raised by every reader
    of user files instead of the reader's own exception, so damage is never taken for a bad row."""

    def __init__(self, path, problem: str, remedy: str, *, rows_read: int | None = None,
                 bytes_read: int | None = None, size: int | None = None):
        self.path, self.problem, self.remedy = str(path), problem, remedy
        self.rows_read, self.bytes_read, self.size = rows_read, bytes_read, size
        super().__init__(self.path, problem)

    def where(self) -> str:
        """` after row 26 (read 1.1 of 2.3 MB)`: as much as is known."""
        if self.size == 0:
            return ""
        rows = f" after row {self.rows_read}" if self.rows_read else " at its start" if self.rows_read == 0 else ""
        return rows + (f" (read {format_share(self.bytes_read, self.size)})" if self.bytes_read is not None
                       and self.size else "")

    def __str__(self) -> str:
        return f"{self.path} is damaged ({self.problem}){self.where()}: {self.remedy}"


def format_share(part: int, whole: int) -> str:
    """`1.1 of 2.3 MB`, `512 of 2,048 bytes`: both in the unit of the whole."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if whole >= scale:
            return f"{part / scale:.1f} of {whole / scale:.1f} {unit}"
    return f"{part:,} of {whole:,} bytes"


# ValueError and FileNotFoundError raised by our own checks name the bad input and what to do; the
# CLI prints them as one line. Anything else is a failure and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError)


def is_user_error(e: BaseException) -> bool:
    return isinstance(e, USER_ERRORS)


def debug_enabled() -> bool:
    """DFLASH_DEBUG=1 (or the CLI's --debug, which sets it for child processes too): show tracebacks."""
    return os.environ.get("DFLASH_DEBUG", "").lower() in ("1", "true", "yes")
