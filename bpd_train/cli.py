"""How every command reports a user's mistake: one line on stderr, exit status 2, no traceback.

train.py, distill.py, evaluate.py, export.py (`exits_on_user_error(work)(cfg)` inside the `@hydra.main` function:
a decorator on that function itself would make Hydra look for conf/ beside this file), python -m
bpd_train.translate and python -m bpd_train.training.zero_cpu all go through here, so "what is a user error" and
"what does its message look like" are decided once. BPD_TRACEBACK=1 re-raises instead (to debug a wrong
classification: a bug surfacing as ValueError).
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Callable, NoReturn, TextIO, TypeVar

EXIT_USER_ERROR = 2

# Every error class of ours derives from ValueError (CheckpointError, BundleError, TrainError, DistillError,
# EvalError, CorpusError); the OSErrors name a path the user gave (missing, existing, not writable).
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError,
                                                IsADirectoryError, PermissionError)

F = TypeVar("F", bound=Callable)


def error_line(message: object) -> str:
    # Newlines inside a message (datasets, DeepSpeed) would break "one line": join them.
    return "error: " + " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def report(e: BaseException | str, stream: TextIO | None = None) -> int:
    """Print `e` as the one error line and return the exit status; re-raise when BPD_TRACEBACK is set."""
    if isinstance(e, BaseException) and os.environ.get("BPD_TRACEBACK"):
        raise e
    print(error_line(e), file=stream or sys.stderr, flush=True)
    return EXIT_USER_ERROR


def fail(message: str) -> NoReturn:
    """Stop now with one error line (checks that run before any work starts)."""
    sys.exit(report(message))


def exits_on_user_error(fn: F) -> F:
    """Decorator for a command's main function: a user error becomes one line and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            sys.exit(report(e))

    return wrapper  # type: ignore[return-value]
