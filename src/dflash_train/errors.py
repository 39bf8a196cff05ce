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
    """A config that cannot run; the message names the key and what to do. Raised by config.py and by
    model code that finds a config value its model cannot honour."""


class ModelError(UserError):
    """A model folder, checkpoint or exported drafter that cannot be used as asked (a missing or mismatched
    tensor, an unreadable config.json); raised by model/, the message names the file and what to do."""


# ValueError and FileNotFoundError raised by our own checks name the bad input and what to do; the
# CLI prints them as one line. Anything else is a failure and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError)


def is_user_error(e: BaseException) -> bool:
    return isinstance(e, USER_ERRORS)


def debug_enabled() -> bool:
    """DFLASH_DEBUG=1 (or the CLI's --debug, which sets it for child processes too): show tracebacks."""
    return os.environ.get("DFLASH_DEBUG", "").lower() in ("1", "true", "yes")
