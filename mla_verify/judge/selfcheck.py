"""The reference checked against its independent unabsorbed form, on a few problems, before anything else.

``mla-verify check`` runs this first on every machine: every verdict is judged against the reference, so a
reference broken by a PyTorch upgrade (or an edit) must show up as such, not as failures of every kernel.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..core.dims import R1_SOFTMAX_SCALE
from ..problems.generate import ProblemSpec, build_problem
from ..problems.problem import DecodeProblem
from ..problems.reference import reference_decode, unabsorbed_decode

F64 = torch.float64
# Both forms are float64 and differ only in summation order (~1e-15); a real mistake moves them by > 1e-3.
TOLERANCE = 1e-10
SPECS = (  # both dim presets, page sizes 1/16/64, q_len 1-3, lengths at page edges, the R1 YaRN scale
    ProblemSpec(seq_lens=(1, 15, 16, 17), num_heads=3, page_size=16, extra_pages=1, table_pad=1, dtype="fp64"),
    ProblemSpec(seq_lens=(3, 64, 65), q_len=3, num_heads=2, page_size=64, kv_lora_rank=256, dtype="fp64",
                softmax_scale=R1_SOFTMAX_SCALE),
    ProblemSpec(seq_lens=(2, 9), q_len=2, num_heads=4, page_size=1, dtype="fp64", values="outliers"),
)


@dataclass
class SelfCheck:
    worst: float  # the worst relative L2 error over output rows
    problems: int

    @property
    def ok(self) -> bool:
        return self.worst < TOLERANCE

    def describe(self) -> str:
        verdict = "ok" if self.ok else f"FAILED (above {TOLERANCE:g}: the reference itself is wrong)"
        return (f"{verdict} ({self.problems} problems against the unabsorbed MHA form, "
                f"worst relative error {self.worst:.2g})")


def absorbed_problem(spec: ProblemSpec, device: torch.device | str = "cpu"
                     ) -> tuple[DecodeProblem, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float64 problem whose query latent is q_nope @ W_UK, with random W_UK [H, nope, L], W_UV [H, L, v]."""
    p = build_problem(spec, device)
    L, nope, H = spec.kv_lora_rank, spec.qk_nope_head_dim, spec.num_heads
    gen = torch.Generator(device=p.device).manual_seed(spec.seed + 1)
    # 1/sqrt(fan-in) keeps q_latent and the expanded keys unit-scale, so the softmax is neither flat nor one-hot
    w_uk = torch.randn(H, nope, L, generator=gen, dtype=F64, device=p.device) / math.sqrt(nope)
    w_uv = torch.randn(H, L, p.dims.v_head_dim, generator=gen, dtype=F64, device=p.device) / math.sqrt(L)
    q_nope = torch.randn(p.batch, p.q_len, H, nope, generator=gen, dtype=F64, device=p.device)
    q_latent = torch.einsum("bqhd,hdl->bqhl", q_nope, w_uk)
    query = torch.cat([q_latent, p.query[..., L:].to(F64)], dim=-1)
    return dataclasses.replace(p, query=query).validate(), q_nope, w_uk, w_uv


def unabsorbed_error(problem: DecodeProblem, q_nope: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, *,
                     reference_problem: DecodeProblem | None = None) -> float:
    """Worst row relative error of W_UV(reference output) against the unabsorbed form of ``problem``.

    ``reference_problem`` (default ``problem``) is what the reference is run on: a test hands it a subtly
    wrong copy to show this check rejects it.
    """
    ref = reference_decode(problem if reference_problem is None else reference_problem)
    projected = torch.einsum("bqhl,hlv->bqhv", ref.out, w_uv)
    want = unabsorbed_decode(problem, q_nope, w_uk, w_uv)
    return float(((projected - want).norm(dim=-1) / want.norm(dim=-1)).max())


def reference_selfcheck(device: torch.device | str = "cpu", seed: int = 0) -> SelfCheck:
    worst = max(unabsorbed_error(*absorbed_problem(dataclasses.replace(s, seed=seed + i), device))
                for i, s in enumerate(SPECS))
    return SelfCheck(worst, len(SPECS))
