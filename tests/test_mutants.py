"""Every mutant is caught on its trigger problem; the correct kernel passes the very same cases.

``catches`` is the one place that decides "caught": today one harness case per mutant (its trigger problem),
later the premerge kill matrix (point ``catches`` at the premerge engine; the tests below stay as they are).
"""
from __future__ import annotations

import importlib

import pytest

from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.kernels.mutants import MUTANTS, Faults, FaultyKernel, correct_kernel
from mla_verify.problems.generate import ProblemSpec
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.run.harness import run_case

# The bug classes the suite promises at least one mutant for (docs/mutants.md).
REQUIRED_CLASSES = {"softmax scale", "layout", "length", "page size", "causal mask", "LSE", "out buffer",
                    "input mutation", "split-KV", "softmax sentinel", "page offsets"}
CORRECT_LAYOUTS = [LayoutSpec(), LayoutSpec(cache_dims=4, page_stride_pad=8, table_width="pad128", pass_out=False)]


def catches(fn: FaultyKernel, spec: ProblemSpec, layout: LayoutSpec = LayoutSpec(), transform: str = "none") -> bool:
    """True when the suite fails ``fn`` on (spec, layout), checking the metamorphic relation ``transform``."""
    result = run_case(TrtllmStyleBackend(getattr(fn, "__name__", "kernel"), fn), spec, layout, "cpu", transform,
                      diagnose=False)
    assert result.verdict != "skip", result.reason  # a trigger outside the envelope would prove nothing
    return result.verdict == "fail"


@pytest.mark.parametrize("name", sorted(n for n, m in MUTANTS.items() if m.device == "cpu"))
def test_mutant_is_caught(name: str) -> None:
    m = MUTANTS[name]
    assert catches(m.fn, m.trigger, m.trigger_layout, m.trigger_transform), f"{name} ({m.description}) survived"


_TRIGGERS = sorted({(m.trigger, m.trigger_layout) for m in MUTANTS.values()}, key=repr)


@pytest.mark.parametrize("spec,layout", _TRIGGERS, ids=[f"{s.case_id()}-{l.cache_dims}d" for s, l in _TRIGGERS])
def test_correct_kernel_passes_every_trigger(spec: ProblemSpec, layout: LayoutSpec) -> None:
    for lay in {layout, *CORRECT_LAYOUTS}:
        assert not catches(correct_kernel, spec, lay), f"false alarm on {spec.describe()} | {lay.describe()}"


def test_correct_kernel_passes_fp8_and_metamorphic_checks() -> None:
    spec = ProblemSpec((200, 5), num_heads=3, page_size=64, q_len=2, dtype="fp8", q_scale=0.5, k_scale=0.25,
                       table_pad=2, extra_pages=3, seed=7)
    for transform in ("pages", "batch", "pool"):
        result = run_case(TrtllmStyleBackend("correct", correct_kernel), spec, CORRECT_LAYOUTS[1], "cpu",
                          transform=transform, diagnose=False)
        assert result.verdict == "pass", result.reason


def test_registry_is_complete_and_importable() -> None:
    assert REQUIRED_CLASSES <= {m.bug_class for m in MUTANTS.values()}
    # what `--kernel mla_verify.kernels.mutants:<name>` does
    module = importlib.import_module("mla_verify.kernels.mutants")
    for name, m in MUTANTS.items():
        assert getattr(module, name) is m.fn and m.fn.faults != Faults(), name
    assert module.correct_kernel.faults == Faults()
    with pytest.raises(AttributeError):
        getattr(module, "no_such_mutant")  # noqa: B009 - the lookup of a missing name is what raises
