"""FlashInfer's planned MLA paths through ``flashinfer.mla.BatchMLAPagedAttentionWrapper``: fa2, fa3, cutlass,
cutile, and ``backend="auto"`` where it chooses between fa3 and fa2 (``fa-auto``).

Inputs are ``layouts.wrapper_args``: CSR page lists plus q_nope/q_pe and ckv/kpe views of one pool. ``prepare``
plans once per problem (planning is not part of the timed call). Semantics the wrapper does not share with
Contract 1, and how they are bridged (docs/backends.md has the source references):

- No bmm2 / output scale on these paths (fa2/fa3 reject ``bmm1_scale``/``bmm2_scale`` at run time):
  ``bmm1_scale`` becomes the plan's ``sm_scale``; ``bmm2_scale`` is returned as ``PreparedCall.output_scale``
  and the harness applies it in float64 when judging, so the kernel is not charged for a bf16 rounding it did
  not make.
- fp8: fa2/fa3 read an fp8 *cache* (SM90 only) with a bf16 query and ``ckv_scale = kpe_scale = 1`` (the
  dequant scales are already folded into bmm1/bmm2). The fp8 query is handed over as its bf16 copy, which is
  exact: every e4m3 value is a bf16 value.
- Output is ``[B*q_len, H, L]`` bf16; LSE ``[B*q_len, H]`` in base 2 (``lse_mode="base2"``).
- Causal masking is bottom-right, as ours: mla.cuh masks ``kv_idx + qo_len > kv_len + q_idx``, with each
  request's own qo_len. So fa2/fa3 take ragged problems (``ProblemSpec.q_lens``): ``qo_indptr`` holds each
  request's q_len, only its tokens are packed into the query, and the ``[total_q, H, L]`` output goes back to the
  padded canonical form with NaN in the padding rows (``layouts.padded_rows``), which nothing judges.
- ``auto`` picks its kernel in plan(); the wrapper records the one it planned (``_planned_backend_name``),
  which each call reports as ``PreparedCall.resolved_backend``.
- fp8 arithmetic (``FA_FP8_ARITHMETIC``, read from FlashInfer 0.7.4's ``include/flashinfer/attention``): the fp8
  cache is dequantized to bf16 (``repack_fp8_kv_to_bf16``), so both products are bf16 MMAs with fp32
  accumulators, and the scale multiplies the fp32 scores (``s * sm_scale_log2 - m_scaled``); P is rounded to
  bf16 (DTypeQ) before the second product. fa2 (``mla.cuh``): 32-key tiles for an fp8 cache
  (``EFF_CTA_TILE_KV``), visited last first (``--kv_tile_idx``), and the row sum of the *rounded* P
  (``m16k16_rowsum_f16f16f32`` over ``p_f16``); fa3 (``mla_hopper.cuh``): 64-key tiles, last first, the row sum
  of the fp32 P (``d_local`` in ``update_md_``). Their split-KV schedules (the planner's) are not emulated: each
  request is one split.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..core.platform import flashinfer_unavailable
from ..problems.arithmetic import DEFAULT, REVERSE, SCALE_ON_SCORES, SUM_FP32, SUM_ROUNDED, Arithmetic
from ..problems.generate import DTYPES, ProblemSpec
from ..problems.layouts import LayoutSpec, csr_metadata, padded_rows, wrapper_args
from ..problems.problem import FP8, DecodeProblem
from .base import Backend, Envelope, PreparedCall, WarmupModule
from .flashinfer_jit import fa_module
from .flashinfer_trtllm import BLACKWELL_DC, SM12X

FA_HOPPER = ((9, 0),)
# where every candidate of FlashInfer's auto policy but fa2/fa3 refuses by architecture (trtllm-gen, CuTe DSL,
# CUTLASS, XQA and cuTile need SM100 or newer), so auto runs one of the two FA kernels
FA_ONLY_AUTO = ((8, 0), (8, 6), (8, 7), (8, 9), (9, 0))
AUTO_FA_CANDIDATES = ("fa3", "fa2")
FA_FP8_ARITHMETIC = {
    "fa2": Arithmetic("FlashInfer fa2 with an fp8 cache", scale=SCALE_ON_SCORES, p_dtype="bf16", p_block=32,
                      order=REVERSE, row_sum=SUM_ROUNDED),  # mla.cuh
    "fa3": Arithmetic("FlashInfer fa3 with an fp8 cache", scale=SCALE_ON_SCORES, p_dtype="bf16", p_block=64,
                      order=REVERSE, row_sum=SUM_FP32),  # mla_hopper.cuh
}
WORKSPACE_BYTES = 128 << 20

Preflight = Callable[[str, ProblemSpec, torch.device], None]


def operand_dtypes(dtype: str) -> tuple[torch.dtype, torch.dtype]:
    """(query dtype handed to the wrapper, cache dtype): the query is always bf16 (exact for bf16 and fp8)."""
    return torch.bfloat16, DTYPES[dtype]


def _spec_csr(spec: ProblemSpec) -> dict[str, torch.Tensor]:
    """Host CSR metadata with the spec's lengths (page ids are irrelevant to the planners' checks)."""
    return csr_metadata(torch.tensor(spec.seq_lens, dtype=torch.int32), spec.q_len, spec.page_size,
                        q_lens=spec.q_lens)._asdict()


def fa_preflight(name: str, spec: ProblemSpec, device: torch.device) -> None:
    """FlashInfer's own host-side FA plan checks: dtypes per architecture, work-item capacity, and the causal
    tile boundaries where the native kernel would drop a visible key (FlashInfer refuses those)."""
    from flashinfer.mla._batch_mla._backends._fa_common import _validate_fa_plan_workload, _validate_generated_fa_plan

    q_dtype, kv_dtype = operand_dtypes(spec.dtype)
    csr = _spec_csr(spec)
    _validate_generated_fa_plan(backend=name, device=device, **csr, head_dim_ckv=spec.kv_lora_rank,
                                head_dim_kpe=spec.qk_rope_head_dim, q_data_type=q_dtype, kv_data_type=kv_dtype,
                                output_dtype=q_dtype, scale_mode=_scale_mode(kv_dtype))
    _validate_fa_plan_workload(csr["qo_indptr"], csr["kv_len_arr"], spec.num_heads, True, device, name, kv_dtype)


def auto_preflight(name: str, spec: ProblemSpec, device: torch.device) -> None:
    """FlashInfer's auto plans the first candidate that accepts; on FA_ONLY_AUTO devices only fa3 or fa2 can,
    so it refuses exactly what both FA planners refuse (which of them it picks is read after plan())."""
    refusals = []
    for candidate in AUTO_FA_CANDIDATES:
        try:
            return fa_preflight(candidate, spec, device)
        except ValueError as exc:
            refusals.append(f"{candidate}: {exc}")
    raise ValueError("; ".join(refusals))


def cutlass_preflight(name: str, spec: ProblemSpec, device: torch.device) -> None:
    """FlashInfer's CUTLASS plan contract: 128 heads and a fixed softmax scale 1/sqrt(128 + rope), among others."""
    from flashinfer.mla._batch_mla._backends.cutlass_backend import _validate_cutlass_plan_contract

    q_dtype, kv_dtype = operand_dtypes(spec.dtype)
    _validate_cutlass_plan_contract(device=device, num_heads=spec.num_heads, head_dim_ckv=spec.kv_lora_rank,
                                    head_dim_kpe=spec.qk_rope_head_dim, page_size=spec.page_size,
                                    sm_scale=spec.bmm1_scale, q_data_type=q_dtype, kv_data_type=kv_dtype,
                                    output_dtype=q_dtype, output_scale="none", use_profiler=False)


def _scale_mode(kv_dtype: torch.dtype) -> Literal["default", "kv-per-tensor"]:
    return "kv-per-tensor" if kv_dtype == FP8 else "default"


@dataclass(frozen=True)
class WrapperPath:
    """One ``backend=`` of the wrapper: how it wants its inputs and what FlashInfer checks before planning."""

    fi_backend: str
    envelope: Envelope
    description: str
    # plan's query_layout / kv_cache_layout; the run gets split views either way
    layout: Literal["packed", "split"] = "split"
    preflight: Preflight | None = None
    resolves: bool = False  # a policy that picks its kernel in plan(): each call reports the one it planned


class FlashInferWrapperBackend(Backend):
    def __init__(self, name: str, path: WrapperPath):
        self.name = name
        self.path = path
        self.envelope = path.envelope
        self.description = path.description
        self._workspaces: dict[torch.device, torch.Tensor] = {}

    def unavailable_reason(self, device: torch.device) -> str | None:
        return super().unavailable_reason(device) or flashinfer_unavailable()

    def arithmetic_for(self, dtype: str, resolved_backend: str | None = None) -> Arithmetic:
        """fa2's and fa3's with an fp8 cache (``auto``: the one it resolved to); the plain baseline otherwise."""
        kernel = resolved_backend or self.path.fi_backend
        return FA_FP8_ARITHMETIC.get(kernel, DEFAULT) if dtype == "fp8" else DEFAULT

    def why_not(self, spec: ProblemSpec, layout: LayoutSpec, device: torch.device) -> str | None:
        reason = super().why_not(spec, layout, device)
        if reason is None and self.path.preflight is not None:
            try:
                self.path.preflight(self.path.fi_backend, spec, device)
            except ValueError as exc:  # FlashInfer's _BackendPlanUnsupportedError is a ValueError
                reason = f"FlashInfer's {self.path.fi_backend} planner refuses it: {exc}"
        return reason

    def warmup(self, device: torch.device) -> list[WarmupModule]:
        """The fa2/fa3 modules of every (dtype, dims) the envelope draws; auto's are both candidates'."""
        sm90 = torch.cuda.get_device_capability(device) in FA_HOPPER
        kernels = AUTO_FA_CANDIDATES if self.path.resolves else (self.path.fi_backend,)
        env = self.envelope
        assert isinstance(env, Envelope)  # a dense backend's
        return [fa_module(k, DTYPES[dtype], rank, rope) for k in kernels if k in ("fa2", "fa3")
                if k == "fa2" or sm90 for dtype in env.dtypes if dtype != "fp8" or sm90  # fp8 cache: SM90 only
                for rank, rope in env.dims_for(dtype)]

    def workspace(self, device: torch.device) -> torch.Tensor:
        if device not in self._workspaces:  # FA needs ~17 MiB of split partials on an H200; 128 MiB is usual
            self._workspaces[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspaces[device]

    def prepare(self, problem: DecodeProblem, layout: LayoutSpec) -> PreparedCall:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        p = problem
        a = wrapper_args(p, layout)
        B, Q, H, L = p.batch, p.q_len, p.num_heads, p.dims.kv_lora_rank
        q_dtype, kv_dtype = torch.bfloat16, p.kv_cache.dtype
        q_nope, q_pe = a.q_nope.to(q_dtype), a.q_pe.to(q_dtype)  # no copy unless fp8 (exact upcast)
        wrapper = BatchMLAPagedAttentionWrapper(self.workspace(p.device), backend=self.path.fi_backend)
        wrapper.plan(metadata=MLAPlanMetadata.csr(a.qo_indptr, a.kv_indptr, a.kv_indices, a.kv_len_arr),
                     num_heads=H, head_dim_ckv=L, head_dim_kpe=p.dims.qk_rope_head_dim, page_size=p.page_size,
                     causal=True, sm_scale=float(p.bmm1_scale), q_data_type=q_dtype, kv_data_type=kv_dtype,
                     query_layout=self.path.layout, kv_cache_layout=self.path.layout,
                     lse_mode="base2" if layout.return_lse else "none", output_dtype=q_dtype,
                     scale_mode=_scale_mode(kv_dtype))
        rows = a.q_nope.shape[0]  # B * Q, or a ragged problem's query tokens
        out = torch.empty((rows, H, L), dtype=q_dtype, device=p.device) if layout.pass_out else None
        kwargs: dict[str, Any] = dict(query=(q_nope, q_pe), kv_cache=(a.ckv, a.kpe), out=out,
                                      return_lse=layout.return_lse)
        if kv_dtype == FP8:
            kwargs.update(ckv_scale=1.0, kpe_scale=1.0)  # dequant scales are already in bmm1/bmm2

        def invoke() -> Any:
            return wrapper.run(**kwargs)

        valid = p.valid_rows()

        def kernel_out(result: Any) -> Any:
            return result[0] if layout.return_lse else result

        def to_canonical(result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            o, lse = result if layout.return_lse else (result, None)
            if valid is not None:  # ragged: the packed rows back in [B, Q, ...], NaN in the padding rows
                return padded_rows(o, valid), None if lse is None else padded_rows(lse, valid)
            return o.view(B, Q, H, L), None if lse is None else lse.view(B, Q, H)

        inputs = {"q_nope": q_nope, "q_pe": q_pe, "kv_pool": a.pool, "qo_indptr": a.qo_indptr,
                  "kv_indptr": a.kv_indptr, "kv_indices": a.kv_indices, "kv_len_arr": a.kv_len_arr}
        # no output scale on these paths: bmm2 is applied to the kernel's output when it is judged
        return PreparedCall(invoke, inputs, out, to_canonical, output_scale=float(p.bmm2_scale),
                            resolved_backend=wrapper._planned_backend_name if self.path.resolves else None,
                            kernel_out=None if valid is None else kernel_out)


# FlashInfer's FA planner (_validate_generated_fa_plan) takes head_dim_kpe in multiples of 64 "including
# zero", so no rope, (512, 0), is drawn beside the DeepSeek dims; an fp8 cache only with head_dim_ckv 512 and
# head_dim_kpe 0 or 64. Static constraints, declared here so that nothing outside them is drawn.
NO_ROPE_DIMS = (512, 0)
_FA_COMMON: dict[str, Any] = dict(devices=("cuda",), page_sizes=None,
                  dims=((512, 64), (256, 64), NO_ROPE_DIMS),
                  dims_by_dtype=(("fp8", ((512, 64), NO_ROPE_DIMS)),), heads=None, max_heads=128,
                  dtypes=("bf16", "fp8"), q_len=(1, 16), cache_dims=(3,), page_strided=True,
                  table_widths=("native",), pass_out=(True, False), lse=True, ragged_q=True)
_POW2_PAGES = (1, 2, 4, 8, 16, 32, 64, 128)

WRAPPER_PATHS: dict[str, WrapperPath] = {
    "fa2": WrapperPath("fa2", Envelope(archs=None, **_FA_COMMON, empty_lse=-math.inf,
                                       notes="SM80+ and fp8 cache on SM90 only: both refused by FlashInfer's "
                                             "FA planner (reported by why_not); any page size; kv_len 0 taken "
                                             "(mla.cuh's write_empty_o: out 0, LSE -inf)"),
                       "FlashInfer FA2 MLA decode (BatchMLAPagedAttentionWrapper)", preflight=fa_preflight),
    "fa3": WrapperPath("fa3", Envelope(archs=FA_HOPPER, **_FA_COMMON,
                                       notes="SM90a with CUDA >= 12.3; fp8 cache with bf16 query"),
                       "FlashInfer FA3 (Hopper) MLA decode (BatchMLAPagedAttentionWrapper)", preflight=fa_preflight),
    "fa-auto": WrapperPath("auto", Envelope(archs=FA_ONLY_AUTO, **_FA_COMMON,
                                            notes="FlashInfer's auto: fa3 on SM90 (CUDA >= 12.3), fa2 where "
                                                  "fa3's planner refuses and on SM8x; refused where both refuse; "
                                                  "each case reports the kernel it ran"),
                           "FlashInfer's backend=\"auto\" MLA decode, reported as the kernel it resolved to",
                           preflight=auto_preflight, resolves=True),
    "cutlass": WrapperPath("cutlass", Envelope(
        devices=("cuda",), archs=BLACKWELL_DC + ((11, 0),), page_sizes=_POW2_PAGES, dims=((512, 64),),
        heads=(128,), dtypes=("bf16",), q_len=(1, 1), cache_dims=(3,), page_strided=False,
        table_widths=("native",), lse=False,
        notes="fixed softmax scale 1/sqrt(192) (other bmm1 refused by FlashInfer); contiguous cache only"),
        "FlashInfer CUTLASS MLA decode (SM10x/11x)", layout="packed", preflight=cutlass_preflight),
    "cutile": WrapperPath("cutile", Envelope(
        devices=("cuda",), archs=BLACKWELL_DC + SM12X, page_sizes=_POW2_PAGES, dims=((512, 64), (256, 64)),
        heads=None, max_heads=128, dtypes=("bf16",), q_len=(1, 1), cache_dims=(3,), page_strided=False,
        table_widths=("native",), lse=False,
        notes="experimental; needs cuda-tile >= 1.4 with the tileiras compiler; contiguous cache only"),
        "FlashInfer cuTile MLA decode (experimental)"),
}


def wrapper_backends() -> list[FlashInferWrapperBackend]:
    return [FlashInferWrapperBackend(name, path) for name, path in WRAPPER_PATHS.items()]
