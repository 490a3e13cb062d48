"""Backends with the calling convention of FlashInfer's trtllm_batch_decode_with_kv_cache_mla (Contract 1).

The same adapter serves FlashInfer's trtllm-gen / cute-dsl / xqa paths, user kernels (``--kernel``), the CPU
peer and the mutants, so every one of them is called with exactly the arguments trtllm-gen receives.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..problems.layouts import LayoutSpec, trtllm_args
from ..problems.problem import DecodeProblem
from .base import LSE_BASE_2, Backend, Envelope, PreparedCall

# trtllm-gen's documented envelope (FlashInfer 0.7.x), the default for any kernel with this convention.
TRTLLM_ENVELOPE = Envelope(
    devices=("cuda", "cpu"),
    page_sizes=(32, 64),
    dims=((512, 64), (256, 64)),
    heads=tuple(range(1, 65)) + (128,),
    dtypes=("bf16", "fp8"),
    q_len=(1, 16),
    cache_dims=(3, 4),
    page_strided=True,
    table_widths=("native", "pad128"),
    pass_out=(True, False),
    lse=True,
    lse_base=LSE_BASE_2,
    max_batch=1024,
    max_seq_len=1 << 17,
)

WORKSPACE_BYTES = {"cuda": 128 << 20, "cpu": 1 << 20}  # trtllm-gen wants 128 MiB, zeroed on first use


def make_workspace(device: torch.device) -> torch.Tensor:
    return torch.zeros(WORKSPACE_BYTES.get(device.type, 1 << 20), dtype=torch.int8, device=device)


def split_lse(lse: torch.Tensor, batch: int, q_len: int) -> torch.Tensor:
    """trtllm-style LSE [B*q_len, H] -> [B, q_len, H]."""
    return lse.reshape(batch, q_len, -1)


class TrtllmStyleBackend(Backend):
    """Calls ``fn(query, kv_cache, workspace, qk_nope, kv_lora_rank, rope, block_tables, seq_lens,
    max_seq_len, out=, bmm1_scale=, bmm2_scale=, return_lse=, **extra_kwargs)``."""

    def __init__(self, name: str, fn: Callable[..., Any], envelope: Envelope = TRTLLM_ENVELOPE,
                 description: str = "", extra_kwargs: dict[str, Any] | None = None):
        self.name = name
        self.fn = fn
        self.envelope = envelope
        self.description = description
        self.extra_kwargs = dict(extra_kwargs or {})
        self._workspaces: dict[torch.device, torch.Tensor] = {}

    def workspace(self, device: torch.device) -> torch.Tensor:
        if device not in self._workspaces:
            self._workspaces[device] = make_workspace(device)
        return self._workspaces[device]

    def prepare(self, problem: DecodeProblem, layout: LayoutSpec) -> PreparedCall:
        a = trtllm_args(problem, layout)
        d = problem.dims
        B, Q, H = problem.batch, problem.q_len, problem.num_heads
        out = None
        if layout.pass_out:
            out = torch.empty((B, Q, H, d.kv_lora_rank), dtype=torch.bfloat16, device=problem.device)
        kwargs = dict(out=out, bmm1_scale=problem.bmm1_scale, bmm2_scale=problem.bmm2_scale,
                      return_lse=layout.return_lse, **self.extra_kwargs)
        workspace = self.workspace(problem.device)

        def invoke() -> Any:
            return self.fn(a.query, a.kv_cache, workspace, d.qk_nope_head_dim, d.kv_lora_rank,
                           d.qk_rope_head_dim, a.block_tables, a.seq_lens, a.max_seq_len, **kwargs)

        def to_canonical(result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            if layout.return_lse:
                if not (isinstance(result, (tuple, list)) and len(result) == 2):
                    raise TypeError(f"return_lse=True must return (out, lse), got {type(result).__name__}")
                o, lse = result
                return o, split_lse(lse, B, Q)
            if isinstance(result, (tuple, list)):
                raise TypeError("return_lse=False must return out alone, got a tuple")
            return result, None

        inputs = {"query": a.query, "kv_pool": a.pool, "block_tables": a.block_tables, "seq_lens": a.seq_lens}
        return PreparedCall(invoke, inputs, out, to_canonical)
