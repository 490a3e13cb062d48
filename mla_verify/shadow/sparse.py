"""Shadow mode's reading of FlashMLA's sparse calls, ``flash_mla_with_kvcache(..., indices=...)``, as the canonical
sparse problem (problems/sparse.py) that judge.py holds the kernel's result to.

Before the kernel runs: every index must be -1 or a slot of the pool (the kernel masks -1 only: anything else
would be an out-of-bounds read, a blocking error); a V3.2-width query's ``softmax_scale`` is checked against the
softmax conventions (FlashMLA's default, 1/sqrt(576), is the absorbed width's mistake); then the problem is built
from the pages the indices touch -- every index that is not -1, past ``topk_length`` too -- and the pool's last
page (where a -1 read as slot -1 lands): those pages are copied and, for a packed cache, dequantized as the SM90
kernel does (problems/packed.py), and the indices renumbered into that smaller pool. A call so costs a gather of
at most ``B * q_len * topk`` pages, not a pass over the engine's pool; the one diagnosis that needs the whole
pool (an index read as a page id) cannot name its misreading here.

The cache is ``[blocks, page, 1, bytes]``: 656-byte rows are V3.2, 584 V4 (the sgl wheel's reading), others
need ``kv_format``; a bf16 cache of 576-value rows is read as it is. LSE: ``[B, h_q, s_q]``, natural log.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..backends.flashmla_sparse import WHEEL_FORMAT_BY_BYTES
from ..core.errors import ProblemError
from ..problems.packed import FORMATS, dequantize
from ..problems.sparse import UNPACKED, SparseDecodeProblem
from .contract import (
    Finding,
    KernelContract,
    ModelFacts,
    check_softmax_scale,
    sparse_index_findings,
    validation_finding,
)
from .entries import LN_BASE, LiveCall, result_parts, scalar

V32_WIDTH = 576  # a query this wide is DeepSeek V3.2's (latent 512 + rope 64): its softmax scale is checked
UNREAD = (("extra_k_cache", "extra KV scopes"), ("extra_indices_in_kvcache", "extra KV scopes"))


def read_flashmla_sparse(values: Mapping[str, Any], facts: ModelFacts = ModelFacts()) -> LiveCall | None:
    """The call as a sparse LiveCall; None when it is not sparse (no ``indices``)."""
    indices, cache, q = values.get("indices"), values.get("k_cache"), values.get("q")
    if not isinstance(indices, torch.Tensor):
        return None
    contract = KernelContract("flash_mla_with_kvcache(indices=...)", lse_base=LN_BASE)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or not isinstance(q, torch.Tensor):
        return LiveCall(None, contract, unchecked="no q or 4-D k_cache in the sparse call")
    found = sparse_index_findings(indices, cache.shape[0] * cache.shape[1],
                                  "FlashMLA masks -1 only and would read outside k_cache")
    if found:
        return LiveCall(None, contract, findings=found, unchecked="indices outside the pool")
    for name, form in UNREAD:
        if values.get(name) is not None:
            return LiveCall(None, contract, unchecked=f"{form} ({name}) are not computed by the sparse reference")
    fmt, why = cache_format(cache, values.get("kv_format"))
    if fmt is None:
        return LiveCall(None, contract, unchecked=why)
    scale = q.shape[-1] ** -0.5 if values.get("softmax_scale") is None else scalar(values["softmax_scale"])
    if q.shape[-1] == V32_WIDTH:
        found += check_softmax_scale(scale, 512, V32_WIDTH - 512, facts)
    try:
        problem = live_sparse_problem(q, cache, fmt, indices, values.get("topk_length"), values.get("attn_sink"),
                                      scale)
    except ProblemError as error:
        return LiveCall(None, contract, findings=[*found, validation_finding(error)],
                        unchecked="the call cannot be read as a sparse problem")

    def to_canonical(result: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, list[Finding]]:
        out, lse, parts = result_parts(result, None, True, "(out, softmax_lse)")
        return out, None if lse is None else lse.transpose(1, 2), parts

    return LiveCall(None, contract, return_lse=True, to_canonical=to_canonical, replay="flashmla-sparse",
                    findings=found, sparse=problem)


def cache_format(cache: torch.Tensor, kv_format: Any) -> tuple[str | None, str]:
    """(the format name -- problems.sparse.UNPACKED for bf16 --, or None and why the cache is not read)."""
    if cache.dtype == torch.bfloat16:
        return UNPACKED, ""
    if cache.element_size() != 1:
        return None, f"a {cache.dtype} k_cache is not read (packed uint8/fp8 rows or bf16 values are)"
    width = cache.shape[-1]
    name = kv_format if kv_format is not None else WHEEL_FORMAT_BY_BYTES.get(width)
    if name is None:
        return None, (f"{width}-byte rows without kv_format: FlashMLA reads them as V4.1, which the sparse "
                      "reference does not read (a V3.2-no-RoPE cache needs kv_format='V32_NO_ROPE')")
    if name not in FORMATS or FORMATS[name].bytes_per_token != width:
        return None, f"kv_format={name!r} with {width}-byte rows is not one of {sorted(FORMATS)} at its width"
    if not FORMATS[name].page_level and cache.shape[1] > 1 and cache.stride(1) != width:
        return None, f"the token rows of k_cache are {cache.stride(1)} bytes apart, not {width}: not read"
    return name, ""


def live_sparse_problem(q: torch.Tensor, cache: torch.Tensor, fmt: str, indices: torch.Tensor,
                        topk_length: torch.Tensor | None, attn_sink: torch.Tensor | None,
                        softmax_scale: float) -> SparseDecodeProblem:
    """The validated problem over the pages ``indices`` touch and the pool's last page, renumbered; ProblemError
    if the call's tensors do not make one. ``indices`` must already be -1 or inside the pool."""
    P, page = cache.shape[:2]
    listed = indices[indices >= 0].long() // page
    pages = torch.unique(torch.cat([listed, torch.tensor([P - 1], device=listed.device)]))  # ascending
    idx = indices.long()
    renumbered = torch.searchsorted(pages, idx.clamp_min(0) // page) * page + idx.clamp_min(0) % page
    new_indices = torch.where(idx >= 0, renumbered, -1).to(torch.int32) if indices.dtype == torch.int32 \
        else indices  # another dtype: validate() names it
    packed = None
    if fmt == UNPACKED:
        kv = cache[pages][:, :, 0]
    else:
        spec = FORMATS[fmt]
        raw = cache.view(torch.uint8).as_strided((P, page * spec.bytes_per_token), (cache.stride(0), 1))
        packed = raw[pages]
        kv = dequantize(packed, spec, page, "sm90")
    return SparseDecodeProblem(q, kv, new_indices, float(softmax_scale), topk_length, attn_sink, fmt,
                               packed).validate()


def describe_sparse(p: SparseDecodeProblem) -> str:
    """One line for a report: the call's shape and what it masks."""
    masked = p.masked()
    return (f"sparse {p.fmt} B={p.batch} q_len={p.q_len} H={p.num_heads} topk={p.indices.shape[-1]} "
            f"page={p.page_size} pages read={p.kv_cache.shape[0]} masked={float(masked.float().mean()):.0%} "
            f"topk_length={'given' if p.topk_length is not None else 'none'} "
            f"sink={'given' if p.attn_sink is not None else 'none'} scale={p.softmax_scale:.6g}")
