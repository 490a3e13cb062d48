"""The tolerance model's baseline in a kernel's declared arithmetic (problems/arithmetic.py): the same problem
computed with the very roundings the kernel declares, so the bound that judges it is derived from its own
precision.

The reference's group loop does the gathering (reference_decode's ``attend``); each group is computed here:
- scores: q.k summed in fp32, or by the declared tensor-core accumulator (``accumulate``), then bmm1 applied in
  fp32 as the kernel does (``exp2(s * scale_log2 - max * scale_log2)``);
- probabilities relative to a running max over blocks of keys, visited in the kernel's order, rounded to the
  declared dtype; the row sum of the fp32 or the rounded ones;
- P.V summed in fp32, or by the declared accumulator into the running output, block after block (it is then
  the very accumulator that carries the earlier blocks, so its truncation grows with the keys of a split);
- a split-KV schedule, when declared: each split has its own running max and sums, merged by their LSE in fp32.
Without an accumulator model or splits the blocks are vectorized (running maxima by cummax); with them the
blocks are walked in the kernel's order, vectorized over the group's requests and rows.
"""
from __future__ import annotations

import math

import torch

from ..problems.arithmetic import DEFAULT, FORWARD, SCALE_ON_SCORES, SUM_ROUNDED, Accumulator, Arithmetic
from ..problems.problem import FP8, DecodeProblem
from ..problems.reference import ReferenceResult, fast_matmul_mode, mask_hidden, reference_decode

LOG2E = 1.0 / math.log(2.0)
P_DTYPES = {"bf16": torch.bfloat16, "e4m3": FP8}  # Arithmetic.p_dtype
# elements of the products one accumulator step materializes at a time ([rows, k_step, cols]): 2^24 fp32 is
# 64 MiB, so the model costs a few such passes, not a copy of the scores per product
PRODUCTS_PER_CHUNK = 1 << 24
FP32_TINIEST_EXP = -149  # 2^-149: fp32's smallest subnormal


def emulated(problem: DecodeProblem, arithmetic: Arithmetic, p_dtype: torch.dtype) -> ReferenceResult:
    """``problem`` in ``arithmetic`` (not DEFAULT: compare.baseline_result has that one), its P rounded to
    ``p_dtype`` unless the arithmetic names its own; out rounded to bf16, LSE in natural log."""
    assert arithmetic != DEFAULT, "the plain baseline is compare.baseline_result's"
    if arithmetic.scale != SCALE_ON_SCORES:
        raise ValueError(f"{arithmetic.name}: only {SCALE_ON_SCORES!r} is emulated here")
    p_dtype = P_DTYPES[arithmetic.p_dtype] if arithmetic.p_dtype else p_dtype
    splits = None
    if arithmetic.splits is not None:
        rows = problem.q_len * problem.num_heads
        splits = arithmetic.splits(problem.seq_lens.tolist(), rows, sm_count(problem.device))
    group = _Group(arithmetic, p_dtype, splits)
    low = reference_decode(problem, torch.float32, matmul=fast_matmul_mode(problem), attend=group)
    return ReferenceResult(low.out.to(torch.bfloat16), low.lse, low.valid)


CPU_SM_COUNT = 132  # a CPU stand-in of a split-KV kernel is scheduled as on an H100/H200 (132 SMs)


def sm_count(device: torch.device) -> int:
    """The SM count a split-KV schedule is computed for: the GPU's own, CPU_SM_COUNT on a CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SM_COUNT


def accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, model: Accumulator) -> torch.Tensor:
    """``acc + a @ b`` ([..., M, N] + [..., M, K] @ [..., K, N]) as ``model``'s tensor core sums it: K in steps of
    ``k_step`` products, each step's terms (the accumulator and the exact products) truncated toward zero to
    multiples of 2^-bits of the largest one's leading bit, then summed exactly. Chunked over M so that at most
    PRODUCTS_PER_CHUNK products are held at once. fp32 when the sum of the truncated terms is exact there, else
    fp64; the result is fp32 (exact: at most bits + log2(k_step + 1) + 1 significant bits)."""
    exact_in_fp32 = model.bits + math.ceil(math.log2(model.k_step + 1)) + 1 <= 24
    work = torch.float32 if exact_in_fp32 else torch.float64
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    acc3, a3, b3 = acc.reshape(-1, M, N), a.reshape(-1, M, K), b.reshape(-1, K, N)
    per_row = model.k_step * N  # products one row of one batch entry holds in a step
    rows = max(1, min(M, PRODUCTS_PER_CHUNK // per_row))
    batches = max(1, PRODUCTS_PER_CHUNK // (per_row * rows))
    out = torch.empty(acc3.shape, dtype=torch.float32, device=acc.device)
    for i in range(0, acc3.shape[0], batches):
        for m0 in range(0, M, rows):
            c = acc3[i:i + batches, m0:m0 + rows].to(work, copy=True)
            for k0 in range(0, K, model.k_step):
                prods = a3[i:i + batches, m0:m0 + rows, k0:k0 + model.k_step, None].to(work) * \
                    b3[i:i + batches, None, k0:k0 + model.k_step, :].to(work)  # [b, m, k, N], exact
                top = torch.maximum(c.abs(), torch.maximum(prods.amax(-2), prods.amin(-2).neg_()))
                _, exponent = torch.frexp(top)  # top = f * 2^e, f in [0.5, 1): the leading bit is 2^(e - 1)
                # never finer than fp32's smallest subnormal, the accumulator's own floor: below it a unit would
                # round to 0 and 0/0 make the output NaN (an accumulator rescaled to a few ulps of 2^-126)
                unit = torch.ldexp(torch.ones_like(top), (exponent - 1 - model.bits).clamp_(min=FP32_TINIEST_EXP))
                # every term a whole number of units (a power of two: the divisions are exact), summed, scaled back
                whole = prods.div_(unit[..., None, :]).trunc_().sum(-2)
                c = c.div_(unit).trunc_().add_(whole).mul_(unit)
            out[i:i + batches, m0:m0 + rows] = c
    return out.view(acc.shape)


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if dtype == torch.float32 else x.to(dtype).to(torch.float32)


class _Group:
    """reference.GroupAttention in a declared arithmetic (module docstring)."""

    def __init__(self, arithmetic: Arithmetic, p_dtype: torch.dtype, splits: list[list[tuple[int, int]]] | None):
        self.a, self.p_dtype, self.splits = arithmetic, p_dtype, splits

    def __call__(self, p: DecodeProblem, requests: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                 hidden: torch.Tensor, into: tuple[torch.Tensor, ...]) -> None:
        out, top, top_share, _ = into
        a = self.a
        if a.qk is None:
            scores = torch.bmm(q.float(), kv.float().transpose(1, 2))
        else:
            zero = torch.zeros((q.shape[0], q.shape[1], kv.shape[1]), dtype=torch.float32, device=q.device)
            scores = accumulate(zero, q, kv.transpose(1, 2), a.qk)
        mask_hidden(scores, hidden, p.q_len)
        # the scale as the kernel holds it: an fp32 number, applied in base 2 inside exp2
        scale = float(torch.tensor(p.bmm1_scale, dtype=torch.float32))
        scale_log2 = float(torch.tensor(p.bmm1_scale * LOG2E, dtype=torch.float32))
        values = kv[..., :p.dims.kv_lora_rank]
        block = a.p_block or scores.shape[-1]
        pad = -scores.shape[-1] % block
        if pad:  # whole blocks: the padding keys are masked
            scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
            values = torch.nn.functional.pad(values, (0, 0, 0, pad))
        if a.sequential:
            lse, o = self._walk(p, requests, scores, values, block, scale, scale_log2)
            out.copy_(o)
            top.copy_(lse)
            top_share.fill_(1.0)
        else:
            self._vectorized(p, scores, values, block, scale, scale_log2, out, top, top_share)

    def _vectorized(self, p: DecodeProblem, scores: torch.Tensor, values: torch.Tensor, block: int, scale: float,
                    scale_log2: float, out: torch.Tensor, top: torch.Tensor, top_share: torch.Tensor) -> None:
        b, rows, T = scores.shape
        block_max = scores.view(b, rows, T // block, block).amax(-1)
        if self.a.order == FORWARD:
            running = torch.cummax(block_max, -1).values
        else:
            running = torch.cummax(block_max.flip(-1), -1).values.flip(-1)
        at_key = running.repeat_interleave(block, -1)
        row_max = running.amax(-1, keepdim=True)
        probs = _exp2_shifted(scores, at_key, scale_log2)
        rescale = torch.exp2((at_key - row_max) * scale_log2)  # each block's P back to the row's max, in fp32
        rounded = _rounded(probs, self.p_dtype)
        summed = rounded if self.a.row_sum == SUM_ROUNDED else probs
        denominator = (summed * rescale).sum(-1, keepdim=True)
        torch.div(torch.bmm(rounded.mul_(rescale), values.float()), denominator, out=out)
        out.mul_(p.bmm2_scale)
        torch.mul(row_max, scale, out=top)
        torch.reciprocal(denominator, out=top_share)

    def _walk(self, p: DecodeProblem, requests: torch.Tensor, scores: torch.Tensor, values: torch.Tensor,
              block: int, scale: float, scale_log2: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks in the kernel's order, each split with its own running max, sum and output, merged by
        their LSE as they end: (lse, out) [b, rows, 1] and [b, rows, L], natural log, bmm2 applied."""
        b, rows, T = scores.shape
        n_blocks = T // block
        lens = p.seq_lens[requests].tolist()
        starts, ends, active = _split_flags(lens, block, n_blocks, None if self.splits is None else
                                            [self.splits[i] for i in requests.tolist()], scores.device)
        if self.a.order == FORWARD:
            order, opens, closes = range(n_blocks), starts, ends
        else:
            order, opens, closes = range(n_blocks - 1, -1, -1), ends, starts
        L = values.shape[-1]
        ninf = torch.full((b, rows, 1), float("-inf"), device=scores.device)
        m, total, o = ninf.clone(), torch.zeros_like(ninf), scores.new_zeros((b, rows, L))
        lse, merged = ninf.clone(), scores.new_zeros((b, rows, L))
        v = values.float()
        for j in order:
            s = scores[..., j * block:(j + 1) * block]
            fresh, live, done = (x[:, j].view(b, 1, 1) for x in (opens, active, closes))
            m_new = torch.where(fresh, s.amax(-1, keepdim=True), torch.maximum(m, s.amax(-1, keepdim=True)))
            rescale = torch.where(fresh, 0.0, _exp2_shifted(m, m_new, scale_log2))
            probs = _exp2_shifted(s, m_new, scale_log2)
            rounded = _rounded(probs, self.p_dtype)
            summed = rounded if self.a.row_sum == SUM_ROUNDED else probs
            o_new = o * rescale
            vj = v[:, j * block:(j + 1) * block]
            o_new = o_new + torch.bmm(rounded, vj) if self.a.pv is None else accumulate(o_new, rounded, vj, self.a.pv)
            m = torch.where(live, m_new, m)
            total = torch.where(live, total * rescale + summed.sum(-1, keepdim=True), total)
            o = torch.where(live, o_new, o)
            # a split ends: its output and LSE (FlashMLA's normalize_softmax_lse), merged into the row's
            finished = done & live
            split_lse = torch.where(total > 0, m * scale + total.log(), float("-inf"))
            split_out = o * torch.where(total > 0, p.bmm2_scale / total, 0.0)
            new_lse = torch.logaddexp(lse, split_lse)
            keep = torch.where(lse > float("-inf"), torch.exp(lse - new_lse), 0.0)
            add = torch.where(split_lse > float("-inf"), torch.exp(split_lse - new_lse), 0.0)
            merged = torch.where(finished, merged * keep + split_out * add, merged)
            lse = torch.where(finished, new_lse, lse)
        return lse, merged


def _exp2_shifted(s: torch.Tensor, m: torch.Tensor, scale_log2: float) -> torch.Tensor:
    """exp2(s * scale_log2 - m * scale_log2), as FlashAttention-style kernels compute probabilities; a max of -inf
    (every key so far masked) counts as 0, so masked keys give 0, never NaN."""
    m = torch.where(m == float("-inf"), 0.0, m)
    return torch.exp2(s * scale_log2 - m * scale_log2)


def _split_flags(lens: list[int], block: int, n_blocks: int, splits: list[list[tuple[int, int]]] | None,
                 device: torch.device) -> tuple[torch.Tensor, ...]:
    """(starts, ends, active) [b, n_blocks] bool: the first and last block of each split and the blocks that hold
    keys of the request (one split per request without a schedule)."""
    starts = torch.zeros((len(lens), n_blocks), dtype=torch.bool)
    ends, active = starts.clone(), starts.clone()
    for i, n in enumerate(lens):
        blocks = -(-n // block)
        active[i, :blocks] = True
        for lo, hi in ([(0, n)] if splits is None else splits[i]):
            first, last = lo // block, -(-hi // block) - 1
            if lo % block or (hi % block and hi != n) or not 0 <= first <= last < blocks:
                raise ValueError(f"split ({lo}, {hi}) of a {n}-key request is not whole {block}-key blocks")
            starts[i, first] = True
            ends[i, last] = True
    return starts.to(device), ends.to(device), active.to(device)
