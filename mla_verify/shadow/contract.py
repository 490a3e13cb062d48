"""Shadow mode's checks of one live call's arguments, before the kernel runs.

The arguments arrive in Contract 1's terms (``PagedArgs``: whatever entry point the call came through, the
adapter in shadow_entries.py has already mapped it there), and are checked against what the kernel takes
(``KernelContract``) and what is known of the model (``ModelFacts``). Each problem found is a ``Finding``: an
error (the call disagrees with the contract) or a warning (it looks like a known mistake but may be meant);
a *blocking* error means the call cannot be read as a decode problem, or the kernel would read outside its
tensors -- strict mode then stops the call before the kernel runs.

Sequence lengths, table entries and the pool bounds are the checks of ``DecodeProblem.validate`` itself, so
the shadow and the suite refuse the same calls with the same one-line messages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..backends.base import Envelope
from ..core.dims import R1_YARN_FACTOR, yarn_mscale
from ..core.errors import ProblemError
from ..problems.problem import FP8

ERROR, WARNING = "error", "warning"
# Two spellings of one scale (float32 on the engine's side, float64 here) differ by ~6e-8; the conventions
# compared differ by at least sqrt(3) (192 vs 576) or R1's mscale^2 (1.87): 1e-5 tells them apart with room.
SCALE_REL_TOL = 1e-5
DEEPSEEK_QK_NOPE = 128  # what an entry point that is not told qk_nope_head_dim assumes (DeepSeek-V2/V3/R1)


@dataclass(frozen=True)
class Finding:
    severity: str  # ERROR or WARNING
    field: str  # the argument it is about
    message: str
    blocking: bool = False  # the call cannot be read as a decode problem, or would read outside its tensors

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(frozen=True)
class ModelFacts:
    """What the shadow is told about the model, to judge the scales a call passes.

    ``yarn_factor``: the model's YaRN rope-scaling factor (DeepSeek-R1/V3: 40), or None when unknown -- then
    both conventions, with and without mscale^2, are accepted. ``qk_nope_head_dim``: for entry points whose
    arguments do not say it (the wrapper, FlashMLA); None assumes DeepSeek's 128. ``fp8_scales``: (q_scale,
    k_scale) of an fp8 cache, when known; without them an fp8 call's bmm1 cannot be judged.
    """

    yarn_factor: float | None = None
    mscale_all_dim: float = 1.0
    qk_nope_head_dim: int | None = None
    fp8_scales: tuple[float, float] | None = None


@dataclass(frozen=True)
class KernelContract:
    """What one entry point's kernel takes, as far as the shadow checks it."""

    name: str
    cache_dims: tuple[int, ...] = (3, 4)  # cache ranks it reads: 3 [P, page, D], 4 [P, 1, page, D]
    out_dtype: torch.dtype = torch.bfloat16
    envelope: Envelope | None = None  # a declared envelope, checked once the call is read as a problem
    envelope_severity: str = ERROR  # WARNING where the library checks its own envelope (ours may lag it)
    lse_base: float | None = 2.0  # the base of the LSE it returns; None: not fixed (not compared)
    empty_lse: float | None = None  # the LSE of a query row with no key (kv_len 0); None: the reference's, -inf


@dataclass
class PagedArgs:
    """One paged MLA decode call in Contract 1's terms (docs/contracts.md)."""

    query: torch.Tensor  # [B, q_len, H, L + R]
    kv_cache: torch.Tensor  # as the kernel receives it: [P, page, D] or [P, 1, page, D]
    block_table: torch.Tensor  # [B, W]
    seq_lens: torch.Tensor  # [B], KV length including the q_len new tokens
    kv_lora_rank: int
    qk_rope_head_dim: int
    bmm1_scale: float
    bmm2_scale: float = 1.0
    qk_nope_head_dim: int | None = None  # None: the call does not say
    max_seq_len: int | None = None
    out: torch.Tensor | None = None
    out_shape: tuple[int, ...] | None = None  # the shape `out` must have here; None: Contract 1's
    dequant: float | None = None  # fp8 dequant scales the call itself names (the wrapper's ckv_scale)
    extra: list[Finding] = field(default_factory=list)  # what the entry point's adapter found already


def page_size_of(kv_cache: torch.Tensor) -> int:
    return kv_cache.shape[-2]


def check_layout(args: PagedArgs, contract: KernelContract) -> list[Finding]:
    """Shapes, ranks, strides, dtypes and the `out` buffer: everything that needs no tensor values."""
    found: list[Finding] = []
    q, kv = args.query, args.kv_cache
    width = args.kv_lora_rank + args.qk_rope_head_dim
    if q.dim() != 4 or q.shape[-1] != width:
        found.append(Finding(ERROR, "query", f"shape {tuple(q.shape)}; expected [batch, q_len, heads, {width}] "
                             f"(kv_lora_rank {args.kv_lora_rank} + qk_rope_head_dim {args.qk_rope_head_dim})",
                             blocking=True))
    found += _check_cache_rank(kv, contract)
    if kv.dim() in (3, 4) and kv.shape[-1] != width:
        found.append(Finding(ERROR, "kv_cache", f"rows are {kv.shape[-1]} wide; expected {width}", blocking=True))
    if kv.dim() in (3, 4) and kv.stride(-1) != 1:
        found.append(Finding(ERROR, "kv_cache", f"stride {kv.stride(-1)} within a row: kernels read each "
                             "cached row as contiguous memory", blocking=True))
    elif kv.dim() in (3, 4) and kv.shape[-2] > 1 and kv.stride(-2) != kv.shape[-1]:
        found.append(Finding(WARNING, "kv_cache", f"token rows inside a page are {kv.stride(-2)} elements "
                             f"apart, not {kv.shape[-1]}: only whole pages may be strided (Contract 1)"))
    if q.dim() == 4 and q.stride(-1) != 1:
        found.append(Finding(ERROR, "query", f"stride {q.stride(-1)} in the last dimension: not a dense row"))
    found += _check_out(args, contract)
    return found


def _check_cache_rank(kv: torch.Tensor, contract: KernelContract) -> list[Finding]:
    takes = " or ".join({3: "3-D [pages, page_size, D]", 4: "4-D [pages, 1, page_size, D]"}[d]
                        for d in contract.cache_dims)
    if kv.dim() not in (3, 4):
        return [Finding(ERROR, "kv_cache", f"{kv.dim()}-D {tuple(kv.shape)}; {contract.name} takes {takes}",
                        blocking=True)]
    if kv.dim() == 4 and kv.shape[1] != 1:
        hint = (" -- FlashMLA's [blocks, page, 1, D] order" if kv.shape[2] == 1 else "")
        return [Finding(ERROR, "kv_cache", f"4-D {tuple(kv.shape)} with dimension 1 = {kv.shape[1]}: a 4-D "
                        f"MLA cache is [pages, 1, page_size, D] (one KV head){hint}", blocking=True)]
    if kv.dim() not in contract.cache_dims:
        return [Finding(ERROR, "kv_cache", f"{kv.dim()}-D {tuple(kv.shape)}, but {contract.name} takes only "
                        f"{takes}: it would read the page size from another dimension", blocking=True)]
    return []


def _check_out(args: PagedArgs, contract: KernelContract) -> list[Finding]:
    out = args.out
    if out is None or args.query.dim() != 4:
        return []
    B, Q, H, _ = args.query.shape
    want = args.out_shape or (B, Q, H, args.kv_lora_rank)
    found = []
    if tuple(out.shape) != tuple(want):
        found.append(Finding(ERROR, "out", f"shape {tuple(out.shape)}; this call writes {tuple(want)}",
                             blocking=True))
    if out.dtype != contract.out_dtype:
        found.append(Finding(ERROR, "out", f"dtype {out.dtype}; {contract.name} writes {contract.out_dtype}"))
    if out.device != args.query.device:
        found.append(Finding(ERROR, "out", f"on {out.device}, the query on {args.query.device}", blocking=True))
    elif not out.is_contiguous():
        found.append(Finding(WARNING, "out", f"not contiguous (strides {out.stride()}): a kernel that writes "
                             "rows densely leaves gaps in it"))
    return found


def check_lengths(args: PagedArgs) -> list[Finding]:
    """The block-table width against the sequence lengths, and max_seq_len; before the problem's validation,
    which then checks every table entry a sequence uses against the pool."""
    found: list[Finding] = []
    table, lens = args.block_table, args.seq_lens
    if table.dim() != 2 or lens.dim() != 1 or lens.numel() == 0:
        return found  # validation names the shape
    page = page_size_of(args.kv_cache)
    longest = int(lens.max())
    need = -(-longest // page)
    if need > table.shape[1]:
        b = int(lens.argmax())
        found.append(Finding(ERROR, "block_tables", f"rows of {table.shape[1]} entries, but seq_lens[{b}] = {longest} "
                             f"needs {need} pages of {page} tokens: the kernel would take its pages from the next "
                             "row (a table sized for another page size, or for shorter sequences?)", blocking=True))
    if args.max_seq_len is not None and args.max_seq_len < longest:
        found.append(Finding(ERROR, "max_seq_len", f"{args.max_seq_len} is below the longest sequence ({longest}): "
                             "kernels that split the KV range by max_seq_len drop the tokens past it"))
    return found


def validation_finding(error: ProblemError) -> Finding:
    """``DecodeProblem.validate``'s refusal as a blocking error on the field it names."""
    name, _, message = str(error).partition(": ")
    return Finding(ERROR, name, message or str(error), blocking=True)


def check_envelope(reason: str | None, contract: KernelContract) -> list[Finding]:
    """``Envelope.why_not``'s sentence for this call, at the contract's severity."""
    if reason is None:
        return []
    return [Finding(contract.envelope_severity, "call", f"{contract.name}: {reason}")]


def check_scales(args: PagedArgs, facts: ModelFacts) -> list[Finding]:
    """bmm1 against the softmax-scale conventions (with fp8 dequant scales where known); bmm2 on a bf16 cache."""
    found: list[Finding] = []
    fp8 = args.kv_cache.dtype == FP8 or args.query.dtype == FP8
    dequant = args.dequant
    if dequant is None and fp8 and facts.fp8_scales is not None:
        dequant = facts.fp8_scales[0] * facts.fp8_scales[1]
    if dequant is not None or not fp8:  # an fp8 call with unknown dequant scales can have any bmm1
        nope = args.qk_nope_head_dim or facts.qk_nope_head_dim or DEEPSEEK_QK_NOPE
        finding = _judge_bmm1(args.bmm1_scale, nope, args.kv_lora_rank, args.qk_rope_head_dim, facts,
                              dequant or 1.0, told_nope=args.qk_nope_head_dim or facts.qk_nope_head_dim)
        if finding is not None:
            found.append(finding)
    if not fp8 and args.bmm2_scale != 1.0:
        found.append(Finding(WARNING, "bmm2_scale", f"{args.bmm2_scale:.6g} with a {args.kv_cache.dtype} cache: "
                             "an fp8 dequant scale applied to a cache that is not fp8?"))
    return found


def check_softmax_scale(scale: float, kv_lora_rank: int, rope: int, facts: ModelFacts) -> list[Finding]:
    """A softmax scale given as such (no fp8 dequant folded in), against the conventions: sparse calls."""
    told = facts.qk_nope_head_dim
    finding = _judge_bmm1(scale, told or DEEPSEEK_QK_NOPE, kv_lora_rank, rope, facts, 1.0, told)
    return [] if finding is None else [Finding(finding.severity, "softmax_scale", finding.message)]


def sparse_index_findings(indices: torch.Tensor, slots: int, reader: str, name: str = "indices") -> list[Finding]:
    """Sparse kernels mask -1 only and bounds-check nothing else: an index that is neither -1 nor one of the pool's
    ``slots`` is an out-of-bounds read by ``reader`` (a sentence), a blocking error before the call."""
    bad = (indices != -1) & ((indices < 0) | (indices >= slots))
    if not bool(bad.any()):
        return []
    at = [int(x) for x in bad.nonzero()[0]]
    return [Finding(ERROR, name, f"{int(bad.sum())} entries are neither -1 nor a slot of the pool "
                    f"(0..{slots - 1}), first {name}{at} = {int(indices[tuple(at)])}: {reader}", blocking=True)]


def scale_conventions(nope: int, kv_lora_rank: int, rope: int, facts: ModelFacts,
                      dequant: float = 1.0) -> tuple[dict[str, float], dict[str, float]]:
    """(right, wrong): named softmax scales (times ``dequant``) a call's bmm1 may be, and known mistakes."""
    m2 = yarn_mscale(facts.yarn_factor or R1_YARN_FACTOR, facts.mscale_all_dim) ** 2
    factor = facts.yarn_factor or R1_YARN_FACTOR
    base, absorbed = f"1/sqrt({nope + rope})", f"1/sqrt({kv_lora_rank + rope})"
    plain, with_m = 1 / math.sqrt(nope + rope), m2 / math.sqrt(nope + rope)
    yarn = f"{base} * mscale^2 (YaRN factor {factor:g})"
    right = {base: plain, yarn: with_m} if facts.yarn_factor is None else {yarn: with_m}
    wrong = {f"{absorbed}, the absorbed width instead of qk_nope + qk_rope": 1 / math.sqrt(kv_lora_rank + rope),
             f"{absorbed} * mscale^2, the absorbed width": m2 / math.sqrt(kv_lora_rank + rope),
             f"{base} * mscale^4, mscale^2 applied twice": m2 * m2 / math.sqrt(nope + rope)}
    if facts.yarn_factor is not None:
        wrong[f"{base}, YaRN's mscale^2 missing"] = plain
    if dequant == 1.0:
        return right, wrong
    undequantized = {f"{k}, without the fp8 dequant scales": v for k, v in right.items()}
    return ({f"{k} * q_scale * k_scale": v * dequant for k, v in right.items()},
            {**{f"{k} * q_scale * k_scale": v * dequant for k, v in wrong.items()}, **undequantized})


def _judge_bmm1(scale: float, nope: int, kv_lora_rank: int, rope: int, facts: ModelFacts, dequant: float,
                told_nope: int | None) -> Finding | None:
    right, wrong = scale_conventions(nope, kv_lora_rank, rope, facts, dequant)
    if any(math.isclose(scale, v, rel_tol=SCALE_REL_TOL) for v in right.values()):
        return None
    listed = "; ".join(f"{k} = {v:.6g}" for k, v in right.items())
    assumed = "" if told_nope else f" (qk_nope_head_dim assumed {nope}: pass it in ModelFacts if not)"
    for name, value in wrong.items():
        if math.isclose(scale, value, rel_tol=SCALE_REL_TOL):
            return Finding(ERROR, "bmm1_scale", f"{scale:.6g} = {name}; the softmax scale is {listed}{assumed}")
    compared = "; ".join(f"{k} = {v:.6g}" for k, v in {**right, **wrong}.items())
    return Finding(WARNING, "bmm1_scale", f"{scale:.6g} matches no known softmax convention; compared against: "
                   f"{compared}{assumed}")
