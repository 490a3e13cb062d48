"""Contract-1 kernels that are correct but slow, hung or interrupted, for the time-bound tests. Importable as
``slow_kernels:NAME`` with tests/ on PYTHONPATH."""
from __future__ import annotations

import os
import signal
import time
from typing import Any

from cli_kernels import SMALL_ENVELOPE  # small problems: the time goes to the kernel's sleep, not to judging

from mla_verify.backends.cpu_peer import cpu_peer_decode

SLOW_CALL_S = 0.4  # each call of `slow`: a case makes two or three calls, so ~1 s a case


def slow(*args: Any, **kwargs: Any) -> Any:
    """Correct, and sleeps before answering."""
    time.sleep(SLOW_CALL_S)
    return cpu_peer_decode(*args, **kwargs)


def hangs(*args: Any, **kwargs: Any) -> Any:
    """Never returns (in Python: the watchdog's signal interrupts it)."""
    time.sleep(3600)
    return cpu_peer_decode(*args, **kwargs)


def hangs_in_native_code(*args: Any, **kwargs: Any) -> Any:
    """Never returns and cannot be interrupted: the watchdog's signal is blocked, as in a call that never
    returns to the interpreter."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(3600)
    return cpu_peer_decode(*args, **kwargs)


def interrupted_after_calls(*args: Any, **kwargs: Any) -> Any:
    """Correct for the first CALLS_BEFORE_CTRL_C calls, then the user presses Ctrl-C."""
    interrupted_after_calls.calls += 1  # type: ignore[attr-defined]
    if interrupted_after_calls.calls > int(os.environ.get("CALLS_BEFORE_CTRL_C", "6")):  # type: ignore[attr-defined]
        raise KeyboardInterrupt
    return cpu_peer_decode(*args, **kwargs)


interrupted_after_calls.calls = 0  # type: ignore[attr-defined]
for kernel in (slow, hangs, hangs_in_native_code, interrupted_after_calls):
    kernel.mla_verify_envelope = SMALL_ENVELOPE  # type: ignore[attr-defined]
