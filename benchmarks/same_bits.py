"""Does a candidate reference.py give the same bits as this tree's? Random CPU problems, every mode.

A candidate kept for speed must compute exactly what the reference computes; this draws ``--problems`` small
problems (q_len 1-4, pages 1/16/32/64, both latent ranks, bf16 and fp8, padded tables and spare pages) and calls
both versions in each mode (float64, float32, bf16-split, the bf16 baseline, and two with a 64 KiB chunk, so
several groups). Exit 0: the same bits everywhere; 1: the first difference, printed; 2: a usage error.

    python3 benchmarks/same_bits.py candidate_reference.py --problems 150
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_ab import load_module  # noqa: E402

from mla_verify import reference  # noqa: E402
from mla_verify.cli import positive_int  # noqa: E402
from mla_verify.errors import UsageError  # noqa: E402
from mla_verify.generate import ProblemSpec, build_problem  # noqa: E402

MODES = ({}, {"precision": torch.float32}, {"matmul": "bf16-split"},
         {"p_dtype": torch.bfloat16, "precision": torch.float32},
         {"chunk_bytes": 1 << 16}, {"chunk_bytes": 1 << 16, "matmul": "bf16-split"})


def draw(rng: random.Random, seed: int) -> ProblemSpec:
    q = rng.randint(1, 4)
    lens = tuple(rng.randint(q, rng.choice([q + 3, 70, 300])) for _ in range(rng.randint(1, 12)))
    return ProblemSpec(lens, q_len=q, num_heads=rng.choice([1, 4, 16]), page_size=rng.choice([1, 16, 32, 64]),
                       dtype=rng.choice(["bf16", "fp8"]), kv_lora_rank=rng.choice([512, 256]),
                       extra_pages=rng.randint(0, 2), table_pad=rng.randint(0, 2), seed=seed)


def first_difference(candidate, problems: int, seed: int) -> str | None:
    """None when every call gives the tree's bits, else what differed."""
    rng = random.Random(seed)
    for i in range(problems):
        spec = draw(rng, seed * 100_003 + i)
        p = build_problem(spec)
        for mode in MODES:
            a, b = reference.reference_decode(p, **mode), candidate.reference_decode(p, **mode)
            if not (torch.equal(a.out, b.out) and torch.equal(a.lse, b.lse)):
                return f"problem {i} ({spec}), mode {mode}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path, help="the candidate: a version of mla_verify/reference.py")
    parser.add_argument("--problems", type=positive_int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    ns = parser.parse_args(argv)
    try:
        candidate = load_module(ns.file, "file")
    except UsageError as exc:
        print(f"same_bits: {exc}", file=sys.stderr)
        return 2
    difference = first_difference(candidate, ns.problems, ns.seed)
    if difference:
        print(f"DIFFERENT: {difference}")
        return 1
    print(f"same bits: {ns.problems} problems, {ns.problems * len(MODES)} calls (seed {ns.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
