"""The baselines in a declared arithmetic (judge/emulation.py) on a CUDA GPU give the CPU's (which
tests/test_precision_emulation.py proves against per-request kernels).

On a GPU the emulation runs inside the reference's fast mode (bf16 operands, cuBLAS fp32 products) and its
tensor-core accumulation model on CUDA tensors; none of that runs in CPU CI. The FlashMLA schedule is taken for
this GPU's SM count on both sides. Marked ``gpu``: skips without a CUDA device.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_verify.backends.flashinfer_wrapper import FA_FP8_ARITHMETIC
from mla_verify.backends.flashmla import FLASHMLA_FP8_ARITHMETIC, flashmla_fp8_splits
from mla_verify.judge.compare import baseline_result
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.problem import DecodeProblem

pytestmark = pytest.mark.gpu

# every length at least q_len (a request's KV length includes its query tokens)
SPECS = [ProblemSpec(seq_lens=tuple(max(q_len, n) for n in (1, 63, 64, 65, 513, 2049)), q_len=q_len, num_heads=heads,
                     dtype="fp8", q_scale=0.5,
                     k_scale=1.7, values=values, seed=heads + q_len)
         for q_len, heads, values in ((1, 16, "constant"), (4, 32, "normal"), (1, 128, "outliers"))]


def _on(p: DecodeProblem, device: torch.device) -> DecodeProblem:
    return dataclasses.replace(p, query=p.query.to(device), kv_cache=p.kv_cache.to(device),
                               block_table=p.block_table.to(device), seq_lens=p.seq_lens.to(device))


@pytest.mark.parametrize("name", ["flashmla-fp8", "fa2-fp8", "fa3-fp8"])
@pytest.mark.parametrize("spec", SPECS, ids=["constant", "causal-q4", "outliers-h128"])
def test_the_cuda_emulation_gives_the_cpus_bits(name: str, spec: ProblemSpec) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    declared = {"flashmla-fp8": dataclasses.replace(
        FLASHMLA_FP8_ARITHMETIC, splits=lambda lens, rows, _: flashmla_fp8_splits(lens, rows, sms)),
        "fa2-fp8": FA_FP8_ARITHMETIC["fa2"], "fa3-fp8": FA_FP8_ARITHMETIC["fa3"]}[name]
    p = build_problem(spec)
    cpu = baseline_result(p, "fp8", declared)
    gpu = baseline_result(_on(p, device), "fp8", declared)
    # the same roundings, fp32 sums in another order: a probability on a rounding boundary may fall the other
    # way, so all but a few elements are bit-identical and none is off by more than 1% of the output's scale
    same = float((gpu.out.cpu() == cpu.out).double().mean())
    assert same > 0.99, f"{same:.4f} of the output bit-identical"
    assert float((gpu.out.cpu().double() - cpu.out.double()).abs().max()) <= 1e-2 * float(cpu.out.abs().max())
    assert torch.allclose(gpu.lse.cpu(), cpu.lse, rtol=1e-6, atol=1e-5)
