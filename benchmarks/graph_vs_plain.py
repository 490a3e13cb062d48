"""Does CUDA-graph timing measure the same work as plain launches? (a benchmark, not a test).

``mla-verify bench`` times rounds captured in a CUDA graph. This times one streaming operation
(``bitwise_not`` over 64 MiB and 512 MiB, two rotating input sets, far above L2 at 512 MiB) both ways with the
bench's own ``CudaTimer``, alternating graph / plain / graph / plain, and prints the medians and their ratio.
Run it alone on the GPU: under contention (other processes, ``pytest -n``) either number moves, which is why
this is not a test -- on a shared H200 a pytest version of it read 0.49 ms vs 0.41 ms.

    python benchmarks/graph_vs_plain.py > graph_vs_plain.txt
"""
from __future__ import annotations

import torch

from mla_verify.backends.base import PreparedCall
from mla_verify.bench.timing import CudaTimer


def main() -> None:
    device = torch.device("cuda")
    timer = CudaTimer(device)
    print(f"# graph vs plain launches: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    for mib in (64, 512):
        pairs = [(torch.ones(mib << 20, dtype=torch.uint8, device=device),
                  torch.empty(mib << 20, dtype=torch.uint8, device=device)) for _ in range(2)]
        calls = [PreparedCall(lambda s=s, d=d: torch.bitwise_not(s, out=d), {}, None, lambda r: (r, None))
                 for s, d in pairs]
        graphed, plain = timer.arm(calls), timer.arm(calls, use_graph=False)
        times = {"graph": [], "plain": []}
        for _ in range(2):
            for name, armed in (("graph", graphed), ("plain", plain)):
                times[name].append(timer.measure(armed).median_s * 1e3)
        ratio = min(times["graph"]) / min(times["plain"])
        print(f"{mib} MiB bitwise_not ({graphed.method} vs {plain.method}): graph ms {times['graph']}, "
              f"plain ms {times['plain']}, graph/plain {ratio:.3f}")


if __name__ == "__main__":
    main()
