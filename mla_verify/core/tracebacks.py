"""Where a user's code raised: the deepest frame in the user's own files, not in the suite's adapter.

A kernel's exception travels through the suite (harness, backend adapter) into the kernel and on into
libraries (torch, triton). The line worth showing is the kernel's own: the deepest frame in a file that is
neither the suite's (the ``mla_verify`` package; its mutants count as user kernels) nor an installed
library's or the standard library's. When no frame qualifies (a kernel from an installed package), the
deepest frame outside the suite; failing that, the deepest frame.
"""
from __future__ import annotations

import os
import sysconfig
import traceback
from types import TracebackType

_SUITE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package, above this room
_USER_KERNELS_IN_SUITE = (os.path.join(_SUITE_DIR, "kernels", "mutants.py"),)  # the suite's own faulty kernels
_LIBRARY_DIRS = tuple(sorted({os.path.abspath(sysconfig.get_paths()[k])
                              for k in ("stdlib", "platstdlib", "purelib", "platlib")}))


def _in_suite_dir(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_SUITE_DIR + os.sep)


def _is_suite(filename: str) -> bool:
    return _in_suite_dir(filename) and os.path.abspath(filename) not in _USER_KERNELS_IN_SUITE


def _is_library(filename: str) -> bool:
    """The standard library's or an installed package's (the suite itself is judged by ``_is_suite``)."""
    path = os.path.abspath(filename)
    return filename.startswith("<") or (not _in_suite_dir(filename)
                                        and any(path.startswith(d + os.sep) for d in _LIBRARY_DIRS))


def user_frame(tb: TracebackType | None) -> traceback.FrameSummary | None:
    """The frame to blame (module docstring); None without a traceback."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    for wanted in (lambda f: not _is_suite(f.filename) and not _is_library(f.filename),
                   lambda f: not _is_suite(f.filename), lambda f: True):
        chosen = [f for f in frames if wanted(f)]
        if chosen:
            return chosen[-1]
    return None


def exception_line(exc: BaseException, located: bool = True) -> str:
    """``Type: first line of the message at file.py:LINE in function`` (without the place unless ``located``)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(exc, SyntaxError) and exc.filename and not exc.filename.startswith("<"):
        # the error lies in the file being compiled, not in a frame: its traceback ends in importlib
        where = f" at {exc.filename}:{exc.lineno}" if located else ""
        return f"{type(exc).__name__}: {exc.msg}{where}"
    frame = user_frame(exc.__traceback__) if located else None
    where = f" at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}" if frame else ""
    return f"{type(exc).__name__}{': ' + first if first else ''}{where}"
