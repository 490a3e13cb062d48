"""DeepSeek's FlashMLA dense paged decode, bf16 (``flashmla``) and per-tensor fp8 (``flashmla-fp8``).

Read from FlashMLA's public source at commit 9241ae3 (2026-04-29), ``flash_mla/flash_mla_interface.py``,
``csrc/api/dense_decode.h``, ``csrc/sm90/decode/dense/splitkv_mla.cuh``, and from the sgl-flash-mla 1.0.0 wheel's
``flash_mla/flash_mla_interface.py`` (docs/backends.md has the lines). Which interface is installed, and
``use_legacy``, are ``flashmla_api``'s.

- Layout: query ``[B, q_len, H, D]`` (D = 576, or 512 without rope); cache ``[num_blocks, 64, num_heads_k = 1,
  D]`` -- our 3-D pool with a unit head axis after the page axis, a view (page-strided pools too: the row and
  block strides go to the kernel); ``block_table [B, W]`` int32 (any width); ``cache_seqlens [B]`` int32, the
  KV length including the q_len new tokens; ``head_dim_v`` = kv_lora_rank = 512.
- bf16: ``softmax_scale = bmm1_scale``, always passed (FlashMLA's default is 1/sqrt(D)). There is no output
  scale, so ``bmm2_scale`` is the harness's ``output_scale``, applied in float64 when judging.
- fp8 (wheel only, ``is_fp8_kvcache=True``): fp8 e4m3 query and cache, D = 576, out bf16. The kernel computes
  scores = softmax_scale * descale_q * descale_k * q.k and O = softmax . V * descale_k (sgl FlashMLA
  ``flash_fwd_mla_kernel.h``), so the problem's scales are split as an engine splits them: ``descale_k =
  bmm2_scale`` (V's dequant scale and any output scale), ``softmax_scale`` the model's 1/sqrt(nope + rope),
  and ``descale_q`` the rest of bmm1; each a ``(1,)`` fp32 tensor. Its schedule must exist before the first
  call: ``get_mla_decoding_metadata(..., is_fp8_kvcache=True, use_legacy=True)`` assigned to the sched meta.
- ``causal=True``: bottom-right, as ours (FlashMLA's reference masks with ``tril(diagonal=s_k - s_q)``).
- Returns ``(out [B, q_len, H, 512], lse [B, H, q_len])``; out is allocated by FlashMLA (no ``out=``), LSE is
  fp32 in natural log; a row with no keys gets out 0 and LSE +inf. ``cache_seqlens`` 0 (a request with no key)
  is taken by the bf16 path (``empty_lse``; upstream's tests/test_flash_mla_dense_decoding.py draws such
  batches); the fp8 path's legacy kernel is not claimed to take one (its block loop starts at block -1 then).
- Batch order: FlashMLA splits each sequence's KV over SM partitions by a schedule computed from the whole
  batch's lengths, so reversing the batch moves the split points and the bits (not the values): the backends
  claim batch-order invariance within tolerance only (``Envelope.bit_invariant`` leaves "batch" out).
- fp8 arithmetic (``FLASHMLA_FP8_ARITHMETIC``, read from sgl-project/FlashMLA ``csrc/extension/sm90/dense_fp8``):
  QK^T is an fp8 WGMMA with fp32 accumulators (``flash_fwd_mla_kernel.h``: ``TiledMma`` of e4m3 x e4m3 ->
  float, K = 576 in 32-wide steps); ``scale_softmax = softmax_scale * descale_q * descale_k`` in fp32
  (``flash_fwd_splitkv_mla_kernel``); the 64-key blocks of a split are visited last first (``n_block =
  n_block_max - 1``, ``--n_block``), each with the running max, P = exp2(s * scale_log2 - max * scale_log2) in
  fp32 and the row sum of that fp32 P (``softmax.h``: ``softmax``, ``reduce_sum``); P is converted to e4m3
  (``convert_type_out(tOrP_acc, tOrP)``) and P.V is an fp8 WGMMA accumulating into the running output
  (``gemm</*zero_init=*/false>(tiled_mma_o, tOrP, tOrVt, tOrO)`` after ``rescale_o``); a split ends with
  O *= descale_k / row_sum, LSE = row_max * scale_softmax + log(row_sum) (``normalize_softmax_lse``), and the
  splits are merged in fp32 by their LSE (``flash_fwd_splitkv_mla_combine_kernel``), then bf16. The schedule is
  ``get_mla_metadata_kernel``'s (``flash_fwd_mla_metadata.cu``), ported in ``flashmla_fp8_splits``.

The callables are injected (``FlashMLAApi``): the real ``flash_mla`` functions by default, or a stand-in with
either interface (``mla_verify.kernels.flashmla_cpu``), which is how the layout code above is proven on CPU.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..core.dims import softmax_scale as model_softmax_scale
from ..problems.arithmetic import SCALE_ON_SCORES, Accumulator, Arithmetic
from ..problems.generate import ProblemSpec
from ..problems.layouts import LayoutSpec, trtllm_args
from ..problems.metamorphic import BATCH_ORDER, RELATIONS
from ..problems.problem import DecodeProblem
from .base import Backend, Envelope, PreparedCall
from .flashmla_api import FlashMLAApi, flashmla_unavailable, installed_api, needs_wheel

NO_ROPE_DIMS = (512, 0)
FLASHMLA_ENVELOPE = Envelope(
    devices=("cuda",), archs=((9, 0),), page_sizes=(64,), dims=((512, 64), NO_ROPE_DIMS), heads=None,
    max_heads=128, dtypes=("bf16",), q_len=(1, 16), cache_dims=(3,), page_strided=True,
    table_widths=("native", "pad128"), pass_out=(False,), lse=True, lse_base=math.e, empty_lse=math.inf,
    bit_invariant=tuple(r for r in RELATIONS if r != BATCH_ORDER),  # the schedule depends on the whole batch
    notes="dense_decode: SM90a, bf16/fp16 (fp16 out is not Contract 1's bf16), page 64, head_size_k 576 or "
          "512, head_dim_v 512, h_q % h_k == 0; one layout [blocks, 64, 1, D] whatever cache_dims says; "
          "FlashMLA allocates out; natural-log LSE [B, H, q_len]; cache_seqlens 0 taken (out 0, LSE +inf: "
          "upstream's tests draw them, have_zero_seqlen_k)",
)
FLASHMLA_FP8_ENVELOPE = FLASHMLA_ENVELOPE.narrowed(
    dims=((512, 64),), dtypes=("fp8",), empty_lse=None,
    notes="sgl-flash-mla's dense fp8 (fwd_kvcache_mla_fp8): SM90, fp8 e4m3 query and cache [blocks, 64, 1, 576] "
          "with per-tensor descale_q/descale_k (1,) fp32, head_size_k 576 only, bf16 out, natural-log LSE")
BLOCK_N, BLOCK_M, FIXED_OVERHEAD_BLOCKS = 64, 64, 5  # flash_fwd_mla_metadata.cu / dense_fp8_python_api.cpp


def flashmla_fp8_splits(seq_lens: Sequence[int], rows: int, sm_count: int) -> list[list[tuple[int, int]]]:
    """The dense fp8 kernel's split-KV schedule (``get_mla_metadata_kernel``): (start, end) keys of each split of
    each request, for ``rows`` query rows per KV head (q_len * heads) on ``sm_count`` SMs. The batch's blocks plus
    a fixed overhead per request are dealt out to ``sm_count / ceil(rows / 64)`` partitions in order, each taking
    a payload of ceil(total / partitions) + 5 blocks: a request that does not fit the rest of one partition's
    payload is split there."""
    parts = sm_count // -(-rows // BLOCK_M)
    blocks = [-(-n // BLOCK_N) for n in seq_lens]
    payload = -(-sum(n + FIXED_OVERHEAD_BLOCKS for n in blocks) // parts) + FIXED_OVERHEAD_BLOCKS
    splits: list[list[tuple[int, int]]] = [[] for _ in seq_lens]
    i = begin = 0
    for _ in range(parts):
        left = payload
        while i < len(blocks):
            if left >= blocks[i] - begin + FIXED_OVERHEAD_BLOCKS:  # the rest of request i fits this partition
                splits[i].append((begin * BLOCK_N, seq_lens[i]))
                left -= blocks[i] - begin + FIXED_OVERHEAD_BLOCKS
                i, begin = i + 1, 0
            else:
                if left > FIXED_OVERHEAD_BLOCKS:
                    splits[i].append((begin * BLOCK_N, (begin + left - FIXED_OVERHEAD_BLOCKS) * BLOCK_N))
                    begin += left - FIXED_OVERHEAD_BLOCKS
                break
    return splits


def splits_from_metadata(metadata: Sequence[Sequence[int]], seq_lens: Sequence[int]) -> list[list[tuple[int, int]]]:
    """(start, end) keys of each request's splits, read from the tile scheduler metadata a schedule returned: each SM
    partition's (begin_idx, begin_seqlen, end_idx, end_seqlen, ...); a partition with no work starts past the
    batch."""
    splits: list[list[tuple[int, int]]] = [[] for _ in seq_lens]
    for begin, begin_len, end, end_len, *_ in metadata:
        if 0 <= begin < len(seq_lens):
            for b in range(begin, end + 1):
                splits[b].append((begin_len if b == begin else 0, end_len if b == end else seq_lens[b]))
    return splits


# What the dense fp8 kernel rounds (the module docstring has the source). The accumulator model is Hopper's fp8
# WGMMA as benchmarks/flashmla_fp8_analysis.py measured it against the wheel on an H100.
FLASHMLA_FP8_ARITHMETIC = Arithmetic(
    "FlashMLA dense fp8", scale=SCALE_ON_SCORES, qk=Accumulator(), p_dtype="e4m3", p_block=BLOCK_N,
    pv=Accumulator(), splits=flashmla_fp8_splits)


@dataclass
class FlashMLAArgs:
    q: torch.Tensor  # [B, q_len, H, D]
    k_cache: torch.Tensor  # [num_blocks, page, 1, D], a view of `pool`
    block_table: torch.Tensor  # [B, W] int32
    cache_seqlens: torch.Tensor  # [B] int32
    pool: torch.Tensor


def flashmla_args(problem: DecodeProblem, layout: LayoutSpec) -> FlashMLAArgs:
    """FlashMLA's inputs: the trtllm-style 3-D cache (strided or not) with a unit KV-head axis added."""
    a = trtllm_args(problem, replace(layout, cache_dims=3))
    return FlashMLAArgs(a.query, a.kv_cache.unsqueeze(2), a.block_tables, a.seq_lens, a.pool)


def fp8_scales(problem: DecodeProblem) -> tuple[float, float, float]:
    """(softmax_scale, descale_q, descale_k) whose products are the problem's bmm1 and bmm2 (module docstring)."""
    softmax = model_softmax_scale(problem.dims)
    descale_k = float(problem.bmm2_scale)
    return softmax, float(problem.bmm1_scale) / (softmax * descale_k), descale_k


class FlashMLABackend(Backend):
    """FlashMLA's dense decode through ``api`` (the installed ``flash_mla`` when None); ``fp8``: its per-tensor
    fp8 path, which only the sgl-flash-mla interface has."""

    arithmetic = {"fp8": FLASHMLA_FP8_ARITHMETIC}

    def __init__(self, name: str = "flashmla", api: FlashMLAApi | None = None,
                 envelope: Envelope = FLASHMLA_ENVELOPE,
                 description: str = "DeepSeek FlashMLA dense paged MLA decode (SM90)", fp8: bool = False):
        self.name = name
        self.api = api
        self.envelope = envelope
        self.description = description
        self.fp8 = fp8

    def unavailable_reason(self, device: torch.device) -> str | None:
        reason = flashmla_unavailable(self.api, self.envelope, device)
        return needs_wheel(self.api, "dense fp8 decode") if reason is None and self.fp8 else reason

    def why_not(self, spec: ProblemSpec, layout: LayoutSpec, device: torch.device) -> str | None:
        reason = super().why_not(spec, layout, device)
        if reason is None and spec.qk_rope_head_dim == 0 and not (self.api or installed_api()).use_legacy:
            # upstream's SM90 kernel FLASH_ASSERTs head dim 576 (splitkv_mla.cuh:1277), which exits the process;
            # the wheel's legacy kernel is built for 512 and 576 (its Traits<bf16, 512> and <bf16, 576>)
            reason = "upstream FlashMLA's SM90 dense kernel takes head dim 576 only (dims (512, 64))"
        return reason

    def prepare(self, problem: DecodeProblem, layout: LayoutSpec) -> PreparedCall:
        p = problem
        api = self.api or installed_api()
        a = flashmla_args(p, layout)
        heads_k = a.k_cache.shape[2]
        tokens_per_head_k = p.q_len * p.num_heads // heads_k
        kwargs: dict[str, Any] = dict(causal=True, **api.call_kwargs())
        inputs = {"q": a.q, "kv_pool": a.pool, "block_table": a.block_table, "cache_seqlens": a.cache_seqlens}
        if self.fp8:
            metadata, num_splits = api.fp8_schedule(a.cache_seqlens, tokens_per_head_k, heads_k), None
            softmax, descale_q, descale_k = fp8_scales(p)
            kwargs.update(softmax_scale=softmax, is_fp8_kvcache=True,
                          descale_q=torch.tensor([descale_q], dtype=torch.float32, device=p.device),
                          descale_k=torch.tensor([descale_k], dtype=torch.float32, device=p.device))
            output_scale = 1.0  # descale_k carries bmm2 into the kernel
        else:
            metadata, num_splits = api.schedule(a.cache_seqlens, tokens_per_head_k, heads_k)
            kwargs.update(softmax_scale=float(p.bmm1_scale))
            output_scale = float(p.bmm2_scale)  # no output scale in FlashMLA: applied when judged

        def invoke() -> Any:
            return api.flash_mla_with_kvcache(a.q, a.k_cache, a.block_table, a.cache_seqlens, p.dims.kv_lora_rank,
                                              metadata, num_splits, **kwargs)

        def to_canonical(result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            out, lse = result  # lse [B, H, q_len] -> [B, q_len, H]
            return out, lse.transpose(1, 2) if layout.return_lse else None

        return PreparedCall(invoke, inputs, None, to_canonical, output_scale=output_scale)


def flashmla_backends() -> list[FlashMLABackend]:
    return [FlashMLABackend(),
            FlashMLABackend("flashmla-fp8", envelope=FLASHMLA_FP8_ENVELOPE, fp8=True,
                            description="DeepSeek FlashMLA dense fp8 decode, per-tensor scales (sgl-flash-mla, SM90)")]
