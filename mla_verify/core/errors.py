"""The suite's own error types: every message is one line that names what is wrong."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class MLAVerifyError(Exception):
    """Base class: anything the suite reports to a user as a clear one-line error."""


class ProblemError(MLAVerifyError, ValueError):
    """A decode problem is malformed; the message names the offending field."""


class UsageError(MLAVerifyError):
    """Bad command-line usage or configuration (the CLI maps it to exit code 2)."""


class FixtureError(MLAVerifyError):
    """A fixture is missing, unreadable, tampered with or not in our format."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` naming the closest of ``choices`` to a misspelt ``word``; empty when none is."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
