"""Contract-1 kernels that take their process down on some inputs only, for the crash tests: correct
elsewhere. Importable as ``crashing_kernels:NAME`` with tests/ on PYTHONPATH."""
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
CRASH_SEQ_LEN = 20  # aborts on a sequence longer than this (SMALL_ENVELOPE goes to 40)


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


for kernel in (segfaults_on_big_batches, aborts_on_long_sequences, hangs_in_native_code_on_big_batches,
               cuda_error_on_big_batches):
    kernel.mla_verify_envelope = SMALL_ENVELOPE  # type: ignore[attr-defined]
