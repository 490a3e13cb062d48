"""Shadow mode: the MLA decode calls an inference engine really makes, checked at the call (docs/shadow.md).

``session`` holds the session and its public API, re-exported here (``mla_verify.shadow.shadow()``); beside it
the contract checks made before a call, the library entry points it wraps, the reading of a call as a problem,
the judging of a call, the reproducers it keeps, and its tally.

May import: core, problems, backends, judge, kinds, run, records. (tests/test_imports.py holds this rule.)
"""
from .session import (
    ShadowError,
    ShadowSession,
    current_session,
    parse_mode,
    session_from_env,
    session_from_settings,
    shadow,
)

__all__ = ["ShadowError", "ShadowSession", "current_session", "parse_mode", "session_from_env",
           "session_from_settings", "shadow"]
