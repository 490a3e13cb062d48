"""Each per-case harness check fires on a kernel tailored to trip it, and stays quiet on a correct one."""
from dataclasses import replace

import pytest
import torch

from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.kernels.mutants import MUTANTS, correct_kernel
from mla_verify.problems.generate import ProblemSpec
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.metamorphic import TRANSFORMS
from mla_verify.run.harness import run_case

SPEC = ProblemSpec((37, 64, 100), q_len=2, num_heads=4, page_size=32, seed=7)
LAYOUT = LayoutSpec(cache_dims=4, page_stride_pad=3, table_width="pad128", return_lse=True)


def backend(fn) -> TrtllmStyleBackend:
    return TrtllmStyleBackend(getattr(fn, "__name__", "kernel"), fn)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_correct_kernel_passes_every_check(transform):
    result = run_case(backend(correct_kernel), SPEC, LAYOUT, "cpu", transform)
    assert result.verdict == "pass", result.failures
    assert result.stats.error_ratio < 1


@pytest.mark.parametrize("mutant, transform, spec_change, needle", [
    ("unwritten_aligned_rows", "none", {}, "inf (out was poisoned with +inf: unwritten elements)"),
    ("cache_written", "none", {}, "modified its input 'kv_pool'"),
    ("nan_leak_unmasked_tail", "none", {}, "NaN (read from the NaN-filled unused cache slots"),
    ("nondeterministic", "none", {}, "not bit-identical with a second identical call"),
    # pages laid out in ascending order: the kernel is right on the original problem and only the
    # permuted-pages run exposes it
    ("pages_sorted", "pages", {"shuffle_pages": False, "seq_lens": (128, 96), "q_len": 4},
     "not bit-identical with physical pages permuted"),
    ("out_ignored", "none", {}, "returned a tensor other than the `out` buffer"),
    ("lse_natural_log", "none", {}, "LSE (base 2) off"),
])
def test_check_fires(mutant, transform, spec_change, needle):
    result = run_case(backend(MUTANTS[mutant].fn), replace(SPEC, **spec_change), LAYOUT, "cpu", transform)
    assert result.verdict == "fail"
    assert any(needle in f for f in result.failures), result.failures


def test_unwritten_output_is_caught_when_kernel_allocates():
    """With no `out` passed, memory recycled from a previous result must not pass for written output."""
    layout = replace(LAYOUT, pass_out=False)
    result = run_case(backend(MUTANTS["unwritten_aligned_rows"].fn), SPEC, layout, "cpu")
    assert result.verdict == "fail"


def test_raising_inside_envelope_is_a_failure():
    def raises(*args, **kwargs):
        raise RuntimeError("unsupported page size")
    result = run_case(backend(raises), SPEC, LAYOUT, "cpu")
    assert result.verdict == "fail" and "kernel raised RuntimeError: unsupported page size" in result.reason


def test_outside_envelope_is_skipped_before_the_kernel_runs():
    called = []

    def kernel(*args, **kwargs):
        called.append(1)
    result = run_case(backend(kernel), replace(SPEC, page_size=16), LAYOUT, "cpu")
    assert result.verdict == "skip" and "page size 16" in result.reason and not called


def test_wrong_result_is_located():
    result = run_case(backend(MUTANTS["heads_reversed"].fn), SPEC, LAYOUT, "cpu")
    assert result.verdict == "fail"
    assert "at batch" in result.failures[0] and "head" in result.failures[0]
    b, t, h, d = result.stats.worst
    assert 0 <= b < SPEC.batch and 0 <= t < SPEC.q_len and 0 <= h < SPEC.num_heads and 0 <= d < 512


def test_case_id_is_stable_and_sensitive():
    a = run_case(backend(correct_kernel), SPEC, LAYOUT, "cpu")
    b = run_case(backend(correct_kernel), SPEC, LAYOUT, "cpu")
    c = run_case(backend(correct_kernel), replace(SPEC, seed=8), LAYOUT, "cpu")
    assert a.id == b.id != c.id


def test_kernel_returning_wrong_shape_fails_cleanly():
    def half(query, kv_cache, ws, nope, L, R, bt, sl, msl, out=None, return_lse=False, **kw):
        return torch.zeros(query.shape[:-1] + (L // 2,), dtype=torch.bfloat16)
    result = run_case(backend(half), SPEC, replace(LAYOUT, pass_out=False, return_lse=False), "cpu")
    assert result.verdict == "fail" and "shape" in result.reason


def test_running_out_of_device_memory_is_a_skip_not_a_verdict():
    """A shared GPU can be full for reasons that are not the kernel's; the case says so and is not judged."""
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.45 GiB")
    result = run_case(backend(oom), SPEC, LAYOUT, "cpu")
    assert result.verdict == "skip" and "out of device memory" in result.reason and not result.failures
