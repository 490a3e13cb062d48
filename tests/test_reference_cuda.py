"""The reference on a CUDA GPU equals the reference on the CPU (which tests/test_reference.py proves).

The CUDA path differs from the CPU one: cuBLAS products with the scale in their epilogue (``baddbmm`` alpha),
fp32-accumulated bf16 products and split probabilities in the fast mode. None of that runs in CPU CI, so it is
checked here, on the boundary problems of the CPU checks: ragged lengths 1, page-1, page, page+1, q_len 1-4,
page sizes 1-64, both dim presets, fp8 with scales, NaN in every unused cache slot.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from oracles import F64_TOL, row_rel_err  # float64 both sides; cuBLAS only sums in another order
from test_reference import boundary_spec

from mla_verify.core.errors import UsageError
from mla_verify.problems import reference
from mla_verify.problems.generate import build_problem
from mla_verify.problems.problem import DecodeProblem
from mla_verify.problems.reference import reference_decode

pytestmark = pytest.mark.gpu

CASES = [(rank, page, q_len, dtype) for rank, page, q_len, dtype in
         itertools.product((512, 256), (1, 16, 64), (1, 4), ("bf16", "fp8"))]
IDS = [f"L{r}-page{p}-q{q}-{d}" for r, p, q, d in CASES]

# fast mode: exact bf16/fp8 products summed in fp32 (~sqrt(576) * 2^-24 on a score, <1e-6 on a probability
# after exp) and probabilities split into hi + lo bf16 (2^-17 ~ 7.6e-6 relative each, at worst all aligned on
# a row): 3e-5 bounds both with 3x room, and is still ~70x under a bf16 kernel's error (~2e-3)
FAST_ROW_TOL = 3e-5
# fp32 LSE of magnitude m is held to ~m * 2^-24 plus the score error: relative once |lse| > 1
FAST_LSE_TOL = 1e-5


def _on(p: DecodeProblem, device: torch.device) -> DecodeProblem:
    return dataclasses.replace(p, query=p.query.to(device), kv_cache=p.kv_cache.to(device),
                               block_table=p.block_table.to(device), seq_lens=p.seq_lens.to(device))


@pytest.mark.parametrize("rank,page,q_len,dtype", CASES, ids=IDS)
def test_cuda_reference_matches_the_cpu_reference(rank: int, page: int, q_len: int, dtype: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    extra = {"q_scale": 0.25, "k_scale": 3.0} if dtype == "fp8" else {}
    p = build_problem(boundary_spec(rank, page, q_len, dtype=dtype, num_heads=16, values="outliers", **extra))
    cpu = reference_decode(p)
    gpu = _on(p, torch.device("cuda"))
    exact = reference_decode(gpu)
    assert row_rel_err(exact.out.cpu(), cpu.out) < F64_TOL
    assert float((exact.lse.cpu() - cpu.lse).abs().max()) < F64_TOL
    fast = reference_decode(gpu, torch.float32, matmul="bf16-split")
    assert fast.out.dtype == torch.float32
    assert row_rel_err(fast.out.cpu(), cpu.out) < FAST_ROW_TOL
    lse_err = (fast.lse.cpu().double() - cpu.lse).abs() / cpu.lse.abs().clamp(min=1.0)
    assert float(lse_err.max()) < FAST_LSE_TOL


@pytest.mark.parametrize("length_rule", [False, True], ids=["by-memory", "70%-rule"])
def test_cuda_reference_handles_long_ragged_groups(length_rule: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # several groups (a small chunk, or the 70% rule with its floor off), sequences past 16k tokens next to
    # 2-token ones: the tail-only mask and the per-group gather must still give the CPU's answer
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    if length_rule:
        monkeypatch.setattr(reference, "MIN_GROUP_BYTES", 0)
    spec = dataclasses.replace(boundary_spec(512, 64, 2, num_heads=8), seq_lens=(17000, 2, 4097, 64, 65, 9000, 3))
    p = build_problem(spec)
    cpu = reference_decode(p, chunk_bytes=1 << 22)
    gpu = _on(p, torch.device("cuda"))
    for chunk in (None, 1 << 22):
        fast = reference_decode(gpu, torch.float32, chunk_bytes=chunk, matmul="bf16-split")
        assert row_rel_err(fast.out.cpu(), cpu.out) < FAST_ROW_TOL


def test_cuda_float32_exact_mode_and_recycled_nan_memory() -> None:
    # the float32 mode (what GPUs use for fp16/fp32 inputs) holds the documented 1e-5 (docs/reference.md), and
    # the products' beta=0 really ignores their uninitialised buffers: the allocator is first filled with NaN
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    p = build_problem(boundary_spec(512, 16, 4, dtype="fp16", num_heads=16, values="outliers"))
    cpu = reference_decode(p)
    poison = torch.full((1 << 26,), float("nan"), device="cuda")
    del poison  # its NaN-filled block goes back to the caching allocator, to be handed out again
    fast = reference_decode(_on(p, torch.device("cuda")), torch.float32)
    assert bool(torch.isfinite(fast.out).all()) and bool(torch.isfinite(fast.lse).all())
    assert row_rel_err(fast.out.cpu(), cpu.out) < 1e-5


def test_a_forced_tf32_override_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")
    p = _on(build_problem(boundary_spec(512, 16, 1, dtype="fp16")), torch.device("cuda"))
    with pytest.raises(UsageError, match="TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"):
        reference_decode(p, torch.float32)
