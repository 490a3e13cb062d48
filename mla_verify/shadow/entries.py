"""How shadow mode reads each entry point's live call: its bound arguments -> a ``LiveCall`` in Contract 1's terms.

- any Contract-1 kernel (docs/contracts.md) registered with the shadow: its declared envelope, if any, is its contract;
- ``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla`` (FlashInfer 0.7.x): Contract 1 plus ``backend=``,
  ``return_lse_base=`` and the forms the reference does not compute (sparse, compact variable-q, sinks, ...),
  which are counted as seen but not checked;
- DeepSeek's ``flash_mla.flash_mla_with_kvcache``: [blocks, page, 1, D] cache, softmax_scale defaulting to
  1/sqrt(head_dim of q), LSE [B, H, s_q] in natural log; dense bf16, and the sgl-flash-mla wheel's dense fp8
  with descale_q/descale_k; a ``FlashMLASchedMeta`` reused for other shapes or lengths (a stale schedule), and
  sparse-only arguments the dense path ignores, are reported.
- FlashMLA's sparse calls, ``flash_mla_with_kvcache(..., indices=...)`` (``read_flashmla_sparse``): every index
  must be -1 or a slot of the pool (the kernel masks -1 only: anything else would be an out-of-bounds read, a
  blocking error); a V3.2-width query's ``softmax_scale`` is checked against the softmax conventions (FlashMLA's
  default, 1/sqrt(576), is the absorbed width's mistake); then the call is read as a sparse problem over the pages
  its indices touch (problem.py's ``live_sparse_problem``). The cache is ``[blocks, page, 1, bytes]``: 656-byte
  rows are V3.2, 584 V4 (the sgl wheel's reading), others need ``kv_format``; a bf16 cache of 576-value rows is
  read as it is. LSE: ``[B, h_q, s_q]``, natural log.
The wrapper's plan/run pair is read in wrapper.py. Nothing here calls a kernel or changes a tensor.
"""
from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends.flashinfer_trtllm import CUTE_DSL_ENVELOPE, TRTLLM_GEN_ENVELOPE, XQA_ENVELOPE
from ..backends.flashmla import FLASHMLA_ENVELOPE, FLASHMLA_FP8_ARITHMETIC
from ..backends.flashmla_sparse import WHEEL_FORMAT_BY_BYTES
from ..backends.trtllm_style import split_lse
from ..core.bits import same_bits
from ..core.errors import ProblemError
from ..problems.arithmetic import DEFAULT, Arithmetic
from ..problems.packed import FORMATS
from ..problems.problem import FP8
from ..problems.sparse import UNPACKED, SparseDecodeProblem
from .contract import (
    ERROR,
    WARNING,
    Finding,
    KernelContract,
    ModelFacts,
    PagedArgs,
    check_softmax_scale,
    sparse_index_findings,
    validation_finding,
)
from .problem import live_sparse_problem

Canonical = Callable[[Any], "tuple[torch.Tensor | None, torch.Tensor | None, list[Finding]]"]
CONTRACT1_ORDER = ("query", "kv_cache", "workspace_buffer", "qk_nope_head_dim", "kv_lora_rank", "qk_rope_head_dim",
                   "block_tables", "seq_lens", "max_seq_len")
LN_BASE = math.e


@dataclass
class LiveCall:
    """One intercepted call read in the suite's terms. ``args`` None: a form the shadow does not read as a dense
    paged problem -- a sparse call then carries its problem in ``sparse``, built before the kernel runs."""

    args: PagedArgs | None
    contract: KernelContract
    pass_out: bool = False
    return_lse: bool = False
    to_canonical: Canonical | None = None  # kernel result -> (out [B, q, H, L], lse [B, q, H] or None, findings)
    replay: str | None = None  # the backend or MODULE:ATTR that `mla-verify replay` re-runs it with
    unchecked: str | None = None  # why its numbers are not checked
    findings: list[Finding] = field(default_factory=list)
    table_width: str | None = None  # LayoutSpec.table_width override (CSR metadata is never padded)
    sparse: SparseDecodeProblem | None = None
    arithmetic: Arithmetic = DEFAULT  # what the kernel rounds: the baseline emulates it (problems/arithmetic.py)


def bind_arguments(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """Argument name -> value with defaults applied (``**kwargs`` flattened); None if they do not bind."""
    if signature is None:  # a callable without a signature: Contract 1's positional order
        return {**dict(zip(CONTRACT1_ORDER, args)), **kwargs}
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    values = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            values.update(values.pop(name, {}))
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            values.pop(name, None)
    return values


def signature_of(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def scalar(value: Any) -> float:
    """A scale given as a number or a one-element tensor (read back from the device)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def result_parts(result: Any, out_buffer: torch.Tensor | None, return_lse: bool,
                 lse_shape: str = "(out, lse)") -> tuple[torch.Tensor | None, torch.Tensor | None, list[Finding]]:
    """(output, raw lse, findings) of a kernel's result: the return form, and `out` written in place AND returned."""
    found: list[Finding] = []
    lse = None
    if return_lse:
        if isinstance(result, (tuple, list)) and len(result) == 2:
            out, lse = result
        else:
            found.append(Finding(ERROR, "result", f"LSE was requested, but the kernel returned "
                                 f"{type(result).__name__}, not {lse_shape}"))
            out = result if isinstance(result, torch.Tensor) else None
    elif isinstance(result, (tuple, list)):
        found.append(Finding(ERROR, "result", f"returned a {type(result).__name__} though no LSE was requested"))
        out = result[0] if result and isinstance(result[0], torch.Tensor) else None
    else:
        out = result if isinstance(result, torch.Tensor) else None
    if out_buffer is None:
        if out is None:
            found.append(Finding(ERROR, "result", f"returned {type(result).__name__} and was given no `out` "
                                 "buffer: the result is lost"))
        return out, lse, found
    if out is None:
        found.append(Finding(ERROR, "out", f"the kernel wrote `out` in place but returned {type(result).__name__}: "
                             "a caller that uses the return value gets no output"))
        return out_buffer, lse, found
    if out.data_ptr() != out_buffer.data_ptr() and not same_bits(out, out_buffer):
        found.append(Finding(ERROR, "out", "the kernel returned a new tensor and left the `out` buffer without its "
                             "result: a caller that reads its `out` buffer sees stale values"))
    return out, lse, found


def read_contract1(values: Mapping[str, Any], contract: KernelContract, replay: str | None,
                   out_shape: tuple[int, ...] | None = None) -> LiveCall:
    """A call with Contract 1's arguments (a registered kernel, or FlashInfer's functional entry point)."""
    missing = [name for name in CONTRACT1_ORDER if name != "workspace_buffer" and values.get(name) is None]
    if missing:
        return LiveCall(None, contract, unchecked=f"no {', '.join(missing)} in the call")
    query, out = values["query"], values.get("out")
    return_lse = bool(values.get("return_lse", False))
    args = PagedArgs(query=query, kv_cache=values["kv_cache"], block_table=values["block_tables"],
                     seq_lens=values["seq_lens"], kv_lora_rank=int(values["kv_lora_rank"]),
                     qk_rope_head_dim=int(values["qk_rope_head_dim"]),
                     bmm1_scale=scalar(values.get("bmm1_scale", 1.0)), bmm2_scale=scalar(values.get("bmm2_scale", 1.0)),
                     qk_nope_head_dim=int(values["qk_nope_head_dim"]), max_seq_len=int(values["max_seq_len"]),
                     out=out, out_shape=out_shape)

    def to_canonical(result: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, list[Finding]]:
        o, lse, found = result_parts(result, out, return_lse)
        if query.dim() != 4:
            return o, lse, found
        B, Q, H = query.shape[:3]
        o = None if o is None else o.reshape(B, Q, H, -1)
        return o, None if lse is None else split_lse(lse, B, Q), found

    return LiveCall(args, contract, pass_out=out is not None, return_lse=return_lse, to_canonical=to_canonical,
                    replay=replay)


# --- FlashInfer's functional entry point

FLASHINFER_ENVELOPES = {"trtllm-gen": TRTLLM_GEN_ENVELOPE, "cute-dsl": CUTE_DSL_ENVELOPE, "xqa": XQA_ENVELOPE}
# the forms FlashInfer's function takes that the reference does not compute: (argument, is it used, the form)
UNREAD_FORMS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("cum_seq_lens_q", lambda v: v is not None, "compact variable-q query"),
    ("sinks", lambda v: v is not None, "attention sinks"),
    ("skip_softmax_threshold_scale_factor", lambda v: v is not None, "skip-softmax"),
    ("uses_shared_paged_kv_idx", lambda v: v is False, "TRT-LLM's separate K/V page tables"),
    ("enable_dcp", lambda v: bool(v), "decode context parallelism"),
)
# FlashInfer 0.7.4's sources disagree on what a sparse block_tables entry is: its trace reference gathers whole
# pages (`trace/templates/attention.py`, "top-k page index"), its docstring calls it "the usual paged block table",
# its tests write token slots (page * page_size + offset). Only a Blackwell run can tell; until then: not compared.
FLASHINFER_SPARSE_UNREAD = ("sparse MLA (sparse_mla_top_k) is not compared: FlashInfer 0.7.4 reads block_tables "
                            "entries as top-k page ids in its trace reference and as token slots in its tests")
LSE_BASES = {"base2": 2.0, "basee": LN_BASE}
DEFAULT_LSE_BASE = {"trtllm-gen": 2.0, "cute-dsl": LN_BASE, "xqa": None}  # return_lse_base=None, FlashInfer 0.7.4


def read_flashinfer_trtllm(values: Mapping[str, Any], seen_workspaces: set[int]) -> LiveCall:
    backend = str(values.get("backend", "auto"))
    base = LSE_BASES.get(values.get("return_lse_base") or "", DEFAULT_LSE_BASE.get(backend))
    envelope = FLASHINFER_ENVELOPES.get(backend)
    contract = KernelContract(f"trtllm_batch_decode_with_kv_cache_mla(backend={backend!r})", envelope=envelope,
                              envelope_severity=WARNING, lse_base=base)
    if values.get("sparse_mla_top_k"):
        return LiveCall(None, contract, findings=_flashinfer_sparse_findings(values),
                        unchecked=FLASHINFER_SPARSE_UNREAD)
    for name, used, form in UNREAD_FORMS:
        if used(values.get(name)):
            return LiveCall(None, contract, unchecked=f"{form} ({name}) is not computed by the reference")
    query = values.get("query")
    out_shape = None
    if backend == "xqa" and isinstance(query, torch.Tensor) and query.dim() == 4:
        out_shape = (query.shape[0], query.shape[2], values["kv_lora_rank"])  # XQA's out has no q_len axis
    call = read_contract1(values, contract, replay=backend if envelope is not None else None, out_shape=out_shape)
    if call.args is not None and values.get("return_lse") and base is None:
        call.findings.append(Finding(WARNING, "return_lse_base", f"None under backend={backend!r}: the LSE's base "
                                     "depends on the backend FlashInfer picks; pass 'base2' or 'basee'"))
    workspace = values.get("workspace_buffer")
    if isinstance(workspace, torch.Tensor) and isinstance(query, torch.Tensor):
        call.findings += _workspace_findings(workspace, query, seen_workspaces)
    return call


def _flashinfer_sparse_findings(values: Mapping[str, Any]) -> list[Finding]:
    """An entry that is neither -1 nor below pages * page_size is outside kv_cache under either reading."""
    table, cache = values.get("block_tables"), values.get("kv_cache")
    if not isinstance(table, torch.Tensor) or not isinstance(cache, torch.Tensor) or cache.dim() not in (3, 4):
        return []
    return sparse_index_findings(table, cache.shape[0] * cache.shape[-2], "read as token slots or as page ids, "
                                 "the kernel would read outside kv_cache", name="block_tables")


def _workspace_findings(workspace: torch.Tensor, query: torch.Tensor, seen: set[int]) -> list[Finding]:
    if workspace.device != query.device:
        return [Finding(ERROR, "workspace_buffer", f"on {workspace.device}, the query on {query.device}",
                        blocking=True)]
    if workspace.data_ptr() in seen:
        return []
    seen.add(workspace.data_ptr())
    if workspace.is_contiguous() and bool(workspace.view(torch.uint8).any()):
        return [Finding(WARNING, "workspace_buffer", "not all zeros when first seen: trtllm-gen keeps semaphores "
                        "in it and needs it zero-initialised (torch.zeros, not torch.empty) before its first use")]
    return []


# --- FlashMLA

# what only FlashMLA's sparse path reads: the wheel's dense branch (sgl-flash-mla 1.0.0 flash_mla_interface.py
# :172-204) ignores them without a word; upstream (9241ae3 :163-164) asserts they are None
FLASHMLA_SPARSE_ONLY = ("attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length")


class FlashMLASchedules:
    """What each ``FlashMLASchedMeta`` seen in a dense call was filled for: FlashMLA builds the split-KV schedule
    from the first call's shapes and ``cache_seqlens`` and reuses it, unchecked, on every later call with the same
    object (a fresh one comes only from ``get_mla_metadata()``, or with ``tile_scheduler_metadata`` None)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref, tuple, str]] = {}

    def check(self, meta: Any, used_for: tuple, described: str) -> list[Finding]:
        key = id(meta)

        def forget(dead: weakref.ref) -> None:  # an engine makes a schedule per step: a long session must not grow
            if key in self._seen and self._seen[key][0] is dead:
                del self._seen[key]

        try:
            ref = weakref.ref(meta, forget)
        except TypeError:  # not an object a schedule lives in (upstream-2025 tensors): nothing to track
            return []
        known = self._seen.get(key)
        fresh = getattr(meta, "tile_scheduler_metadata", None) is None  # this call makes the schedule anew
        if known is None or known[0]() is not meta or fresh:
            self._seen[key] = (ref, used_for, described)
            return []
        if known[1] == used_for:
            return []
        return [Finding(ERROR, "tile_scheduler_metadata", f"a FlashMLASchedMeta filled for {known[2]} is reused for "
                        f"{described}: FlashMLA reuses its split-KV schedule unchecked (a stale schedule); take a "
                        "new one from get_mla_metadata() whenever the batch's shapes or cache_seqlens change")]


def _schedule_key(q: torch.Tensor, cache: torch.Tensor, lens: Any, causal: bool, fp8: bool) -> tuple[tuple, str]:
    """(what a dense schedule depends on, how a report names it)."""
    seqlens = lens.tolist() if isinstance(lens, torch.Tensor) else lens
    shown = seqlens if not isinstance(seqlens, list) or len(seqlens) <= 8 else [*seqlens[:6], "...", seqlens[-1]]
    return ((tuple(q.shape), tuple(cache.shape[1:]), causal, fp8, str(seqlens)),
            f"B={q.shape[0]} q_len={q.shape[1]} H={q.shape[2]} cache_seqlens={shown}")


def read_flashmla(values: Mapping[str, Any], schedules: FlashMLASchedules | None = None) -> LiveCall:
    """``flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, ...)``: returns (out, lse).
    Dense bf16 and, in the sgl-flash-mla wheel, dense per-tensor fp8 (``descale_q``/``descale_k``); a sparse
    call (``indices=``) is ``read_flashmla_sparse``'s."""
    contract = KernelContract("flash_mla_with_kvcache", cache_dims=(3,), lse_base=LN_BASE,
                              empty_lse=FLASHMLA_ENVELOPE.empty_lse)
    q, cache, dv = values.get("q"), values.get("k_cache"), values.get("head_dim_v", values.get("dv"))
    if not isinstance(q, torch.Tensor) or not isinstance(cache, torch.Tensor) or dv is None:
        return LiveCall(None, contract, unchecked="no q, k_cache or head_dim_v in the call")
    ignored = [name for name in FLASHMLA_SPARSE_ONLY if values.get(name) is not None]
    ignored += ["enable_batch_invariant"] * bool(values.get("enable_batch_invariant"))
    found = [Finding(WARNING, name, "given to the dense decode path, which does not read it (the sgl-flash-mla "
                     "wheel ignores it silently; it applies to sparse decode only)") for name in ignored]
    if cache.dim() != 4 or cache.shape[2] != 1:
        hint = " -- Contract 1's [pages, 1, page, D] order" if cache.dim() == 4 and cache.shape[1] == 1 else ""
        return LiveCall(None, contract, findings=[*found, Finding(
            ERROR, "k_cache", f"shape {tuple(cache.shape)}; FlashMLA takes [blocks, page_size, 1, D]{hint}",
            blocking=True)], unchecked="the cache cannot be read")
    causal = bool(values.get("causal", False))
    fp8 = bool(values.get("is_fp8_kvcache")) or cache.dtype == FP8
    if schedules is not None:
        found += schedules.check(values.get("tile_scheduler_metadata"),
                                 *_schedule_key(q, cache, values.get("cache_seqlens"), causal, fp8))
    scale = values.get("softmax_scale")
    bmm1 = q.shape[-1] ** -0.5 if scale is None else scalar(scale)
    bmm2 = 1.0
    if fp8 and cache.dtype == torch.uint8:
        return LiveCall(None, contract, findings=found,
                        unchecked="FlashMLA's packed fp8 cache (values with inline scales) is not read")
    if fp8:  # scores = softmax_scale * descale_q * descale_k * q.k; O = P.V * descale_k
        dq, dk = values.get("descale_q"), values.get("descale_k")
        if dq is None or dk is None:
            return LiveCall(None, contract, findings=found, unchecked="an fp8 cache without descale_q/descale_k")
        bmm1, bmm2 = bmm1 * scalar(dq) * scalar(dk), scalar(dk)
    args = PagedArgs(query=q, kv_cache=cache[:, :, 0], block_table=values["block_table"],
                     seq_lens=values["cache_seqlens"], kv_lora_rank=int(dv), qk_rope_head_dim=q.shape[-1] - int(dv),
                     bmm1_scale=bmm1, bmm2_scale=bmm2)
    unchecked = None
    if not causal and q.dim() == 4 and q.shape[1] > 1:
        found.append(Finding(WARNING, "causal", f"False with {q.shape[1]} query tokens per request: each new "
                             "token sees the ones after it (a multi-token decode step is causal)"))
        unchecked = "non-causal attention over several query tokens"

    def to_canonical(result: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, list[Finding]]:
        o, lse, parts = result_parts(result, None, True, "(out, softmax_lse)")
        return o, None if lse is None else lse.transpose(1, 2), parts

    return LiveCall(args, contract, pass_out=False, return_lse=True, to_canonical=to_canonical,
                    replay="flashmla-fp8" if fp8 else "flashmla", unchecked=unchecked, findings=found,
                    arithmetic=FLASHMLA_FP8_ARITHMETIC if fp8 else DEFAULT)


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
