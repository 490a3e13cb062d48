"""Sparse kernels that take their process down when an index points past slot ``CRASH_SLOT`` -- as FlashMLA's
sparse kernel reads past its pool when handed an index it does not bounds-check -- and are correct elsewhere
(the CPU stand-in behind FlashMLA's sparse calling convention, mla_verify.kernels.sparse_mutants). Importable as
``crashing_sparse_kernels:NAME`` with tests/ on PYTHONPATH."""
from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import torch

from mla_verify.backends.flashmla_api import FlashMLAApi
from mla_verify.backends.flashmla_sparse import FlashMLASparseBackend
from mla_verify.kernels.sparse_mutants import CPU_SPARSE_ENVELOPE, SparseStandIn

# two 64-token pages hold slots 0..127: a larger index needs a pool of more (sparse_strategies draws two used
# pages and no spare one at the least)
CRASH_SLOT = 128


def _crashing(name: str, crash: Callable[[], None]) -> FlashMLASparseBackend:
    stand_in = SparseStandIn(name=name)

    def decode(*args: Any, indices: torch.Tensor, **kwargs: Any) -> Any:
        if int(indices.max()) >= CRASH_SLOT:
            crash()
        return stand_in.flash_mla_with_kvcache(*args, indices=indices, **kwargs)

    return FlashMLASparseBackend(f"flashmla-sparse-cpu[{name}]", FlashMLAApi(stand_in.get_mla_metadata, decode),
                                 CPU_SPARSE_ENVELOPE, f"crashes on an index >= {CRASH_SLOT}")


def _segfault() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def _cuda_error() -> None:
    """The error torch raises after an illegal memory access (the CUDA context is then unusable), on the CPU."""
    raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")


segfaults_on_large_index = _crashing("segfaults_on_large_index", _segfault)
aborts_on_large_index = _crashing("aborts_on_large_index", os.abort)
cuda_error_on_large_index = _crashing("cuda_error_on_large_index", _cuda_error)
