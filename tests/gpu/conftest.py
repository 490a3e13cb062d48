"""The GPU tests share tests/'s test kernels (crashing_kernels, cli_kernels): tests/ on sys.path, which pytest
puts there itself only when it collected a test of tests/ first (not for `pytest tests/gpu/test_crash_gpu.py`)."""
from __future__ import annotations

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
