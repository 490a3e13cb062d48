"""Test-only kernels: ones that compute in a declared arithmetic (problems/arithmetic.py), written out per request and
per block as a kernel does -- no code shared with judge/emulation.py, which vectorizes the same roundings over a
group of requests: so each checks the other.

``declared_kernel(arithmetic)`` is a Contract-1 callable (3-D cache, one query token, LSE in base 2) that makes
exactly the roundings ``arithmetic`` names: the scores summed in fp32 or by its tensor-core accumulator model (each
step's terms truncated below the largest one's leading bit, summed exactly, in fp64), P relative to the running
max of each split's key blocks in the declared order, rounded to the declared dtype, the row sum of the fp32 or
the rounded P, P.V summed the same way into the running output, each split normalized and the splits merged by
their LSE. ``extra`` adds one rounding the declaration does not name:

- "p_e4m3": P rounded to e4m3 (where it declares a wider P);
- "out_e4m3": the output rounded to e4m3 before bf16 (an fp8 output path).

``position_rounded``: a correct kernel that is not bit-invariant under batch reordering.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from mla_verify.kernels.mutants import correct_kernel
from mla_verify.problems.arithmetic import FORWARD, SUM_ROUNDED, Accumulator, Arithmetic
from mla_verify.problems.problem import FP8

P_DTYPES = {"bf16": torch.bfloat16, "e4m3": FP8}
CPU_SM_COUNT = 132  # as judge/emulation.py schedules a CPU stand-in (an H100/H200's 132 SMs)


def _step(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, model: Accumulator) -> torch.Tensor:
    """acc [m, n] + a [m, k] @ b [k, n] by ``model``, one step of ``k_step`` products at a time, in fp64."""
    acc = acc.double()
    for k0 in range(0, a.shape[1], model.k_step):
        terms = torch.cat([acc[:, None, :], a[:, k0:k0 + model.k_step, None].double()
                           * b[None, k0:k0 + model.k_step, :].double()], 1)  # [m, 1 + k, n]
        largest = terms.abs().amax(1)
        lead = torch.where(largest > 0, torch.floor(torch.log2(largest)), 0.0)  # the largest term's leading bit
        unit = torch.exp2(lead - model.bits)
        acc = (torch.trunc(terms / unit[:, None, :]) * unit[:, None, :]).sum(1)
    return acc.float()


def _product(a: torch.Tensor, b: torch.Tensor, model: Accumulator | None) -> torch.Tensor:
    if model is None:
        return (a.double() @ b.double()).float()
    return _step(torch.zeros(a.shape[0], b.shape[1]), a, b, model)


def declared_kernel(arithmetic: Arithmetic, extra: str | None = None) -> Any:
    """A Contract-1 kernel computing in ``arithmetic`` (module docstring), with one ``extra`` rounding or none."""
    p_dtype = P_DTYPES[arithmetic.p_dtype or "e4m3"]

    def decode(query: torch.Tensor, kv_cache: torch.Tensor, workspace: Any, qk_nope_head_dim: int,
               kv_lora_rank: int, qk_rope_head_dim: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               max_seq_len: int, out: torch.Tensor | None = None, bmm1_scale: float = 1.0,
               bmm2_scale: float = 1.0, return_lse: bool = False, **kwargs: Any) -> Any:
        B, Q, H, D = query.shape
        assert Q == 1 and kv_cache.dim() == 3, "one query token, a 3-D cache"
        page = kv_cache.shape[1]
        scale = float(torch.tensor(bmm1_scale, dtype=torch.float32))
        scale_log2 = float(torch.tensor(bmm1_scale / math.log(2.0), dtype=torch.float32))
        lens = seq_lens.tolist()
        schedule = arithmetic.splits(lens, H, CPU_SM_COUNT) if arithmetic.splits else [[(0, n)] for n in lens]
        result = torch.empty(B, 1, H, kv_lora_rank, dtype=torch.bfloat16)
        lse = torch.empty(B, H)
        for b, n in enumerate(lens):
            pages = block_tables[b, :-(-n // page)].long()
            rows = kv_cache[pages].reshape(-1, D)[:n].float()
            s = _product(query[b, 0].float(), rows.T, arithmetic.qk)  # [H, n] raw q.k
            parts = []
            for lo, hi in schedule[b]:
                block = arithmetic.p_block or (hi - lo)
                starts = list(range(lo, hi, block))
                m = torch.full((H, 1), -math.inf)
                total, o = torch.zeros(H, 1), torch.zeros(H, kv_lora_rank)
                for j in (starts if arithmetic.order == FORWARD else starts[::-1]):
                    sj = s[:, j:min(j + block, hi)]
                    m_new = torch.maximum(m, sj.amax(1, keepdim=True))
                    shift = m_new * scale_log2
                    rescale = torch.exp2(m * scale_log2 - shift)  # 0 while m is -inf
                    probs = torch.exp2(sj * scale_log2 - shift)
                    rounded = (probs.to(FP8) if extra == "p_e4m3" else probs.to(p_dtype)).float()
                    summed = rounded if arithmetic.row_sum == SUM_ROUNDED else probs
                    total = total * rescale + summed.sum(1, keepdim=True)
                    values = rows[j:j + sj.shape[1], :kv_lora_rank]
                    o = o * rescale
                    o = o + _product(rounded, values, None) if arithmetic.pv is None else \
                        _step(o, rounded, values, arithmetic.pv)
                    m = m_new
                parts.append((o * (bmm2_scale / total), m * scale + torch.log(total)))
            split_lse = torch.cat([lse_s for _, lse_s in parts], 1)  # [H, splits]
            merged = torch.logsumexp(split_lse, 1, keepdim=True)
            o = sum(o_s * torch.exp(lse_s - merged) for o_s, lse_s in parts)
            if extra == "out_e4m3":
                o = o.to(FP8).float()
            result[b, 0] = o.to(torch.bfloat16)
            lse[b] = merged[:, 0] / math.log(2.0)
        if out is not None:
            out.copy_(result)
            result = out
        return (result, lse) if return_lse else result

    decode.__doc__ = f"{arithmetic.name}, computed per request" + (f", with {extra}" if extra else "")
    return decode


def position_rounded(query: torch.Tensor, kv_cache: torch.Tensor, *args: Any, bmm2_scale: float = 1.0,
                     **kwargs: Any) -> Any:
    """A correct kernel whose bits depend on where a request sits in the batch, as a BLAS path's may: the requests
    at odd positions get an fp32 result 2^-12 larger before their bf16 rounding (a bf16 ulp is 2^-8 relative), so
    about one output element in eight rounds to its other neighbour -- far inside the tolerance. Reversing an
    even batch moves every request to the other parity."""
    out = kwargs.pop("out", None)
    result = correct_kernel(query, kv_cache, *args, bmm2_scale=bmm2_scale, out=out, **kwargs)
    other = correct_kernel(query, kv_cache, *args, bmm2_scale=bmm2_scale * (1 + 2.0 ** -12), **kwargs)
    for r, o in zip(result, other) if isinstance(result, tuple) else [(result, other)]:  # out (and the LSE)
        r.view(query.shape[0], -1)[1::2] = o.view(query.shape[0], -1)[1::2]
    return result


# small enough for CI's premerge to stay quick; every premerge corner case and relation still runs
position_rounded.mla_verify_envelope = {  # type: ignore[attr-defined]
    "devices": ["cpu"], "max_seq_len": 1024, "max_batch": 16, "heads": [1, 2, 3, 4, 8, 16]}


def position_rounded_claiming_bits(*args: Any, **kwargs: Any) -> Any:
    """``position_rounded``, declaring (wrongly) that every metamorphic relation keeps its bits."""
    return position_rounded(*args, **kwargs)


position_rounded_claiming_bits.mla_verify_envelope = {  # type: ignore[attr-defined]
    **position_rounded.mla_verify_envelope, "bit_invariant": True}  # type: ignore[attr-defined]
