"""The CPU peer: an independent, kernel-style PyTorch MLA decode with Contract 1's signature.

It works the way the GPU kernels do, not the way the reference does: the KV range is cut into fixed-size
splits (``TOKENS_PER_SPLIT`` tokens); each split gathers its pages through the block table, computes
fp32 scores and a partial softmax state (output normalised within the split, plus its LSE), and the states
are merged by LSE, split after split, as FlashInfer's merge_state does. Inputs are read in their own dtype
(bf16 or fp8) and widened to fp32; the output is rounded to bf16 once, at the end. So a CPU-only machine
verifies a real, non-trivial implementation -- split-KV merging, paging, causal limits, both cache ranks --
instead of the reference against itself. It shares no code with ``reference.py``.
"""
from __future__ import annotations

import math

import torch

from ..problems.layouts import canonical_cache
from .base import LSE_BASE_2, Envelope
from .trtllm_style import TrtllmStyleBackend

TOKENS_PER_SPLIT = 256
_LOG2E = 1.0 / math.log(2.0)


def cpu_peer_decode(query: torch.Tensor, kv_cache: torch.Tensor, workspace_buffer: torch.Tensor | None,
                    qk_nope_head_dim: int, kv_lora_rank: int, qk_rope_head_dim: int,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                    out: torch.Tensor | None = None, bmm1_scale: float = 1.0, bmm2_scale: float = 1.0,
                    return_lse: bool = False, *, tokens_per_split: int = TOKENS_PER_SPLIT, **_: object):
    """Contract 1 (docs/contracts.md). ``workspace_buffer`` and ``qk_nope_head_dim`` are accepted and unused;
    ``max_seq_len`` bounds the splits, as kernels use it for scheduling. Returns ``out`` or ``(out, lse)``
    with LSE ``[B*q_len, H]`` fp32 in base 2."""
    cache = canonical_cache(kv_cache)  # [P, page, D] view, also of a 4-D [P, 1, page, D] cache
    B, Q, H, D = query.shape
    L, page, width = kv_lora_rank, cache.shape[1], block_tables.shape[1]
    q = query.float().reshape(B, Q * H, D)
    lens = seq_lens.long()
    # query token i of a request sees KV positions <= seq_len - Q + i
    last_visible = (lens[:, None] - Q + torch.arange(Q, device=query.device)[None, :])
    acc_out = torch.zeros((B, Q * H, L), dtype=torch.float32, device=query.device)
    acc_lse = torch.full((B, Q * H, 1), float("-inf"), dtype=torch.float32, device=query.device)
    for start in range(0, max_seq_len, tokens_per_split):
        active = (lens > start).nonzero().squeeze(1)
        if active.numel() == 0:
            break
        pos = start + torch.arange(tokens_per_split, device=query.device)
        valid = pos[None, :] < lens[active, None]  # [A, T]
        pages = block_tables[active][:, (pos // page).clamp(max=width - 1)]
        pages = torch.where(valid, pages, 0).long()  # never follow a padding entry of the table
        rows = cache[pages, (pos % page)[None, :]].float()  # [A, T, D]
        rows = rows.masked_fill(~valid[..., None], 0.0)  # the NaN in unowned slots must not leak
        o, lse = _split_state(q[active], rows, L, bmm1_scale,
                              hidden=pos[None, None, :] > last_visible[active][:, :, None], heads=H)
        acc_out[active], acc_lse[active] = _merge(acc_out[active], acc_lse[active], o, lse)
    result = (acc_out * bmm2_scale).view(B, Q, H, L).to(torch.bfloat16)
    if out is None:
        out = result
    else:
        out.copy_(result)
    if not return_lse:
        return out
    return out, (acc_lse * _LOG2E).reshape(B * Q, H)


def _split_state(q: torch.Tensor, rows: torch.Tensor, L: int, scale: float, hidden: torch.Tensor,
                 heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One split's normalised partial output [A, Q*H, L] and its natural-log LSE [A, Q*H, 1]."""
    A, QH, T = q.shape[0], q.shape[1], rows.shape[1]
    s = torch.bmm(q, rows.transpose(1, 2)) * scale  # [A, Q*H, T] fp32
    s = s.view(A, QH // heads, heads, T).masked_fill(hidden[:, :, None, :], float("-inf")).view(A, QH, T)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)  # a row with no visible token in this split
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    o = torch.bmm(p, rows[..., :L]) / denom.clamp_min(torch.finfo(torch.float32).tiny)
    return o, m + torch.log(denom)  # log(0) = -inf: an empty split carries no weight


def _merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two softmax states (FlashInfer's merge_state). Token 0 is visible to every query row, so after
    the first split the running LSE is finite and the weights never see -inf - -inf."""
    lse = torch.logaddexp(lse_a, lse_b)
    return o_a * torch.exp(lse_a - lse) + o_b * torch.exp(lse_b - lse), lse


CPU_PEER_ENVELOPE = Envelope(
    devices=("cpu", "cuda"), archs=None, page_sizes=None, dims=((512, 64), (256, 64)), heads=None, max_heads=128,
    dtypes=("bf16", "fp8"), q_len=(1, 16), cache_dims=(3, 4), page_strided=True,
    table_widths=("native", "pad128"), pass_out=(True, False), lse=True, lse_base=LSE_BASE_2, empty_lse=-math.inf,
    notes="independent split-KV PyTorch implementation (fp32 accumulation, LSE merge); slow on long sequences; "
          "a request of kv_len 0 runs no split: out 0, LSE -inf",
)


def cpu_peer_backend() -> TrtllmStyleBackend:
    return TrtllmStyleBackend("cpu-peer", cpu_peer_decode, CPU_PEER_ENVELOPE,
                              "independent kernel-style PyTorch MLA decode (split-KV, LSE merge)")
