"""Shadow mode's cost per call (a benchmark, not a test): one decode call, plain and under shadow mode.

For each case (batch, longest sequence, heads) it builds a problem on the device and calls the kernel the way an
engine does -- by the name its module binds -- N times plain, N times under a recording session that checks every
call, and N times under one that checks 1 call in 10; each call is followed by a device synchronisation. It prints
the median milliseconds per call of each and the difference to the plain call: the overhead of a checked call
(argument checks, the reference, the tolerance model) and what sampling leaves of it. On CUDA the kernel is
FlashInfer's fa3 (``--backend fa2`` for fa2) through ``BatchMLAPagedAttentionWrapper``; on CPU the CPU peer,
shadowed as a registered Contract-1 kernel. Each row ends with how many calls each session compared; the exit
code is 1 when one mismatched (the kernels are correct) or compared none (its timing checked nothing).

    python benchmarks/shadow_overhead.py --device cuda > shadow_overhead.txt
"""
from __future__ import annotations

import argparse
import datetime
import io
import statistics
import sys
import time
from collections.abc import Callable

import torch

from mla_verify.backends.cpu_peer import cpu_peer_decode
from mla_verify.core.dims import R1_SOFTMAX_SCALE
from mla_verify.core.platform import platform_info
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec, wrapper_args
from mla_verify.problems.problem import DecodeProblem
from mla_verify.shadow import shadow

CASES = {"cuda": ((8, 1024, 16), (64, 2048, 16), (128, 4096, 128)), "cpu": ((2, 256, 16), (4, 1024, 16))}
SAMPLED_EVERY = 10
Call = Callable[[], object]


def case_problem(batch: int, longest: int, heads: int, device: torch.device) -> DecodeProblem:
    """Lengths spread evenly from half the longest to the longest; DeepSeek-R1's scale; 64-token pages."""
    lens = tuple(longest // 2 + (longest - longest // 2) * i // max(1, batch - 1) for i in range(batch))
    spec = ProblemSpec(seq_lens=lens, num_heads=heads, page_size=64, softmax_scale=R1_SOFTMAX_SCALE, seed=batch)
    return build_problem(spec, device)


def wrapper_call(problem: DecodeProblem, backend: str) -> tuple[Call, Call]:
    """(plan, run) of FlashInfer's wrapper on the problem: plan inside a session, so that its runs are read."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    a = wrapper_args(problem, LayoutSpec())
    wrapper = BatchMLAPagedAttentionWrapper(torch.zeros(128 << 20, dtype=torch.uint8, device=problem.device),
                                            backend=backend)
    out = torch.empty((problem.batch, problem.num_heads, 512), dtype=torch.bfloat16, device=problem.device)

    def plan() -> None:
        wrapper.plan(metadata=MLAPlanMetadata.csr(a.qo_indptr, a.kv_indptr, a.kv_indices, a.kv_len_arr),
                     num_heads=problem.num_heads, head_dim_ckv=512, head_dim_kpe=64, page_size=problem.page_size,
                     causal=True, sm_scale=problem.bmm1_scale, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16, query_layout="split", kv_cache_layout="split",
                     output_dtype=torch.bfloat16)

    return plan, lambda: wrapper.run(query=(a.q_nope, a.q_pe), kv_cache=(a.ckv, a.kpe), out=out)


def peer_call(problem: DecodeProblem) -> tuple[Call, Call]:
    p = problem
    out = torch.empty(p.out_shape, dtype=torch.bfloat16)
    return (lambda: None), (lambda: cpu_peer_decode(p.query, p.kv_cache, None, 128, 512, 64, p.block_table,
                                                    p.seq_lens, int(p.seq_lens.max()), out=out,
                                                    bmm1_scale=p.bmm1_scale))


def median_ms(call: Call, calls: int, device: torch.device) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", choices=("fa3", "fa2"), default="fa3", help="the wrapper path on CUDA")
    parser.add_argument("--calls", type=int, default=20, help="calls timed per variant (default 20)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    kernel = args.backend if device.type == "cuda" else "cpu-peer"
    print(f"# shadow-mode overhead per call, {datetime.date.today()}, kernel {kernel}, {args.calls} calls each")
    print(f"# {platform_info().describe()}")
    print("# case: plain ms | every call checked ms (+overhead) | 1 in 10 checked ms (+overhead) [calls judged]")
    faulty = False
    for batch, longest, heads in CASES[device.type]:
        problem = case_problem(batch, longest, heads, device)
        plan, run = wrapper_call(problem, args.backend) if device.type == "cuda" else peer_call(problem)
        plan()
        median_ms(run, 3, device)  # warm-up: JIT modules, allocator
        plain = median_ms(run, args.calls, device)
        timed, tallies = [], []
        for every in (1, SAMPLED_EVERY):
            with shadow("record", every=every, kernels=[cpu_peer_decode] if device.type == "cpu" else [],
                        stream=io.StringIO(), summary=False) as session:
                plan()
                timed.append(median_ms(run, args.calls, device))
            total = session.tally.total()
            tallies.append(f"{total.compared} compared, {total.mismatched} mismatched")
            # a correct kernel, so every checked call must agree; and a checked timing must have checked calls
            faulty = faulty or total.mismatched > 0 or total.compared == 0
        checked, sampled = timed
        print(f"B={batch} seq<={longest} H={heads}: {plain:.3f} | {checked:.3f} (+{checked - plain:.3f}) | "
              f"{sampled:.3f} (+{sampled - plain:.3f})  [{'; '.join(tallies)}]")
    return 1 if faulty else 0


if __name__ == "__main__":
    sys.exit(main())
