"""fa3-as-sparse's layout code on CPU: ``Fa3SparseBackend.prepare`` against a stand-in for FlashInfer's
``BatchMLAPagedAttentionWrapper`` that computes what the wrapper's contract says (each request attends to the
pages -- here single tokens -- its CSR list names; out [requests, H, 512], LSE base 2). The rows with no valid
entry, topk_length, duplicates and q_len > 1 must all come back to the canonical form the reference gives."""
from __future__ import annotations

import math

import flashinfer.mla
import pytest
import torch

from mla_verify.backends.fa3_sparse import Fa3SparseBackend
from mla_verify.kinds.sparse import SPARSE_KIND
from mla_verify.problems.sparse import SparseSpec, build_sparse_problem


class WrapperStandIn:
    def __init__(self, workspace: torch.Tensor, backend: str):
        assert backend == "fa3"

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, sm_scale, lse_mode, **_):
        assert page_size == 1 and lse_mode == "base2" and (head_dim_ckv, head_dim_kpe) == (512, 64)
        self.meta, self.scale = metadata, sm_scale

    def run(self, *, query, kv_cache, return_lse):
        (q_nope, q_pe), (ckv, kpe) = query, kv_cache
        q = torch.cat([q_nope, q_pe], -1).float()
        rows = torch.cat([ckv, kpe], -1)[:, 0].float()  # [pages of one token, 576]
        indptr, indices = self.meta.kv_indptr.tolist(), self.meta.kv_indices.long()
        out = torch.empty(q.shape[0], q.shape[1], 512)
        lse = torch.empty(q.shape[0], q.shape[1])
        for r in range(q.shape[0]):
            kv = rows[indices[indptr[r]:indptr[r + 1]]]
            s = q[r] @ kv.T * self.scale
            lse[r] = torch.logsumexp(s, -1) / math.log(2)
            out[r] = torch.softmax(s, -1) @ kv[:, :512]
        return out.to(torch.bfloat16), lse


@pytest.mark.parametrize("spec", [
    SparseSpec(batch=3, q_len=2, num_heads=4, topk=37, page_size=1, used_pages=80, fmt="bf16", duplicates=True,
               topk_lengths=(20, 0, 37), invalid=0.3),
    SparseSpec(batch=2, num_heads=2, topk=64, page_size=16, used_pages=4, fmt="V32", scales="amax",
               invalid_front=True),
], ids=["bf16 ragged", "v32 front"])
def test_prepare_gives_the_reference_through_the_wrapper_contract(spec, monkeypatch):
    monkeypatch.setattr(flashinfer.mla, "BatchMLAPagedAttentionWrapper", WrapperStandIn)
    problem = build_sparse_problem(spec)
    call = Fa3SparseBackend().prepare(problem)
    out, lse = call.judged(call.invoke())
    assert lse is not None
    assert SPARSE_KIND.judge_output(problem, out, lse, 2.0)[1] == []
