"""The suite as GPU runners use it: `pytest -n auto [--mla-backend NAME ...] [--mla-kernel MODULE:ATTR]
[--mla-profile premerge|fuzz|dev] [--mla-seed N] [--mla-hypothesis-db DIR|redis://...]`.

One test per registered backend (and one for --mla-kernel), each run by the engine on this xdist worker's
device with the chosen profile. With no backend or kernel named, every backend that can run on the worker's
device is verified (on a CPU-only machine: the CPU peer); the others skip with their reason.
"""
import pytest

from mla_verify.backends import all_backends
from mla_verify.backends.user_kernel import load_kernel
from mla_verify.engine import verify
from mla_verify.hypothesis_db import resolve_database


def _verify(backend, options, device):
    result = verify(backend, device, options.profile, seed=options.seed,
                    database=resolve_database(options.hypothesis_db))
    if result.unavailable:
        pytest.skip(result.unavailable)
    if result.failure is not None:
        f = result.failure
        pytest.fail(f"{f.describe()}\n" + "\n".join(f.failures + [f"diagnosis: {d}" for d in f.diagnosis]),
                    pytrace=False)
    assert result.cases, "no case was run"


@pytest.mark.parametrize("name", sorted(all_backends()))
def test_backend(name, mla_options, mla_device):
    chosen = mla_options.backends
    if chosen and name not in chosen:
        pytest.skip(f"{name} not selected (--mla-backend {' '.join(chosen)})")
    if not chosen and mla_options.kernel:
        pytest.skip("only --mla-kernel selected")
    _verify(all_backends()[name], mla_options, mla_device)


def test_kernel(mla_options, mla_device):
    if not mla_options.kernel:
        pytest.skip("no --mla-kernel given")
    _verify(load_kernel(mla_options.kernel), mla_options, mla_device)
