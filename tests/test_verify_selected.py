"""The suite as GPU runners use it: `pytest -n auto [--mla-backend NAME ...] [--mla-profile premerge|fuzz|dev]
[--mla-seed N] [--mla-hypothesis-db DIR|redis://...] [--mla-shards N]`.

One test per registered backend and shard, each run by the engine on this xdist worker's device with the
chosen profile. With no backend named, every backend that can run on the worker's device is verified (on a
CPU-only machine: the CPU peer); the others skip with their reason. `--mla-kernel` adds its own tests (the
plugin's), and then only those run from here.
"""
import pytest

from mla_verify.backends import all_backends
from mla_verify.pytest_helpers import verify_backend


@pytest.mark.parametrize("name", sorted(all_backends()))
def test_backend(name, mla_options, mla_device, mla_shard):
    chosen = mla_options.backends
    if chosen and name not in chosen:
        pytest.skip(f"{name} not selected (--mla-backend {' '.join(chosen)})")
    if not chosen and mla_options.kernel:
        pytest.skip("only --mla-kernel selected")
    verify_backend(all_backends()[name], **mla_options.verify_options(mla_device, mla_shard))
