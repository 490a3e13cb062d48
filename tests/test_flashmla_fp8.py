"""The flashmla-fp8 adapter on CPU: sgl-flash-mla's dense fp8 decode through its stand-in (flashmla_cpu.WheelStandIn).

1. The exact arguments: fp8 query and ``[blocks, 64, 1, 576]`` fp8 cache views, ``is_fp8_kvcache=True``,
   ``use_legacy=True``, ``descale_q``/``descale_k`` as ``(1,)`` fp32 tensors whose product with ``softmax_scale``
   is the problem's bmm1 and ``descale_k`` its bmm2, and the schedule from ``get_mla_decoding_metadata(...,
   is_fp8_kvcache=True, use_legacy=True)`` on the sched meta before the call.
2. The correct stand-in passes the harness, judged by the suite's fp8 tolerance model (compare.py); a backend
   that drops either descale, and a kernel that ignores descale_k in its output, fail.
3. The fp8 tolerance admits the error the wheel's fp8 kernel was measured with on the H200.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from mla_verify.backends import get_backend
from mla_verify.backends.flashmla import FlashMLABackend
from mla_verify.backends.flashmla_api import FlashMLAApi
from mla_verify.core.dims import R1_SOFTMAX_SCALE
from mla_verify.judge.compare import baseline_result, compare
from mla_verify.kernels.flashmla_cpu import CPU_FP8_ENVELOPE, WheelStandIn, stand_in_backend
from mla_verify.kernels.mutants import MUTANTS, correct_kernel
from mla_verify.kinds.dense import DENSE_KIND
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.problem import FP8
from mla_verify.run.harness import run_case

# per-tensor scales away from 1 (q_scale, k_scale, bmm2_extra, softmax all distinct), so a dropped or
# misplaced descale changes the result by far more than fp8's tolerance
SPEC = ProblemSpec(seq_lens=(5, 130, 64), q_len=1, num_heads=16, page_size=64, dtype="fp8", q_scale=2.0,
                   k_scale=0.5, bmm2_extra=1.5, softmax_scale=0.1, extra_pages=2, table_pad=1, seed=3)
LAYOUT = LayoutSpec(pass_out=False)


class Fp8Recorder(WheelStandIn):
    """The wheel stand-in, recording the schedule call and what the decode call found on its sched meta."""

    def get_mla_decoding_metadata(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.schedule_call = (args, kwargs)
        return super().get_mla_decoding_metadata(*args, **kwargs)

    def flash_mla_with_kvcache(self, *args: Any, use_legacy: bool = False,  # type: ignore[override]
                               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.call = (args, {**kwargs, "use_legacy": use_legacy})
        self.schedule_at_call = args[5].tile_scheduler_metadata
        return super().flash_mla_with_kvcache(*args, use_legacy=use_legacy, **kwargs)


def _backend(stand_in: WheelStandIn) -> FlashMLABackend:
    api = FlashMLAApi(stand_in.get_mla_metadata, stand_in.flash_mla_with_kvcache, stand_in.get_mla_decoding_metadata)
    return FlashMLABackend("flashmla-fp8-under-test", api, CPU_FP8_ENVELOPE, fp8=True)


@pytest.mark.parametrize("spec", [SPEC, replace(SPEC, q_len=4, num_heads=128)], ids=["q1", "q4"])
def test_adapter_passes_exactly_the_wheels_fp8_arguments(spec: ProblemSpec) -> None:
    rec = Fp8Recorder()
    problem = build_problem(spec)
    prepared = _backend(rec).prepare(problem, LAYOUT)
    prepared.invoke()
    (lens, tokens_per_head_k, heads_k), kwargs = rec.schedule_call
    assert lens is problem.seq_lens and (tokens_per_head_k, heads_k) == (spec.q_len * spec.num_heads, 1)
    assert kwargs == {"is_fp8_kvcache": True, "use_legacy": True}
    assert rec.schedule_at_call is not None  # assigned before the first call, which requires it
    (q, k_cache, *_), kw = rec.call
    assert q.dtype == k_cache.dtype == FP8 and k_cache.shape[1:] == (64, 1, 576)
    assert kw["is_fp8_kvcache"] is True and kw["use_legacy"] is True and kw["causal"] is True
    dq, dk = kw["descale_q"], kw["descale_k"]
    assert dq.dtype == dk.dtype == torch.float32 and dq.shape == dk.shape == (1,)
    # scores = softmax_scale * descale_q * descale_k * q.k and O = P.V * descale_k (the wheel's fp8 kernel)
    # rel_tol 1e-6: the descales travel as fp32 tensors (2^-24 relative rounding each), the scales as floats
    assert math.isclose(kw["softmax_scale"] * float(dq) * float(dk), problem.bmm1_scale, rel_tol=1e-6)
    assert math.isclose(float(dk), problem.bmm2_scale, rel_tol=1e-6) and prepared.output_scale == 1.0


@pytest.mark.parametrize("spec,transform", [
    (SPEC, "batch"),
    (replace(SPEC, q_len=4, num_heads=128, seq_lens=(4, 67, 200)), "pages"),
    (replace(SPEC, num_heads=3, seq_lens=(1, 1000), values="outliers", q_scale=0.05, k_scale=4.0), "table"),
])
def test_the_correct_fp8_stand_in_passes(spec: ProblemSpec, transform: str) -> None:
    result = run_case(stand_in_backend(envelope=CPU_FP8_ENVELOPE), spec, LAYOUT, "cpu", transform=transform)
    assert result.verdict == "pass", result.failures


@pytest.mark.parametrize("dropped", ["descale_q", "descale_k"])
def test_a_dropped_descale_fails(dropped: str) -> None:
    stand_in = WheelStandIn()

    def drops(*args: Any, use_legacy: bool = False, **kwargs: Any) -> Any:  # the wheel's signature
        return stand_in.flash_mla_with_kvcache(*args, use_legacy=use_legacy, **{**kwargs, dropped: torch.ones(1)})
    backend = _backend(stand_in)
    backend.api = FlashMLAApi(stand_in.get_mla_metadata, drops, stand_in.get_mla_decoding_metadata)
    result = run_case(backend, SPEC, LAYOUT, "cpu", diagnose=False)
    assert result.verdict == "fail" and "> allowed" in result.reason, result.failures


@pytest.mark.parametrize("name", ["bmm2_ignored", "scale_fixed_192", "halves_swapped"])
def test_fp8_scale_and_layout_mutants_fail(name: str) -> None:
    result = run_case(stand_in_backend(MUTANTS[name].fn, CPU_FP8_ENVELOPE), SPEC, LAYOUT, "cpu", diagnose=False)
    assert result.verdict == "fail", name


def test_the_fp8_stand_in_refuses_what_the_wheel_refuses() -> None:
    problem = build_problem(SPEC)
    stand_in = WheelStandIn()
    meta, _ = stand_in.get_mla_metadata()
    args = dict(q=problem.query, k_cache=problem.kv_cache.unsqueeze(2), block_table=problem.block_table,
                cache_seqlens=problem.seq_lens, head_dim_v=512, tile_scheduler_metadata=meta, is_fp8_kvcache=True,
                use_legacy=True, descale_q=torch.ones(1), descale_k=torch.ones(1))
    with pytest.raises(AssertionError, match="get_mla_decoding_metadata"):
        stand_in.flash_mla_with_kvcache(**args)
    meta.tile_scheduler_metadata, meta.num_splits = stand_in.get_mla_decoding_metadata(
        problem.seq_lens, 16, 1, is_fp8_kvcache=True, use_legacy=True)
    stand_in.flash_mla_with_kvcache(**args)  # the valid call runs
    for change, words in [(dict(descale_q=torch.ones(2)), "must have shape"),
                          (dict(descale_k=None), "descale is required"),
                          (dict(q=problem.query.to(torch.bfloat16)), "float8_e4m3fn")]:
        with pytest.raises(RuntimeError, match=words):
            stand_in.flash_mla_with_kvcache(**{**args, **change})
    with pytest.raises(AssertionError, match="legacy side"):
        stand_in.get_mla_decoding_metadata(problem.seq_lens, 16, 1, is_fp8_kvcache=True)


def test_the_fp8_envelope_is_the_wheels() -> None:
    env = get_backend("flashmla-fp8").envelope
    # fwd_kvcache_mla_fp8: "Only head_size_k == 576 is supported", "page_block_size must be 64", fp8 e4m3 q
    assert env.dims == ((512, 64),) and env.dtypes == ("fp8",) and env.page_sizes == (64,)
    assert env.archs == ((9, 0),) and env.pass_out == (False,) and env.lse_base == math.e


# measured on the H200 (2026-12-04, docs/backends.md): the wheel's dense fp8 against the fp64 reference over the
# dequantized q and k -- relative L2 1.09e-2, LSE off by 6e-4. Numbers from the GPU, not from compare.py.
MEASURED_FP8_REL_L2, MEASURED_FP8_LSE = 1.09e-2, 6e-4


@pytest.mark.parametrize("heads,values", [(16, "normal"), (16, "outliers"), (128, "normal")])
def test_the_fp8_tolerance_admits_what_flashmla_fp8_measured(heads: int, values: str) -> None:
    """FlashMLA's fp8 kernel multiplies fp8 probabilities by the fp8 cache, as the fp8 baseline does; its error on
    the GPU must sit inside the allowance on problems shaped as the GPU grid's (tests/gpu/test_flashmla_gpu.py)."""
    spec = ProblemSpec(seq_lens=(1, 63, 64, 65, 140, 4096), num_heads=heads, page_size=64, dtype="fp8",
                       q_scale=2.0, k_scale=0.375, softmax_scale=R1_SOFTMAX_SCALE, values=values, seed=heads)
    problem = build_problem(spec)
    ref = DENSE_KIND.reference(problem)
    stats, failures = compare(ref.out.to(torch.bfloat16), ref.lse, ref, baseline_result(problem, "fp8"), "fp8",
                              math.e)
    assert stats is not None, failures  # the reference against itself in bf16: only the allowance is read here
    assert stats.allowed_rel_l2 > MEASURED_FP8_REL_L2 and stats.allowed_lse_abs > MEASURED_FP8_LSE


def test_the_wheel_only_paths_refuse_upstreams_interface_in_one_line() -> None:
    """fp8 and sparse decode exist on SM90 in sgl-flash-mla only: against upstream's interface (no use_legacy)
    they are refused with the install route, not run into a TypeError on every case."""
    from mla_verify.backends.flashmla_sparse import FlashMLASparseBackend
    from mla_verify.kernels.flashmla_cpu import CPU_SPARSE_ENVELOPE

    def upstream_decode(*args: Any, **kwargs: Any) -> Any:  # no use_legacy, no kv_format
        raise AssertionError("a refused backend must not be called")

    upstream = FlashMLAApi(WheelStandIn(correct_kernel).get_mla_metadata, upstream_decode)
    cpu = torch.device("cpu")
    fp8 = FlashMLABackend("flashmla-fp8", upstream, CPU_FP8_ENVELOPE, fp8=True)
    sparse = FlashMLASparseBackend("flashmla-sparse", upstream, CPU_SPARSE_ENVELOPE)
    for backend, what in ((fp8, "dense fp8 decode"), (sparse, "sparse decode on SM90")):
        reason = backend.unavailable_reason(cpu)
        assert reason is not None and reason.startswith(f"{what} is sgl-flash-mla's; this interface has none ("), reason
