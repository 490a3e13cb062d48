"""What ``mla-verify`` and ``mla-verify bench`` share on their command lines: exit codes, a parser whose usage
errors are one line, the argument types (each rejects a bad value with a one-line reason), and the runner that
keeps every exit free of tracebacks.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import torch

from .errors import MLAVerifyError

EXIT_OK, EXIT_DISCREPANCY, EXIT_USAGE = 0, 1, 2  # docs/contracts.md, Contract 2
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
TRACEBACK_ENV = "MLA_VERIFY_TRACEBACK"  # set to 1 to see the traceback of an internal error


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (its own message plus where to look), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _integer(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (seeds)."""
    return _integer(text, 0)


def positive_int(text: str) -> int:
    """An integer >= 1 (counts)."""
    return _integer(text, 1)


def positive_number(text: str, unit: str) -> float:
    """A finite number > 0 of ``unit``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of {unit}, got {text}")
    return value


def positive_minutes(text: str) -> float:
    return positive_number(text, "minutes")


def positive_seconds(text: str) -> float:
    return positive_number(text, "seconds")


def parse_device(text: str) -> torch.device:
    """cpu, cuda or cuda:N -- and it must exist on this machine."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda or cuda:N)") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r} is not supported (cpu, cuda or cuda:N)")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: no CUDA GPU is usable here (torch {torch.__version__}, "
                                         f"CUDA build {torch.version.cuda or 'none'}); use --device cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise argparse.ArgumentTypeError(f"{text}: this machine has {count} GPU(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", device.index or 0)


def one_line(e: BaseException) -> str:
    """An error's message on one line, for stderr."""
    return " ".join(str(e).split())


def run_command(ns: argparse.Namespace) -> int:
    """``ns.func(ns)`` for the command ``ns.command``, so that no exit prints a traceback: an MLAVerifyError is
    one line and exit 2, Ctrl-C exit 130, any other error one line naming where it was raised (exit 2)."""
    try:
        return ns.func(ns)
    except MLAVerifyError as e:
        print(f"mla-verify {ns.command}: error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"mla-verify {ns.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - no exit prints a traceback unless asked to
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        at = f" at {Path(where.filename).name}:{where.lineno}" if where else ""
        print(f"mla-verify {ns.command}: internal error: {type(e).__name__}: {one_line(e)}{at} "
              f"(set {TRACEBACK_ENV}=1 for the traceback, and please report it)", file=sys.stderr)
        return EXIT_USAGE
