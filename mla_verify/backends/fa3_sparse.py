"""Sparse decode through FlashInfer's dense FA3 MLA wrapper, the way vLLM runs it on Hopper
(``FLASHINFER_MLA_SPARSE_SM90``): pages of one token, each query token's top-k slots as its page list.

- Each query token of each request is its own wrapper request (qo_len 1): ``kv_indices`` holds its valid slots
  in listed order (duplicates kept, -1 and entries at or past ``topk_length`` left out), ``kv_len_arr`` their
  count. The cache is the problem's bf16 values ([slots, 1, 576] split into ckv/kpe views), i.e. the packed cache
  dequantized as FlashMLA's SM90 kernel does -- vLLM upconverts its fp8 cache to bf16 for this path.
- A row with no valid entry is not sent: a page list cannot say "attend to nothing" (FlashInfer would plan a
  0-length request); its out 0 and LSE +inf are filled by this adapter, so such rows test the adapter only.
- ``sm_scale`` = the problem's softmax scale; no sinks (the wrapper has none); LSE in base 2.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..core.platform import flashinfer_unavailable
from ..problems.envelope import SparseEnvelope
from ..problems.layouts import LayoutSpec
from ..problems.sparse import SPARSE_LAYOUT, UNPACKED, SparseDecodeProblem
from .base import Backend, PreparedCall
from .flashinfer_wrapper import FA_HOPPER, WORKSPACE_BYTES

FA3_SPARSE_ENVELOPE = SparseEnvelope(
    devices=("cuda",), archs=FA_HOPPER, formats=("bf16", "V32"), topk_multiple=1, max_topk=2048, max_heads=128,
    q_len=(1, 2), topk_length_formats=("bf16", "V32"), sinks=False, lse_base=2.0,
    notes="FlashInfer BatchMLAPagedAttentionWrapper(backend='fa3'), page_size 1, 576-wide rows (512 + 64 rope); "
          "no attention sink",
)


def token_lists(problem: SparseDecodeProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [n] the non-empty (request, token) rows in order, kv_indptr [n + 1], kv_indices): the valid slots of
    each non-empty row, in listed order."""
    p = problem
    keep = ~p.masked().view(p.batch * p.q_len, -1)
    counts = keep.sum(-1)
    rows = (counts > 0).nonzero().flatten()
    indptr = torch.zeros(rows.numel() + 1, dtype=torch.int32, device=p.query.device)
    indptr[1:] = counts[rows].cumsum(0)
    slots = p.indices.view(p.batch * p.q_len, -1)[rows][keep[rows]]
    return rows, indptr, slots.to(torch.int32)


class Fa3SparseBackend(Backend):
    def __init__(self, name: str = "fa3-sparse", envelope: SparseEnvelope = FA3_SPARSE_ENVELOPE,
                 fi_backend: str = "fa3"):
        self.name, self.envelope, self.fi_backend = name, envelope, fi_backend
        self.widened_formats = tuple(f for f in envelope.formats if f != UNPACKED)  # the pool is bf16 rows
        self.description = "FlashInfer FA3 MLA decode as sparse decode (pages of one token, vLLM's SM90 path)"
        self._workspaces: dict[torch.device, torch.Tensor] = {}

    def unavailable_reason(self, device: torch.device) -> str | None:
        return super().unavailable_reason(device) or flashinfer_unavailable()

    def prepare(self, problem: SparseDecodeProblem, layout: LayoutSpec = SPARSE_LAYOUT) -> PreparedCall:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        p = problem.validate()
        device = p.query.device
        if device not in self._workspaces:
            self._workspaces[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        B, Q, H, D = p.query.shape
        L = p.d_v
        rows, kv_indptr, kv_indices = token_lists(p)
        n = rows.numel()
        pool = p.kv_cache.reshape(-1, 1, D).to(torch.bfloat16)
        ckv, kpe = pool[..., :L], pool[..., L:]
        q = p.query.reshape(B * Q, H, D)[rows]
        q_nope, q_pe = q[..., :L], q[..., L:]
        qo_indptr = torch.arange(n + 1, dtype=torch.int32, device=device)
        kv_len = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)
        wrapper = BatchMLAPagedAttentionWrapper(self._workspaces[device], backend=self.fi_backend)
        if n:
            wrapper.plan(metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len), num_heads=H,
                         head_dim_ckv=L, head_dim_kpe=D - L, page_size=1, causal=False,
                         sm_scale=float(p.softmax_scale), q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                         query_layout="split", kv_cache_layout="split", lse_mode="base2",
                         output_dtype=torch.bfloat16)

        def invoke() -> Any:
            if not n:
                return None
            return wrapper.run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), return_lse=True)

        def to_canonical(result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            out = torch.zeros((B * Q, H, L), dtype=torch.bfloat16, device=device)
            lse = torch.full((B * Q, H), math.inf, dtype=torch.float32, device=device)
            if result is not None:
                out[rows], lse[rows] = result[0], result[1].float()
            return out.view(B, Q, H, L), lse.view(B, Q, H)

        inputs = {"q_nope": q_nope, "q_pe": q_pe, "kv_pool": pool, "kv_indptr": kv_indptr, "kv_indices": kv_indices}
        return PreparedCall(invoke, inputs, None, to_canonical)


def fa3_sparse_backend() -> Fa3SparseBackend:
    return Fa3SparseBackend()
