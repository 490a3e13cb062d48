"""Golden fixtures: a few small canonical problems with their float64 reference answers, committed.

They are known-answer tests on any machine: a change to the reference (or to its numerics on a new
PyTorch) that moves an answer shows up against these files. Regenerate only on purpose:

    python -m mla_verify.records.golden [--out fixtures/golden]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..core.dims import R1_SOFTMAX_SCALE
from ..problems.generate import ProblemSpec, build_problem
from ..problems.reference import reference_decode
from .fixtures import save_fixture

# Small on purpose (heads 2-4, sequences <= 200): each file stays a few hundred kB.
GOLDEN: dict[str, ProblemSpec] = {
    "v3-page64-bf16": ProblemSpec(seq_lens=(1, 63, 65), num_heads=4, page_size=64, extra_pages=1, table_pad=1,
                                  seed=101),
    "v3-page16-q3-r1scale": ProblemSpec(seq_lens=(3, 16, 17, 33), q_len=3, num_heads=2, page_size=16,
                                        softmax_scale=R1_SOFTMAX_SCALE, pad_fill="zero", seed=102),
    "mla256-page1": ProblemSpec(seq_lens=(1, 40, 90), num_heads=3, page_size=1, kv_lora_rank=256, seed=103),
    "v3-page64-fp8-scaled": ProblemSpec(seq_lens=(100, 200), num_heads=4, page_size=64, dtype="fp8",
                                        q_scale=0.5, k_scale=1.5, bmm2_extra=0.75, seed=104),
    "mla256-page16-q3-outliers": ProblemSpec(seq_lens=(5, 48, 150), q_len=3, num_heads=4, page_size=16,
                                             kv_lora_rank=256, values="outliers", pad_fill="garbage", seed=105),
}
DEFAULT_DIR = Path("fixtures") / "golden"


def write_golden(directory: Path) -> list[Path]:
    """Build every golden problem on CPU, answer it in float64, save problem + answer."""
    paths = []
    for name, spec in GOLDEN.items():
        problem = build_problem(spec, "cpu")
        ref = reference_decode(problem, precision=torch.float64)
        meta = {"kind": "golden", "name": name, "spec": spec.to_json(), "description": spec.describe()}
        paths.append(save_fixture(directory, name, problem, meta, {"ref_out": ref.out, "ref_lse": ref.lse}))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_verify.records.golden", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="directory (default: %(default)s)")
    for path in write_golden(parser.parse_args(argv).out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
