"""FlashInfer's trtllm-gen, cute-dsl and xqa MLA decode kernels, through
``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla(..., backend=...)``.

All three take Contract 1's arguments, so they are ``TrtllmStyleBackend``s: the very adapter user kernels get.
Envelopes are read from the FlashInfer 0.7.4 source (see docs/backends.md for the line references). The
architecture is checked before FlashInfer is imported or called: on SM90 an explicit ``backend="trtllm-gen"``
call has no Python-side architecture check and would go fetch cubins from the network first.
"""
from __future__ import annotations

from typing import Any

import torch

from ..core.platform import flashinfer_unavailable
from .trtllm_style import TRTLLM_ENVELOPE, TrtllmStyleBackend

BLACKWELL_DC = ((10, 0), (10, 3), (10, 7))  # SM100 / SM103 / SM107: the archs trtllm-gen's FmhaRunner accepts
SM12X = ((12, 0), (12, 1))

TRTLLM_GEN_ENVELOPE = TRTLLM_ENVELOPE.narrowed(
    devices=("cuda",), archs=BLACKWELL_DC,
    notes="fmhaRunner.cuh: SM100/103/107 only; _trtllm_gen_mla_incompatibility_reason: page 32/64, "
          "not 64 < heads < 128; explicit backend='trtllm-gen' accepts a native-width block table.",
)
CUTE_DSL_ENVELOPE = TRTLLM_ENVELOPE.narrowed(
    devices=("cuda",), archs=BLACKWELL_DC,
    page_sizes=(2, 4, 8, 16, 32, 64, 128),  # can_implement: 128 % page == 0 and page != 1 (TMA alignment)
    dims=((512, 64),), heads=None, max_heads=128,  # can_implement: L 512, R 64, 1 <= heads <= 128
    table_widths=("pad128",),  # the functional API requires alignment unless backend == "trtllm-gen"
    notes="cute_dsl monolithic mla_decode can_implement; LSE requested in base 2 explicitly "
          "(its historical default is natural log).",
)
XQA_ENVELOPE = TRTLLM_ENVELOPE.narrowed(
    devices=("cuda",), archs=SM12X,
    page_sizes=(16, 32, 64, 128), dims=((512, 64),), heads=(128,), q_len=(1, 1),
    table_widths=("pad128",), lse=False,
    notes="gen_xqa_module_mla: 128 heads, head dim 576, page 16/32/64/128; q_len 1; no LSE output; "
          "SM120a needs CUDA >= 12.8, SM121a CUDA >= 12.9.",
)


def flashinfer_mla_decode(*args: Any, **kwargs: Any) -> Any:
    """``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla``, imported on first call (the import is slow)."""
    import flashinfer.decode

    return flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla(*args, **kwargs)


def xqa_mla_decode(query: torch.Tensor, kv_cache: torch.Tensor, *args: Any, out: torch.Tensor | None = None,
                   **kwargs: Any) -> Any:
    """XQA's ``out`` is ``[B, H, L]`` (its q_len is 1), not trtllm-gen's ``[B, 1, H, L]``: hand it a view of the
    Contract-1 buffer and give back the result in Contract-1 shape."""
    flat = None if out is None else out.view(out.shape[0], out.shape[2], out.shape[3])
    result = flashinfer_mla_decode(query, kv_cache, *args, out=flat, **kwargs)
    return result.view(query.shape[0], 1, query.shape[2], -1)


class FlashInferTrtllmBackend(TrtllmStyleBackend):
    """A FlashInfer kernel behind ``trtllm_batch_decode_with_kv_cache_mla``: device and architecture first,
    then whether FlashInfer imports at all."""

    def unavailable_reason(self, device: torch.device) -> str | None:
        return super().unavailable_reason(device) or flashinfer_unavailable()


def trtllm_backends() -> list[FlashInferTrtllmBackend]:
    lse_base2 = {"return_lse_base": "base2"}
    return [
        FlashInferTrtllmBackend("trtllm-gen", flashinfer_mla_decode, TRTLLM_GEN_ENVELOPE,
                                "FlashInfer trtllm-gen MLA decode (TensorRT-LLM cubins)",
                                {"backend": "trtllm-gen", **lse_base2}),
        FlashInferTrtllmBackend("cute-dsl", flashinfer_mla_decode, CUTE_DSL_ENVELOPE,
                                "FlashInfer CuTe-DSL MLA decode (monolithic)",
                                {"backend": "cute-dsl", **lse_base2}),
        FlashInferTrtllmBackend("xqa", xqa_mla_decode, XQA_ENVELOPE,
                                "FlashInfer XQA MLA decode (SM120/121)", {"backend": "xqa"}),
    ]

