"""Sparse kernels that take their process down when an index points past slot ``CRASH_SLOT`` -- as FlashMLA's
sparse kernel reads past its pool when handed an index it does not bounds-check -- and are correct elsewhere
(the CPU stand-in behind FlashMLA's sparse calling convention, mla_verify.kernels.flashmla_cpu; the installed
FlashMLA for ``gathers_past_its_pool``, a GPU kernel: tests/gpu/test_crash_gpu.py). Importable as
``crashing_sparse_kernels:NAME`` with tests/ on PYTHONPATH."""
from __future__ import annotations

import functools
import itertools
import os
import signal
from collections.abc import Callable
from typing import Any

import torch

from mla_verify.backends.base import PreparedCall
from mla_verify.backends.flashmla_api import FlashMLAApi, installed_api
from mla_verify.backends.flashmla_sparse import FlashMLASparseBackend
from mla_verify.kernels.flashmla_cpu import CPU_SPARSE_ENVELOPE, SparseStandIn
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.sparse import SPARSE_LAYOUT, SparseDecodeProblem

# two 64-token pages hold slots 0..127: a larger index needs a pool of more (sparse_strategies draws two used
# pages and no spare one at the least)
CRASH_SLOT = 128


def _crashing(name: str, crash: Callable[[], None]) -> FlashMLASparseBackend:
    stand_in = SparseStandIn(name=name)

    @functools.wraps(stand_in.flash_mla_with_kvcache)  # its signature: the wheel's interface (use_legacy)
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


def _out_of_memory() -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _every_third_call_wrong() -> FlashMLASparseBackend:
    """Not a crash: output doubled on every third call, so a replay may pass (a flaky kernel)."""
    stand_in, calls = SparseStandIn(name="every_third_call_wrong"), itertools.count()

    @functools.wraps(stand_in.flash_mla_with_kvcache)
    def decode(*args: Any, **kwargs: Any) -> Any:
        out, lse = stand_in.flash_mla_with_kvcache(*args, **kwargs)
        return (out * 2 if next(calls) % 3 == 0 else out), lse

    return FlashMLASparseBackend("flashmla-sparse-cpu[every_third_call_wrong]",
                                 FlashMLAApi(stand_in.get_mla_metadata, decode), CPU_SPARSE_ENVELOPE)


segfaults_on_large_index = _crashing("segfaults_on_large_index", _segfault)
every_third_call_wrong = _every_third_call_wrong()
out_of_memory_on_large_index = _crashing("out_of_memory_on_large_index", _out_of_memory)
aborts_on_large_index = _crashing("aborts_on_large_index", os.abort)
cuda_error_on_large_index = _crashing("cuda_error_on_large_index", _cuda_error)


class _GathersPastItsPool(FlashMLASparseBackend):
    """flashmla-sparse (the installed FlashMLA) that, handed an index at or past CRASH_SLOT, first gathers cache
    rows past its pool through torch's indexing, as a kernel trusting its indices reads: on CUDA a device-side
    assert, which leaves the process's CUDA context unusable."""

    def prepare(self, problem: SparseDecodeProblem, layout: LayoutSpec = SPARSE_LAYOUT) -> PreparedCall:
        if self.api is None:  # flash_mla is imported only where this backend runs
            real = installed_api()

            @functools.wraps(real.flash_mla_with_kvcache)  # its signature tells the wheel's interface apart
            def decode(q: torch.Tensor, k_cache: torch.Tensor, *args: Any, indices: torch.Tensor,
                       **kwargs: Any) -> Any:
                if int(indices.max()) >= CRASH_SLOT:
                    pool = k_cache.reshape(-1, k_cache.shape[-1])
                    past = torch.arange(pool.shape[0], pool.shape[0] + 64, device=pool.device)
                    float(pool[past].float().sum())  # the sync makes the error surface here
                return real.flash_mla_with_kvcache(q, k_cache, *args, indices=indices, **kwargs)

            self.api = FlashMLAApi(real.get_mla_metadata, decode, real.get_mla_decoding_metadata)
        return super().prepare(problem, layout)


gathers_past_its_pool = _GathersPastItsPool("flashmla-sparse[gathers_past_its_pool]")
