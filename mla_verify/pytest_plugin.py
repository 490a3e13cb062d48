"""pytest plugin (loaded through the pytest11 entry point): the suite's options and markers."""
from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU that can run the backend under test")
    config.addinivalue_line("markers", "slow: long-running (fuzz sessions, large problems)")
