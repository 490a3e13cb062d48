"""Shadow mode's reading of ``flashinfer.mla.BatchMLAPagedAttentionWrapper``: ``plan`` records the metadata and
scales (a host copy, as FlashInfer's FA planners take one), ``run`` is read against the last plan of its wrapper.

A run's inputs become Contract 1's: the split ``(q_nope, q_pe)`` query is joined into [B, q_len, H, L + R]; split
``(ckv, kpe)`` views of one pool (the usual layout) are re-viewed as that pool without a copy, independent split
caches are joined; CSR page lists become a block table (layouts.csr_to_block_table). The scale is the plan's
``sm_scale`` (times ``ckv_scale`` for an fp8 cache with per-tensor scales, which is then also bmm2), or a run's
own ``bmm1_scale``/``bmm2_scale``. Ragged query lengths are seen but not checked yet (the reference takes them as
DecodeProblem.q_lens, but this reader does not unpack a ragged call into that padded form).
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.flashinfer_wrapper import WRAPPER_PATHS
from ..problems.layouts import csr_to_block_table
from .contract import ERROR, WARNING, Finding, KernelContract, PagedArgs
from .entries import LN_BASE, LSE_BASES, LiveCall, result_parts, scalar

METADATA_FIELDS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "cum_seq_lens_q", "block_tables", "seq_lens")


@dataclass
class PlanRecord:
    """What one ``plan()`` declared, with host copies of its metadata."""

    backend: str  # the backend the wrapper was built for ("auto" included)
    block_table: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    q_indptr: torch.Tensor  # [B + 1]: query rows of each request
    page_size: int
    num_heads: int
    head_dim_ckv: int
    head_dim_kpe: int
    causal: bool
    sm_scale: float
    lse_mode: str | None  # None: a legacy flat plan (the run's flags decide)
    output_dtype: torch.dtype | None
    scale_mode: str
    findings: list[Finding]
    unchecked: str | None


class WrapperPlans:
    """The last plan of every live wrapper (weakly held: a dropped wrapper takes its plan with it)."""

    def __init__(self) -> None:
        self._plans: weakref.WeakKeyDictionary[Any, PlanRecord] = weakref.WeakKeyDictionary()

    def record(self, values: Mapping[str, Any]) -> None:
        wrapper = values["self"]
        try:
            self._plans[wrapper] = read_plan(values, str(getattr(wrapper, "_backend", "auto")))
        except TypeError:  # not weakly referable: its runs are counted as not checked
            pass

    def read_run(self, values: Mapping[str, Any]) -> LiveCall:
        plan = self._plans.get(values["self"])
        contract = KernelContract("BatchMLAPagedAttentionWrapper.run")
        if plan is None:
            return LiveCall(None, contract, unchecked="its plan() was not seen under shadow mode")
        return read_run(plan, values)


def _metadata(values: Mapping[str, Any]) -> dict[str, Any]:
    meta = values.get("metadata")
    if meta is not None:
        return {name: getattr(meta, name, None) for name in METADATA_FIELDS}
    return {name: values.get(name) for name in METADATA_FIELDS}


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def read_plan(values: Mapping[str, Any], backend: str) -> PlanRecord:
    meta = _metadata(values)
    page = int(values.get("page_size") or 0)
    findings: list[Finding] = []
    unchecked = None
    if meta["kv_indptr"] is not None:
        kv_indptr, kv_len = _host(meta["kv_indptr"]), _host(meta["kv_len_arr"])
        table = csr_to_block_table(kv_indptr, _host(meta["kv_indices"]))
        q_indptr = _host(meta["qo_indptr"])
        findings += _csr_findings(kv_indptr, kv_len, page)
    elif meta["block_tables"] is not None and meta["cum_seq_lens_q"] is not None:
        table, kv_len, q_indptr = _host(meta["block_tables"]), _host(meta["seq_lens"]), _host(meta["cum_seq_lens_q"])
    else:
        empty = torch.zeros(0, dtype=torch.int32)
        table, kv_len, q_indptr, unchecked = empty.view(0, 0), empty, empty, "no metadata in the plan"
    lse_mode = values.get("lse_mode") if values.get("metadata") is not None else None
    return PlanRecord(backend, table.to(torch.int32), kv_len.to(torch.int32), q_indptr, page,
                      int(values.get("num_heads") or 0), int(values.get("head_dim_ckv") or 0),
                      int(values.get("head_dim_kpe") or 0), bool(values.get("causal")),
                      float(values.get("sm_scale") or 0.0), lse_mode, values.get("output_dtype"),
                      str(values.get("scale_mode", "default")), findings, unchecked)


def _csr_findings(kv_indptr: torch.Tensor, kv_len: torch.Tensor, page: int) -> list[Finding]:
    """Requests whose page list is shorter than their kv_len needs (metadata from an earlier step?)."""
    if page <= 0 or kv_indptr.numel() != kv_len.numel() + 1:
        return [Finding(ERROR, "kv_indptr", f"{kv_indptr.numel()} entries for {kv_len.numel()} requests "
                        f"(page_size {page}): expected batch + 1", blocking=True)]
    listed = kv_indptr[1:] - kv_indptr[:-1]
    need = (kv_len.long() + page - 1) // page
    short = (listed < need).nonzero()
    if short.numel() == 0:
        return []
    b = int(short[0])
    return [Finding(ERROR, "kv_indptr", f"request {b} lists {int(listed[b])} pages but kv_len_arr[{b}] = "
                    f"{int(kv_len[b])} needs {int(need[b])} of {page} tokens: the kernel reads the next request's "
                    "pages (metadata from an earlier step?)", blocking=True)]


def _split(value: Any, widths: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A structural value -- a packed tensor or a (nope, rope) pair -- as the pair."""
    if isinstance(value, torch.Tensor):
        return value[..., :widths[0]], value[..., widths[0]:]
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, torch.Tensor) for v in value):
        return value[0], value[1]
    return None


def joined_cache(ckv: torch.Tensor, kpe: torch.Tensor) -> torch.Tensor:
    """[P, page, L + R]: a view of the pool when ``kpe`` sits right after ``ckv`` in each row, else a copy."""
    L, R = ckv.shape[-1], kpe.shape[-1]
    adjacent = (ckv.dtype == kpe.dtype and ckv.shape[:-1] == kpe.shape[:-1] and ckv.stride() == kpe.stride()
                and ckv.stride(-1) == 1 and ckv.untyped_storage().data_ptr() == kpe.untyped_storage().data_ptr()
                and kpe.data_ptr() == ckv.data_ptr() + L * ckv.element_size()
                and all(s >= L + R for s in ckv.stride()[:-1]))
    if adjacent:
        return ckv.as_strided((*ckv.shape[:-1], L + R), ckv.stride(), ckv.storage_offset())
    return torch.cat((ckv, kpe), dim=-1)


def read_run(plan: PlanRecord, values: Mapping[str, Any]) -> LiveCall:
    base = LSE_BASES.get(plan.lse_mode or "")  # the same names as a run's return_lse_base
    if plan.lse_mode is None:  # legacy flat plan: the run decides
        base = LN_BASE if values.get("return_lse_base_on_e") else 2.0
    path = WRAPPER_PATHS.get(plan.backend)
    contract = KernelContract(f"BatchMLAPagedAttentionWrapper(backend={plan.backend!r})", cache_dims=(3,),
                              out_dtype=plan.output_dtype or torch.bfloat16,
                              envelope=None if path is None else path.envelope, envelope_severity=WARNING,
                              lse_base=base)
    replay = plan.backend if path is not None else None
    if plan.unchecked:
        return LiveCall(None, contract, unchecked=plan.unchecked, findings=list(plan.findings))
    widths = (plan.head_dim_ckv, plan.head_dim_kpe)
    q = _split(values.get("query") if values.get("query") is not None else (values.get("q_nope"), values.get("q_pe")),
               widths)
    kv = _split(values.get("kv_cache") if values.get("kv_cache") is not None
                else (values.get("ckv_cache"), values.get("kpe_cache")), widths)
    unread = _unread_run(values, plan)
    if q is None or kv is None or unread:
        return LiveCall(None, contract, unchecked=unread or "no query or KV cache in the call",
                        findings=list(plan.findings))
    counts = plan.q_indptr[1:] - plan.q_indptr[:-1]
    if counts.numel() == 0 or not bool((counts == counts[0]).all()):
        return LiveCall(None, contract, unchecked="ragged query lengths (per-request q_len) are not checked",
                        findings=list(plan.findings))
    B, Q = counts.numel(), int(counts[0])
    q_nope, q_pe = q
    findings = list(plan.findings)
    mismatched = [Finding(ERROR, name, f"split into widths ({nope.shape[-1]}, {rope.shape[-1]}); the plan has "
                          f"head_dim_ckv {widths[0]}, head_dim_kpe {widths[1]} (the pair swapped?)", blocking=True)
                  for name, (nope, rope) in (("query", q), ("kv_cache", kv))
                  if (nope.shape[-1], rope.shape[-1]) != widths]
    findings += mismatched
    if mismatched or q_nope.dim() != 3:
        return LiveCall(None, contract, unchecked="the query or cache does not match the plan", findings=findings)
    n, H = q_nope.shape[0], q_nope.shape[1]
    if n != B * Q or H != plan.num_heads:
        findings.append(Finding(ERROR, "query", f"{n} rows of {H} heads; the plan has {B} requests x {Q} tokens "
                                f"of {plan.num_heads} heads", blocking=True))
        return LiveCall(None, contract, unchecked="the query does not match the plan", findings=findings)
    device = q_nope.device
    query = torch.cat((q_nope, q_pe), dim=-1).view(B, Q, H, -1)
    bmm1, bmm2, dequant = _scales(plan, values)
    out = values.get("out")
    return_lse = bool(values.get("return_lse"))
    args = PagedArgs(query=query, kv_cache=joined_cache(*kv), block_table=plan.block_table.to(device),
                     seq_lens=plan.seq_lens.to(device), kv_lora_rank=plan.head_dim_ckv,
                     qk_rope_head_dim=plan.head_dim_kpe, bmm1_scale=bmm1, bmm2_scale=bmm2, out=out,
                     out_shape=(n, H, plan.head_dim_ckv), dequant=dequant)
    unchecked = None
    if not plan.causal and Q > 1:
        findings.append(Finding(WARNING, "causal", f"False with {Q} query tokens per request: each new token sees "
                                "the ones after it (a multi-token decode step is causal)"))
        unchecked = "non-causal attention over several query tokens"

    def to_canonical(result: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, list[Finding]]:
        o, lse, found = result_parts(result, out, return_lse)
        o = None if o is None else o.reshape(B, Q, H, -1)
        return o, None if lse is None else lse.reshape(B, Q, H), found

    return LiveCall(args, contract, pass_out=out is not None, return_lse=return_lse, to_canonical=to_canonical,
                    replay=replay, unchecked=unchecked, findings=findings, table_width="native")


def _unread_run(values: Mapping[str, Any], plan: PlanRecord) -> str | None:
    if values.get("sinks") is not None:
        return "attention sinks are not computed by the reference"
    if values.get("skip_softmax_threshold_scale_factor") is not None:
        return "skip-softmax is not computed by the reference"
    if values.get("ckv_scale_arr") is not None:
        return "per-token fp8 cache scales (ckv_scale_arr) are not read"
    if values.get("o_scale") is not None:
        return "an fp8 output scale (o_scale) is not read"
    if plan.scale_mode == "kv-per-tensor" and _kv_scale(values, "ckv_scale") != _kv_scale(values, "kpe_scale"):
        return "different ckv_scale and kpe_scale have no single bmm1/bmm2 in Contract 1"
    return None


def _kv_scale(values: Mapping[str, Any], name: str) -> float:
    value = values.get(name)
    return 1.0 if value is None else scalar(value)


def _scales(plan: PlanRecord, values: Mapping[str, Any]) -> tuple[float, float, float | None]:
    """(bmm1, bmm2, the dequant scale inside bmm1 when the call names it)."""
    if values.get("bmm1_scale") is not None:
        return scalar(values["bmm1_scale"]), _kv_scale(values, "bmm2_scale"), None
    if plan.scale_mode == "kv-per-tensor":  # FA: scores over (ckv, kpe) * scale, output over ckv * scale
        s = _kv_scale(values, "ckv_scale")
        return plan.sm_scale * s, s, s
    return plan.sm_scale, 1.0, None
