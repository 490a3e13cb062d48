"""What sgl-flash-mla's dense fp8 decode computes (issue #38): raw inputs and outputs, for analysis on a CPU.

Probe sets, each one call of ``flash_mla_with_kvcache(..., is_fp8_kvcache=True, use_legacy=True)`` on inputs
that isolate one step of the kernel's arithmetic (sgl FlashMLA ``csrc/extension/sm90/dense_fp8``):

  onekey_unit   every request has one key, softmax_scale = descale_q = descale_k = 1: the LSE is q.k itself and
                the output is the key's first 512 values, so any error is the QK product's (or V's)
  onekey_scaled the same keys with softmax_scale 1/sqrt(576), descale_q 0.37, descale_k 1.3 (not powers of two)
  uniform       near-identical keys (the suite's "constant" values: one row plus 1% noise), the lengths where
                the fuzz failed: every probability near 1, where e4m3 is coarsest
  normal        unit-normal values, lengths 1..4096

Each set is saved as ``fp8_<set>.safetensors``: q and k_cache as uint8 (their e4m3 bits), block_table,
cache_seqlens, the scales, out, lse, and the schedule the kernel ran with (tile_scheduler_metadata, num_splits).
The record of 2026-12-06 03:48 (results:h200/2026-12-06/gpu-probe/) drew 512 one-key requests, so its uniform and
normal inputs come from ``--onekey-requests 512``; its one-key sets were too large to come back from the device.

    python3 benchmarks/flashmla_fp8_probe.py --out $OUT
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
PAGE, D, DV = 64, 576, 512
SETS = ("onekey_unit", "onekey_scaled", "uniform", "normal")


def make(lens: list[int], heads: int, values: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    pages = [math.ceil(n / PAGE) for n in lens]
    total = sum(pages)
    order = torch.randperm(total, generator=gen)
    table = torch.full((len(lens), max(pages)), 0, dtype=torch.int32)
    k = torch.zeros(total, PAGE, 1, D)
    at = 0
    for b, p in enumerate(pages):
        ids = order[at:at + p]
        at += p
        table[b, :p] = ids.to(torch.int32)
        rows = torch.randn(p * PAGE, D, generator=gen)
        if values == "uniform":
            rows = rows[:1].expand_as(rows) + 1e-2 * rows
        k[ids] = rows.view(p, PAGE, 1, D)
    q = torch.randn(len(lens), 1, heads, D, generator=gen)
    return {"q": q.clamp(-448, 448).to(FP8), "k_cache": k.clamp(-448, 448).to(FP8), "block_table": table,
            "cache_seqlens": torch.tensor(lens, dtype=torch.int32)}


def run(inputs: dict[str, torch.Tensor], softmax_scale: float, descale_q: float, descale_k: float) -> dict:
    import flash_mla

    dev = {k: v.cuda() for k, v in inputs.items()}
    heads = dev["q"].shape[2]
    meta, _ = flash_mla.get_mla_metadata()
    meta.tile_scheduler_metadata, meta.num_splits = flash_mla.get_mla_decoding_metadata(
        dev["cache_seqlens"], heads, 1, is_fp8_kvcache=True, use_legacy=True)
    scales = {"descale_q": torch.tensor([descale_q]), "descale_k": torch.tensor([descale_k]),
              "softmax_scale": torch.tensor([softmax_scale])}
    out, lse = flash_mla.flash_mla_with_kvcache(
        dev["q"], dev["k_cache"], dev["block_table"], dev["cache_seqlens"], DV, meta, None,
        softmax_scale=softmax_scale, causal=True, is_fp8_kvcache=True, use_legacy=True,
        descale_q=scales["descale_q"].cuda(), descale_k=scales["descale_k"].cuda())
    torch.cuda.synchronize()
    return {**{k: v.view(torch.uint8) if v.dtype == FP8 else v for k, v in inputs.items()}, **scales,
            "out": out.cpu(), "lse": lse.cpu(), "tile_scheduler_metadata": meta.tile_scheduler_metadata.cpu(),
            "num_splits": meta.num_splits.cpu()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    parser.add_argument("--onekey-requests", type=int, default=192,
                        help="one 64-row fp8 page each: 192 keep a set's file under the 16 MiB a device call returns")
    ns = parser.parse_args()
    gen = torch.Generator().manual_seed(38)
    model_scale = 1 / math.sqrt(D)
    # drawn in this order whatever --sets says, so that a set's inputs are the same in every call
    onekey = make([1] * ns.onekey_requests, 16, "normal", gen)
    uniform = make([1, 2, 63, 64, 65, 128, 513, 513, 1000, 2048, 4097], 16, "uniform", gen)
    normal = make([int(x) for x in torch.randint(1, 4097, (12,), generator=gen)], 16, "normal", gen)
    calls = {"onekey_unit": (onekey, 1.0, 1.0, 1.0), "onekey_scaled": (onekey, model_scale, 0.37, 1.3),
             "uniform": (uniform, model_scale, 1.0, 1.0), "normal": (normal, model_scale, 1.0, 1.0)}
    sets = {name: run(*calls[name]) for name in ns.sets}
    for name, tensors in sets.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(ns.out / f"fp8_{name}.safetensors"))
        print(name, {k: tuple(v.shape) for k, v in tensors.items()}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
