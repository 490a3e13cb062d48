"""Error statistics, the tolerance model and per-case verdict reasons.

The tolerance model follows FlashAttention's rule: a kernel may be at most ``FACTOR`` times as wrong as a
same-precision PyTorch computation (the *baseline*) against the high-precision reference, plus a floor for
the rounding any bf16 output must make. The baseline is what a plain bf16 PyTorch implementation does --
``(q * scale)`` rounded to bf16 before the product, fp32 scores and softmax, probabilities rounded to the
operand precision before the second product, output rounded to bf16. Both errors are measured on the very
same problem, so the bound adapts to sequence length, head count and value distribution. A backend that
declares its arithmetic (problems/arithmetic.py) is judged against a baseline that makes exactly its roundings
instead (emulation.py); the verdict names that emulation.

Calibration (benchmarks/tolerance_probe.py and fuzz runs, H200, FlashInfer 0.7.2.post1; docs/verified.md):
on 2 x 69 drawn cases fa2/fa3 error / this baseline's error was at most 1.36 (relative L2) and 1.73 (max abs),
against 1.68 and 2.45 for a baseline that keeps the scale out of q; FACTOR below records the fuzz's worst.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from ..problems.arithmetic import DEFAULT, Arithmetic
from ..problems.problem import DecodeProblem
from ..problems.reference import ReferenceResult, fast_matmul_mode, reference_decode
from .emulation import emulated

# FlashAttention's factor is 2x the baseline's error (4x for fp8, as in their fp8 tests). Measured on an H200
# (fa3 fuzz, 2026-12-01, docs/verified.md): FlashInfer fa3 reached 2.36x in relative L2 on heavy-tailed
# inputs whose softmax rows are nearly one-hot (the baseline's error is then unusually small), and <= 1.15x on
# unit-normal ones; so bf16 gets 3x. A real fault (a wrong scale, length or layout) is off by far more.
# fp8 keeps 4x: FlashMLA's dense fp8 (sgl-flash-mla) runs P.V as an fp8 GEMM (it transposes the fp8 V for it,
# csrc/extension/sm90/dense_fp8/fp8_transpose_v.h), so its probabilities are fp8 as the baseline's are and its
# error is of the baseline's order (~1e-2 relative L2); what it measured on the H200 (docs/backends.md) is
# admitted with room, which tests/test_flashmla_fp8.py holds.
FACTOR = {"bf16": 3.0, "fp16": 3.0, "fp8": 4.0, "fp32": 2.0, "fp64": 2.0}
# The operand precision of the second product (P @ V) a careful kernel uses, by input dtype.
P_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn,
           "fp32": torch.float32, "fp64": torch.float64}
# Cosine-difference floors: bf16 FlashMLA's 1e-5 (a correct bf16 kernel sits near rel_l2^2 / 2 ~ 2e-6). fp8:
# with fp8 probabilities rel_l2 reaches ~3e-2, i.e. ~5e-4; 2e-3 leaves 4x. fp32/fp64 (reference checks):
# rel_l2 ~1e-6 gives ~1e-12; 1e-8 (rel_l2 ~1.4e-4) is far above that and far below any wrong formula. Raised
# per problem when the baseline itself is further off (compare()).
COS_DIFF_MAX = {"bf16": 1e-5, "fp16": 1e-5, "fp8": 2e-3, "fp32": 1e-8, "fp64": 1e-8}
# LSE: a kernel sums fp32 exponentials of fp32 scores, so with exact scores its LSE is off by ~1e-5; 2e-3 +
# 1e-4 |lse| leaves a wide margin yet a base mix-up (a factor ln 2 ~ 0.69) misses by far. A kernel that rounds
# q * scale to bf16 first (as the baseline does) moves each score by up to 2^-9 of itself, and its LSE with it:
# FlashInfer fa2 exceeded the fixed bound by 2% on one of 47704 values (H200, 2026-12-02, docs/verified.md). So
# the bound also allows FACTOR times the baseline's largest LSE error (lse_slack).
LSE_ABS_TOL = 2e-3
LSE_REL_TOL = 1e-4


@dataclass
class ErrorStats:
    max_abs: float  # max |out - ref|
    allowed_max_abs: float
    rel_l2: float  # ||out - ref|| / ||ref||
    allowed_rel_l2: float
    baseline_max_abs: float  # the same-precision baseline's errors, for the record
    baseline_rel_l2: float
    cos_diff: float  # 1 - 2<out, ref> / (|out|^2 + |ref|^2), FlashMLA's measure
    worst: tuple[int, ...]  # (batch, token, head, dim) of the largest |out - ref|
    lse_max_abs: float | None = None
    allowed_lse_abs: float | None = None
    nonfinite: int = 0  # inf/NaN elements of out (left out of the errors above; any is a failure)
    emulation: str = ""  # the declared arithmetic the baseline emulated (Arithmetic.name); "" the plain baseline

    @property
    def error_ratio(self) -> float:
        """max over checks of (error / allowed): < 1 passes. Hypothesis climbs it when fuzzing."""
        ratios = [self.max_abs / self.allowed_max_abs, self.rel_l2 / self.allowed_rel_l2]
        if self.lse_max_abs is not None and self.allowed_lse_abs:
            ratios.append(self.lse_max_abs / self.allowed_lse_abs)
        return max(ratios)

    def to_json(self) -> dict:
        d = asdict(self)
        d["worst"] = list(self.worst)
        d["error_ratio"] = self.error_ratio
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def baseline_result(problem: DecodeProblem, dtype: str, arithmetic: Arithmetic = DEFAULT) -> ReferenceResult:
    """The same-precision PyTorch computation (see the module docstring): bf16 output, and its LSE; in
    ``arithmetic`` when a backend declares one."""
    if arithmetic != DEFAULT:
        return emulated(problem, arithmetic, P_DTYPE[dtype])
    scaled_q = (problem.query.to(torch.float64) * problem.bmm1_scale).to(torch.bfloat16)
    folded = replace(problem, query=scaled_q, bmm1_scale=1.0)
    low = reference_decode(folded, torch.float32, p_dtype=P_DTYPE[dtype], matmul=fast_matmul_mode(folded))
    return ReferenceResult(low.out.to(torch.bfloat16), low.lse)


def lse_slack(baseline: ReferenceResult, ref: ReferenceResult, dtype: str) -> float:
    """FACTOR times the baseline's largest LSE error (natural log) over the judged rows: what the LSE bound adds
    to its fixed part, since a kernel that rounds q*scale to bf16 moves its LSE as much as the baseline does."""
    want = ref.lse.to(torch.float64).to(baseline.lse.device)
    # a row with no key (an empty request, a sparse row of -1) has the same infinite LSE in both: no error
    diff = torch.where(torch.isinf(want), 0.0, (baseline.lse.to(torch.float64) - want).abs())
    return FACTOR[dtype] * float(judged_rows(diff, ref).max()) if diff.numel() else 0.0


def lse_allowed(want: torch.Tensor, slack: float) -> torch.Tensor:
    """The LSE error allowed at each reference value ``want`` (natural log): the one LSE bound."""
    return LSE_ABS_TOL + LSE_REL_TOL * want.abs() + slack


def compare(out: torch.Tensor, lse: torch.Tensor | None, ref: ReferenceResult, baseline: ReferenceResult,
            dtype: str, lse_base: float | None, emulation: str = "",
            empty_lse: float | None = None) -> tuple[ErrorStats | None, list[str]]:
    """Judge a kernel's canonical output (and LSE in ``lse_base``) against the reference, with ``baseline``
    (baseline_result) setting the allowance; of a ragged problem only the rows that are query tokens
    (judged_rows). ``emulation``: the declared arithmetic the baseline emulated, named in the verdict. A row with
    no key is out 0 and its LSE exactly ``empty_lse`` (the backend's convention; None: the reference's own, -inf
    for a dense problem, +inf for a sparse one)."""
    failures: list[str] = []
    if tuple(out.shape) != tuple(ref.out.shape):
        return None, [f"out has shape {tuple(out.shape)}, expected {tuple(ref.out.shape)}"]
    o = judged_rows(out.detach().to(torch.float64), ref)
    r = judged_rows(ref.out.to(torch.float64).to(o.device), ref)
    b = judged_rows(baseline.out.to(o.device, torch.float64), ref)
    finite = torch.isfinite(o)
    err = torch.where(finite, (o - r).abs(), torch.zeros_like(o))
    base_err = (b - r).abs()
    x = torch.where(finite, o, torch.zeros_like(o))  # the kernel's finite values (0 elsewhere)
    y = torch.where(finite, r, torch.zeros_like(r))  # the reference at those places
    # every scalar the verdict needs, read back to the host at once
    (ref_norm, ref_max, base_max, base_norm, max_abs, err_norm, worst_at, nonfinite, xy, xx, yy, br, bb, rr,
     rounding_norm) = \
        torch.stack([r.norm(), r.abs().max(), base_err.max(), base_err.norm(), err.max(), err.norm(),
                     err.argmax().to(torch.float64), (~finite).sum().to(torch.float64), (x * y).sum(),
                     (x * x).sum(), (y * y).sum(), (b * r).sum(), (b * b).sum(), (r * r).sum(),
                     _expected_bf16_rounding(r)]).tolist()
    if nonfinite:  # the reference is always finite: any inf/NaN is a failure
        failures.append(_nonfinite_message(o, finite))
    ref_norm = ref_norm or 1.0
    factor = FACTOR[dtype]
    # Floor: rounding the reference's largest element to bf16 costs up to half an ulp; allow one ulp.
    floor = _bf16_ulp(ref_max)
    allowed_max = factor * base_max + floor
    # The baseline's relative error, but never below what rounding a bf16 output costs on average: when a few
    # large elements dominate the norm (heavy-tailed values) the baseline's own rounding can happen to be
    # small, and a correct kernel then measures many times it (FlashInfer fa3 at 3.1x on an H200, 2026-12-02,
    # docs/verified.md); the expected rounding is a property of the reference alone, not of that luck.
    base_rel, rounding_rel = base_norm / ref_norm, rounding_norm / ref_norm
    allowed_rel = factor * max(base_rel, rounding_rel) + 1e-6  # 1e-6: fp32 accumulation in the baseline itself
    rel = err_norm / ref_norm
    worst = _unravel(int(worst_at), tuple(err.shape))
    cos_diff = 1 - 2 * xy / max(xx + yy, 1e-300)
    stats = ErrorStats(max_abs, allowed_max, rel, allowed_rel, base_max, base_rel, cos_diff, worst,
                       nonfinite=int(nonfinite), emulation=emulation)
    where = "batch {}, token {}, head {}, dim {}".format(*worst)
    baseline_name = f"baseline (emulating {emulation})" if emulation else "baseline"
    if max_abs > allowed_max:
        failures.append(f"max |out - ref| = {max_abs:.3g} > allowed {allowed_max:.3g} "
                        f"({factor:g}x {baseline_name} {stats.baseline_max_abs:.3g} + floor {floor:.2g}) at {where}: "
                        f"kernel {float(o[worst]):.6g}, reference {float(r[worst]):.6g}")
    if rel > allowed_rel:
        failures.append(f"relative L2 error {rel:.3g} > allowed {allowed_rel:.3g} ({factor:g}x the larger of the "
                        f"{baseline_name}'s {base_rel:.3g} and a bf16 output's expected rounding {rounding_rel:.3g})")
    base_cos = 1 - 2 * br / max(bb + rr, 1e-300)
    # FlashMLA's constant holds for unit-normal values; heavy-tailed ones push even the baseline past it. The
    # cosine difference is ~ rel_l2^2 / 2, so a kernel FACTOR times as wrong has FACTOR^2 times the baseline's.
    allowed_cos = max(COS_DIFF_MAX[dtype], factor * factor * base_cos)
    if cos_diff > allowed_cos:
        failures.append(f"cosine difference {cos_diff:.3g} > allowed {allowed_cos:.3g}")
    if lse_base is not None:
        if lse is None:
            failures.append("LSE was requested but not returned")
        else:
            _compare_lse(lse, ref, lse_base, stats, failures, lse_slack(baseline, ref, dtype), empty_lse,
                         baseline_name)
    if not math.isfinite(base_max + base_rel):  # every bound above is then NaN, and NaN fails no comparison
        failures.append(f"the {baseline_name} is not finite on this problem, so no bound can be derived: a gap in "
                        "the suite's own arithmetic, not a verdict on the kernel (please report it with this case)")
    return stats, failures


def judged_rows(x: torch.Tensor, ref: ReferenceResult, fill: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``x`` [B, q_len, ...] with the rows that are no request's query token (a ragged problem's padding,
    ``ref.valid``) replaced by ``fill``: the one place such rows are left out of every judgement, so whatever a
    kernel leaves there is never read. ``x`` itself when every row is a token."""
    if ref.valid is None:
        return x
    keep = ref.valid.to(x.device).view(tuple(ref.valid.shape) + (1,) * (x.dim() - 2))
    return torch.where(keep, x, fill)


def _compare_lse(lse: torch.Tensor, ref: ReferenceResult, base: float, stats: ErrorStats,
                 failures: list[str], slack: float, empty_lse: float | None,
                 baseline_name: str = "baseline") -> None:
    """``slack``: lse_slack, added to the fixed bound; ``empty_lse``: compare()'s."""
    if tuple(lse.shape) != tuple(ref.lse.shape):
        failures.append(f"lse has shape {tuple(lse.shape)}, expected {tuple(ref.lse.shape)} "
                        "(after [B*q_len, H] -> [B, q_len, H])")
        return
    want = ref.lse.to(torch.float64).to(lse.device)
    empty = torch.isinf(want)  # rows with no key: the LSE must be the backend's convention there, exactly
    if empty_lse is not None:
        want = torch.where(empty, empty_lse, want)
    got = judged_rows(lse.detach().to(torch.float64) * math.log(base), ref, want)  # to natural log
    if bool(empty.any()):
        wrong = empty & (got != want)
        if bool(wrong.any()):
            failures.append(f"LSE is not {float(want[empty][0]):+g} at {int(wrong.sum())} of the "
                            f"{int(empty.sum())} rows with no valid key")
        got, want = torch.where(empty, 0.0, got), torch.where(empty, 0.0, want)
    allowed = lse_allowed(want, slack)
    err = (got - want).abs()
    bad = ~(err <= allowed)  # NaN counts as bad
    stats.lse_max_abs = float(torch.nan_to_num(err, nan=float("inf")).max())
    stats.allowed_lse_abs = float(allowed.max())
    if bool(bad.any()):
        b, t, h = (int(i) for i in bad.nonzero()[0])
        failures.append(f"LSE (base {_base_name(base)}) off at batch {b}, token {t}, head {h}: kernel "
                        f"{float(lse[b, t, h]):.6g}, reference {float(want[b, t, h] / math.log(base)):.6g} "
                        f"({int(bad.sum())} of {bad.numel()} values outside {LSE_ABS_TOL:g} + {LSE_REL_TOL:g}|lse|"
                        f"{f' + {slack:.3g} (the {baseline_name})' if slack else ''})")


def _nonfinite_message(o: torch.Tensor, finite: torch.Tensor) -> str:
    bad = (~finite).nonzero()
    b, t, h, d = (int(i) for i in bad[0])
    inf_count = int(torch.isinf(o).sum())
    nan_count = int(torch.isnan(o).sum())
    cause = []
    if inf_count:
        cause.append(f"{inf_count} inf (out was poisoned with +inf: unwritten elements)")
    if nan_count:
        cause.append(f"{nan_count} NaN (read from the NaN-filled unused cache slots, or made by the kernel itself, "
                     "e.g. in a split whose keys are all masked: the diagnosis tells which)")
    return (f"{bad.shape[0]} non-finite values in out where the reference is finite, first at batch {b}, "
            f"token {t}, head {h}, dim {d}: " + "; ".join(cause))


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def _expected_bf16_rounding(r: torch.Tensor) -> torch.Tensor:
    """sqrt(E||bf16(r) - r||^2): the rms of rounding each element to bf16, an error uniform in half an ulp
    either side (variance ulp^2 / 12); a 0-d tensor."""
    _, exponent = torch.frexp(r)  # |r| = m * 2^e with m in [0.5, 1): bf16's ulp there is 2^(e - 8)
    ulp = torch.ldexp(torch.ones_like(r), (exponent - 8).to(r.dtype))
    return (torch.where(r == 0, 0.0, ulp).square().sum() / 12).sqrt()


def _bf16_ulp(x: float) -> float:
    if x == 0 or not math.isfinite(x):
        return 2.0 ** -133
    return 2.0 ** (math.floor(math.log2(x)) - 7)


def _base_name(base: float) -> str:
    return "2" if base == 2.0 else ("e" if abs(base - math.e) < 1e-12 else f"{base:g}")
