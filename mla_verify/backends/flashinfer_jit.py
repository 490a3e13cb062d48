"""FlashInfer's JIT modules as backends' warm-up (``Backend.warmup``): built before a run's first case.

Left alone, FlashInfer compiles each module at its first call, one after the other, inside the cases (on a
fresh H200 that was most of a 6-minute run: docs/pytest.md). Here every pending module of a run goes to one
``build_jit_specs`` call: one ninja over all of them, with its default of as many jobs as the host has cores
(plus two), and nothing rebuilt that a restored cache already holds. Each module is then loaded through the
same cached getter FlashInfer's own call uses, so the first case finds it loaded.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from .base import WarmupModule


def build_all(specs: Sequence[Any]) -> None:
    """Compile every JitSpec of ``specs`` that is not built yet, in one parallel ninja run. A failed build
    raises with the compiler's first error on its first line (FlashInfer puts ninja's whole log after a line
    that says only that ninja failed)."""
    from flashinfer.jit.core import build_jit_specs

    try:
        build_jit_specs(list(specs))
    except RuntimeError as exc:
        lines = str(exc).splitlines()
        error = next((ln.strip() for ln in lines[1:] if "error" in ln.lower()), None)
        if error is None:
            raise
        first = f"{lines[0].removesuffix(' Ninja output:')} First error: {error}"
        raise RuntimeError("\n".join([first, *lines[1:]])) from exc


def fa_module(fi_backend: str, kv_dtype: torch.dtype, kv_lora_rank: int, rope_dim: int) -> WarmupModule:
    """The fa2/fa3 module the wrapper plans for a bf16 query and output, int32 indices, no profiler."""
    from flashinfer.jit import gen_batch_mla_module
    from flashinfer.mla._batch_mla._backends._fa_common import get_batch_mla_module

    args = (fi_backend, torch.bfloat16, kv_dtype, torch.bfloat16, torch.int32, kv_lora_rank, rope_dim, False)
    spec = gen_batch_mla_module(*args)
    return WarmupModule(spec.name, spec, build_all, partial(get_batch_mla_module, *args))


def swa_module() -> WarmupModule:
    """The one SM90 sliding-window MLA module (all its tactics are in it)."""
    from flashinfer.jit.mla import gen_mla_swa_sm90_module
    from flashinfer.mla._swa import _get_module

    spec = gen_mla_swa_sm90_module()
    return WarmupModule(spec.name, spec, build_all, _get_module)
