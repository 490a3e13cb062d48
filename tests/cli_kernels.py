"""Small Contract-1 kernels for the CLI tests: the CPU peer held to a tiny envelope (fast cases), and a faulty
twin that scales the scores wrongly. Importable as ``cli_kernels:good`` with tests/ on PYTHONPATH."""
from __future__ import annotations

from typing import Any

import torch

from mla_verify.backends.cpu_peer import cpu_peer_decode

# Tiny problems only: each case takes milliseconds on a 2-core machine.
SMALL_ENVELOPE = {"devices": ["cpu"], "page_sizes": [4, 16], "dims": [[256, 64]], "heads": [1, 2, 3],
                  "q_len": [1, 2], "max_batch": 3, "max_seq_len": 40}
WRONG_SCALE = 1.25


def good(*args: Any, **kwargs: Any) -> Any:
    return cpu_peer_decode(*args, **kwargs)


def wrong_scale(*args: Any, bmm1_scale: float = 1.0, **kwargs: Any) -> Any:
    """Multiplies the softmax scale by 1.25: wrong by a clear margin on every multi-token sequence."""
    return cpu_peer_decode(*args, bmm1_scale=bmm1_scale * WRONG_SCALE, **kwargs)


good.mla_verify_envelope = SMALL_ENVELOPE
wrong_scale.mla_verify_envelope = SMALL_ENVELOPE


def gpu_only(*args: Any, **kwargs: Any) -> Any:
    """Declares a CUDA-only envelope: on a CPU run it must be skipped with its reason."""
    return cpu_peer_decode(*args, **kwargs)


gpu_only.mla_verify_envelope = {**SMALL_ENVELOPE, "devices": ["cuda"]}


def needs_cuda(*args: Any, **kwargs: Any) -> Any:
    """The CPU peer (any device), refused where torch refuses CUDA: in a process forked from one that
    initialised CUDA (tests/test_worker_start.py fakes such a parent on a machine without CUDA; on a GPU,
    benchmarks/fresh_runner.py's cudainit phase runs it from a real one)."""
    if torch.cuda._is_in_bad_fork():
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you "
                           "must use the 'spawn' start method")
    return cpu_peer_decode(*args, **kwargs)


needs_cuda.mla_verify_envelope = {**SMALL_ENVELOPE, "devices": ["cpu", "cuda"]}
