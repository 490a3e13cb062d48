"""The suite's own error types: every message is one line that names what is wrong."""


class MLAVerifyError(Exception):
    """Base class: anything the suite reports to a user as a clear one-line error."""


class ProblemError(MLAVerifyError, ValueError):
    """A decode problem is malformed; the message names the offending field."""


class UsageError(MLAVerifyError):
    """Bad command-line usage or configuration (the CLI maps it to exit code 2)."""


class FixtureError(MLAVerifyError):
    """A fixture is missing, unreadable, tampered with or not in our format."""
