"""Which arithmetic does sgl-flash-mla's dense fp8 decode compute? The GPU probe's raw records
(benchmarks/flashmla_fp8_probe.py) against emulations of each hypothesis, on a CPU (issue #38).

For each probe set (fp8_<set>.safetensors: the e4m3 inputs, the scales, the kernel's out and LSE, and the split
schedule it ran with) and each hypothesis, per request: the kernel's distance from the emulation (relative L2 of
out, the share of bit-identical out elements, max |LSE difference|), and the kernel's own error against the exact
answer (fp64) next to the emulation's -- an emulation that is the kernel's arithmetic has the kernel's error, and
the ratio of the two is what a tolerance factor over it must cover. Hypotheses:

  plain fp8 baseline     the suite's baseline before #38: q * bmm1 in bf16, P = exp(s - row max) in e4m3,
                         fp32 row sum (compare.baseline_result with no declaration)
  P normalized in e4m3   softmax first, then P rounded to e4m3 (fp64 otherwise)
  blocks + splits        FlashMLA's 64-key blocks, last first, with the running max; P in e4m3, the fp32 row
                         sum; the split schedule the kernel ran with; fp32 products and sums
  declared               FLASHMLA_FP8_ARITHMETIC (backends/flashmla.py): the above plus Hopper's fp8 WGMMA
                         accumulation model in both products (32 products a step, truncated 13 bits below the
                         largest term)
  k<K> b<B> (--grid)     the accumulation model with other step sizes and widths

One-key sets (seq_len 1, unit scales) also compare the LSE -- there the raw q.k itself -- bit for bit with the
accumulation models. The split schedule port (``flashmla_fp8_splits``) is checked against the recorded one.

    python3 benchmarks/flashmla_fp8_analysis.py --dir DIR --json analysis.json [--grid]

DIR: the folder `benchmarks/flashmla_fp8_probe.py --out` wrote on the GPU (its ``fp8_*.safetensors``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from mla_verify.backends.flashmla import FLASHMLA_FP8_ARITHMETIC, flashmla_fp8_splits, splits_from_metadata
from mla_verify.core.dims import MLADims
from mla_verify.judge.compare import baseline_result
from mla_verify.judge.emulation import accumulate, emulated
from mla_verify.problems.arithmetic import Accumulator
from mla_verify.problems.problem import FP8, DecodeProblem
from mla_verify.problems.reference import reference_decode

L, ROPE = 512, 64


def problem_of(d: dict[str, torch.Tensor]) -> DecodeProblem:
    """The probe's inputs as the suite's problem: bmm1 = softmax_scale * descale_q * descale_k, bmm2 = descale_k
    (backends/flashmla.py splits a problem's scales the same way)."""
    q, k = d["q"].view(FP8), d["k_cache"].view(FP8)[:, :, 0]
    bmm1 = float(d["softmax_scale"]) * float(d["descale_q"]) * float(d["descale_k"])
    return DecodeProblem(q, k, d["block_table"], d["cache_seqlens"], MLADims(L, ROPE, 128, 128, q.shape[2]), bmm1,
                         float(d["descale_k"]))


def normalized_p(p: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp64, P then rounded to e4m3, times V: (out, lse)."""
    exact = reference_decode(p)
    outs = []
    for b in range(p.batch):
        n = int(p.seq_lens[b])
        rows = p.kv_cache[p.block_table[b, :-(-n // p.page_size)].long()].reshape(-1, L + ROPE)[:n].double()
        s = p.query[b, 0].double() @ rows.T * p.bmm1_scale
        outs.append(torch.softmax(s, -1).to(FP8).double() @ rows[:, :L] * p.bmm2_scale)
    return torch.stack(outs)[:, None], exact.lse


def per_request(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Relative L2 of x against y, per request (the first axis)."""
    return (x - y).flatten(1).norm(dim=1) / y.flatten(1).norm(dim=1).clamp_min(1e-300)


def judged(name: str, out: torch.Tensor, lse: torch.Tensor, kernel_out: torch.Tensor, kernel_lse: torch.Tensor,
           exact: Any) -> dict[str, Any]:
    """The kernel against one emulation (``out``, ``lse`` natural log [B, 1, H]), and both against the exact answer."""
    emu, k, ref = out.double(), kernel_out.double(), exact.out.double()
    kernel_err, emu_err = per_request(k, ref), per_request(emu, ref)
    k_abs = (k - ref).abs().flatten(1).amax(1)
    e_abs = (emu - ref).abs().flatten(1).amax(1)
    k_lse = (kernel_lse - exact.lse.double()).abs().flatten(1).amax(1)
    e_lse = (lse.double() - exact.lse.double()).abs().flatten(1).amax(1)
    return {
        "hypothesis": name,
        "kernel_vs_emulation_rel_l2_max": float(per_request(k, emu).max()),
        "kernel_vs_emulation_rel_l2_mean": float(per_request(k, emu).mean()),
        "bit_identical_out": float((k == emu).double().mean()),
        "lse_max_abs_diff": float((kernel_lse - lse.double()).abs().max()),
        "kernel_vs_exact_rel_l2_max": float(kernel_err.max()),
        "emulation_vs_exact_rel_l2_max": float(emu_err.max()),
        # what a tolerance factor over this emulation must cover: the kernel's error over the emulation's
        "ratio_rel_l2_max": float((kernel_err / emu_err.clamp_min(1e-12)).max()),
        "ratio_max_abs_max": float((k_abs / e_abs.clamp_min(1e-12)).max()),
        "ratio_lse_max": float((k_lse / e_lse.clamp_min(1e-12)).max()),
    }


def onekey_bits(p: DecodeProblem, kernel_lse: torch.Tensor, models: dict[str, Accumulator | None]) -> dict[str, Any]:
    """With one key and unit scales the kernel's LSE is its raw fp32 q.k: the share of the LSE values each
    accumulation model reproduces bit for bit (None: exact products, fp32 sum)."""
    rows = p.kv_cache[p.block_table[:, 0].long(), 0].float()  # [B, D]: each request's one key
    q = p.query[:, 0].float()  # [B, H, D]
    found = {}
    for name, model in models.items():
        if model is None:
            s = torch.einsum("bhd,bd->bh", q.double(), rows.double()).float()
        else:
            zero = torch.zeros((q.shape[0], q.shape[1], 1))
            s = accumulate(zero, q, rows[:, :, None], model)[..., 0]
        found[name] = float((s == kernel_lse.float().view(s.shape)).double().mean())
    return found


def analyse(path: Path, grid: bool) -> dict[str, Any]:
    d = load_file(str(path))
    p = problem_of(d)
    splits = splits_from_metadata(d["tile_scheduler_metadata"].tolist(), p.seq_lens.tolist())
    rows = p.q_len * p.num_heads
    kernel_out, kernel_lse = d["out"], d["lse"].transpose(1, 2)  # lse [B, H, 1] -> [B, 1, H]
    exact = reference_decode(p)
    declared = replace(FLASHMLA_FP8_ARITHMETIC, splits=lambda *_: splits)
    hypotheses: dict[str, Any] = {
        "plain fp8 baseline": lambda: baseline_result(p, "fp8"),
        "P normalized in e4m3": lambda: normalized_p(p),
        "blocks + splits": lambda: emulated(p, replace(declared, qk=None, pv=None), FP8),
        "declared": lambda: emulated(p, declared, FP8),
    }
    if grid:
        for k_step in (16, 32, 64):
            for bits in (12, 13, 14):
                model = Accumulator(k_step, bits)
                hypotheses[f"k{k_step} b{bits}"] = lambda m=model: emulated(p, replace(declared, qk=m, pv=m), FP8)
    record: dict[str, Any] = {
        "set": path.stem, "seq_lens": p.seq_lens.tolist(), "heads": p.num_heads, "bmm1": p.bmm1_scale,
        "bmm2": p.bmm2_scale, "splits_per_request": [len(s) for s in splits],
        "schedule_port_matches": flashmla_fp8_splits(p.seq_lens.tolist(), rows, len(d["tile_scheduler_metadata"]))
        == splits, "hypotheses": []}
    for name, run in hypotheses.items():
        started = time.perf_counter()
        result = run()
        out, lse = (result.out, result.lse) if hasattr(result, "out") else result
        entry = judged(name, out, lse, kernel_out, kernel_lse, exact)
        entry["seconds"] = round(time.perf_counter() - started, 2)
        record["hypotheses"].append(entry)
    if set(p.seq_lens.tolist()) == {1} and float(d["softmax_scale"]) == float(d["descale_q"]) == 1.0 == \
            float(d["descale_k"]):
        record["onekey_lse_bits"] = onekey_bits(p, kernel_lse, {
            "exact products, fp32 sum": None, **{f"k{k} b{b}": Accumulator(k, b)
                                                for k in (16, 32, 64) for b in (12, 13, 14)}})
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True,
                        help="the folder flashmla_fp8_probe.py --out wrote (its fp8_*.safetensors)")
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--grid", action="store_true", help="also the accumulation model's step/width grid (slow)")
    ns = parser.parse_args()
    paths = sorted(ns.dir.glob("fp8_*.safetensors"))
    if not paths:
        print(f"no fp8_*.safetensors in {ns.dir}", file=sys.stderr)
        return 2
    records = []
    for path in paths:
        record = analyse(path, ns.grid)
        records.append(record)
        print(f"{record['set']}: seq_lens {record['seq_lens']}, {record['heads']} heads, bmm1 {record['bmm1']:.6g}, "
              f"splits per request {record['splits_per_request']}, schedule port matches: "
              f"{record['schedule_port_matches']}")
        print(f"  {'hypothesis':22s} {'k-vs-emu rel':>12s} {'bit-same':>8s} {'|dLSE|':>9s} {'k err':>9s} "
              f"{'emu err':>9s} {'ratio L2':>8s} {'ratio max':>9s} {'ratio LSE':>9s}")
        for h in record["hypotheses"]:
            print(f"  {h['hypothesis']:22s} {h['kernel_vs_emulation_rel_l2_max']:12.2e} {h['bit_identical_out']:8.4f} "
                  f"{h['lse_max_abs_diff']:9.2e} {h['kernel_vs_exact_rel_l2_max']:9.2e} "
                  f"{h['emulation_vs_exact_rel_l2_max']:9.2e} {h['ratio_rel_l2_max']:8.2f} "
                  f"{h['ratio_max_abs_max']:9.2f} {h['ratio_lse_max']:9.2f}")
        if "onekey_lse_bits" in record:
            print("  one key, unit scales: LSE (= raw q.k) bit-identical to " + ", ".join(
                f"{k} {v:.4f}" for k, v in record["onekey_lse_bits"].items()))
    if ns.json:
        ns.json.write_text(json.dumps({"torch": torch.__version__, "sets": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
