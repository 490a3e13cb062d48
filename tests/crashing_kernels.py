"""Contract-1 kernels that take their process down on some inputs only, for the crash tests: correct
elsewhere (the CPU peer, which runs on any device). Importable as ``crashing_kernels:NAME`` with tests/ on
PYTHONPATH. The ``*_past_its_pool`` ones are GPU kernels (tests/gpu/test_crash_gpu.py)."""
from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Any

import torch
from cli_kernels import SMALL_ENVELOPE  # small problems: each case takes milliseconds

from mla_verify.backends.cpu_peer import cpu_peer_decode

CRASH_BATCH = 3  # segfaults and hangs from this batch size on (SMALL_ENVELOPE's largest)
CRASH_SEQ_LEN = 20  # aborts or exits on a sequence longer than this (SMALL_ENVELOPE goes to 40)
EXIT_CODE = 3


def _batch(query: torch.Tensor) -> int:
    return int(query.shape[0])


def segfaults_on_big_batches(query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Reads address 0 (SIGSEGV) when the batch has CRASH_BATCH requests or more."""
    if _batch(query) >= CRASH_BATCH:
        ctypes.string_at(0)
    return cpu_peer_decode(query, *args, **kwargs)


def aborts_on_long_sequences(query: torch.Tensor, kv_cache: torch.Tensor, workspace: Any, nope: int, rank: int,
                             rope: int, block_tables: torch.Tensor, seq_lens: torch.Tensor, *args: Any,
                             **kwargs: Any) -> Any:
    """os.abort() (SIGABRT) when a sequence is longer than CRASH_SEQ_LEN tokens."""
    if int(seq_lens.max()) > CRASH_SEQ_LEN:
        os.abort()
    return cpu_peer_decode(query, kv_cache, workspace, nope, rank, rope, block_tables, seq_lens, *args, **kwargs)


def exits_on_long_sequences(query: torch.Tensor, kv_cache: torch.Tensor, workspace: Any, nope: int, rank: int,
                            rope: int, block_tables: torch.Tensor, seq_lens: torch.Tensor, *args: Any,
                            **kwargs: Any) -> Any:
    """Ends its process at once with exit code EXIT_CODE (as a native library calling exit() does) when a sequence
    is longer than CRASH_SEQ_LEN tokens."""
    if int(seq_lens.max()) > CRASH_SEQ_LEN:
        os._exit(EXIT_CODE)
    return cpu_peer_decode(query, kv_cache, workspace, nope, rank, rope, block_tables, seq_lens, *args, **kwargs)


def hangs_in_native_code_on_big_batches(query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Never returns, where no signal reaches it (as a stuck native call), when the batch has CRASH_BATCH
    requests or more."""
    if _batch(query) >= CRASH_BATCH:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    return cpu_peer_decode(query, *args, **kwargs)


def cuda_error_on_big_batches(query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Raises the error torch raises after an illegal memory access (which leaves the CUDA context unusable)
    when the batch has CRASH_BATCH requests or more: a GPU kernel's crash, on the CPU."""
    if _batch(query) >= CRASH_BATCH:
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    return cpu_peer_decode(query, *args, **kwargs)


def gathers_past_its_pool(query: torch.Tensor, kv_cache: torch.Tensor, workspace: Any, nope: int, rank: int,
                          rope: int, block_tables: torch.Tensor, seq_lens: torch.Tensor, *args: Any,
                          **kwargs: Any) -> Any:
    """When a sequence is longer than CRASH_SEQ_LEN tokens, gathers cache rows past the pool's end, as a kernel
    trusting its indices does: on CUDA, torch's indexing kernel then fails a device-side assert, which leaves
    the process's CUDA context unusable."""
    if int(seq_lens.max()) > CRASH_SEQ_LEN:
        pool = kv_cache.reshape(-1, kv_cache.shape[-1])
        past = torch.arange(pool.shape[0], pool.shape[0] + 64, device=pool.device)
        float(pool[past].float().sum())  # the sync makes the error surface here
    return cpu_peer_decode(query, kv_cache, workspace, nope, rank, rope, block_tables, seq_lens, *args, **kwargs)


def reads_far_past_its_pool(query: torch.Tensor, kv_cache: torch.Tensor, workspace: Any, nope: int, rank: int,
                            rope: int, block_tables: torch.Tensor, seq_lens: torch.Tensor, *args: Any,
                            **kwargs: Any) -> Any:
    """When a sequence is longer than CRASH_SEQ_LEN tokens, a Triton kernel loads 2**40 elements past the cache
    with no mask: an illegal memory access."""
    if int(seq_lens.max()) > CRASH_SEQ_LEN:
        _read_at(kv_cache, 1 << 40)
    return cpu_peer_decode(query, kv_cache, workspace, nope, rank, rope, block_tables, seq_lens, *args, **kwargs)


def _read_at(tensor: torch.Tensor, offset: int) -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def read_one(src, dst, offset):
        tl.store(dst, tl.load(src + offset))  # no mask, no bounds check

    dst = torch.empty(1, dtype=tensor.dtype, device=tensor.device)
    read_one[(1,)](tensor, dst, offset)
    torch.cuda.synchronize(tensor.device)


for kernel in (segfaults_on_big_batches, aborts_on_long_sequences, exits_on_long_sequences,
               hangs_in_native_code_on_big_batches, cuda_error_on_big_batches):
    kernel.mla_verify_envelope = SMALL_ENVELOPE  # type: ignore[attr-defined]
for kernel in (gathers_past_its_pool, reads_far_past_its_pool):
    kernel.mla_verify_envelope = {**SMALL_ENVELOPE, "devices": ["cuda"]}  # type: ignore[attr-defined]
