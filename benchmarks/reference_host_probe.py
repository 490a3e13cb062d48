"""Host cost of the fast reference's operations on a GPU machine (a benchmark, not a test).

Times, with the GPU idle, the host side of the operations the reference issues (per call of each, averaged
over 200), then the whole fast reference on (B=128, H=128, seq <= 4096, page 64) with the grouping floor and
the memory cap varied, and under ``torch.inference_mode`` / ``no_grad``. Printed, one line each:

    python benchmarks/reference_host_probe.py > host_probe.txt
"""
import time, statistics
import torch
from mla_verify import reference as R
from mla_verify.bench import BenchCase
from mla_verify.generate import build_problem
dev = torch.device("cuda")
p = build_problem(BenchCase(128, 128, 4096, 64).spec(0), dev)
lens = p.seq_lens.tolist(); order = sorted(range(128), key=lambda i: -lens[i]); idx = torch.tensor(order, device=dev)
ops = {
 "tolist": lambda: p.seq_lens.tolist(),
 "py sort": lambda: sorted(range(128), key=lambda i: -lens[i]),
 "torch.sort": lambda: torch.sort(p.seq_lens, descending=True, stable=True),
 "torch.tensor(order)": lambda: torch.tensor(order, device=dev),
 "table[idx]": lambda: p.block_table[idx],
 "query[idx]": lambda: p.query[idx],
 "arange": lambda: torch.arange(4096, device=dev),
 "add": lambda: idx + 1,
 "empty": lambda: torch.empty((128, 128, 512), device=dev),
 "slice": lambda: idx[3:9],
}
for name, fn in ops.items():
    fn(); torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(200): fn()
    torch.cuda.synchronize(); print(f"{name}: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us")
def ev(fn, n=15):
    fn(); torch.cuda.synchronize(); s = []
    for _ in range(n):
        torch.cuda._sleep(1_000_000); a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); s.append(a.elapsed_time(b))
    return round(statistics.median(s), 3)
fast = lambda: R.reference_decode(p, torch.float32, matmul="bf16-split")
for floor, chunk in ((384 << 20, None), (1 << 40, None), (1 << 40, 3 * 303 << 20), (1 << 40, 1 << 40)):
    R.MIN_GROUP_BYTES = floor
    call = lambda: R.reference_decode(p, torch.float32, chunk_bytes=chunk, matmul="bf16-split")  # noqa: E731
    print("B128 floor", floor >> 20, "chunk", chunk, ev(call))
R.MIN_GROUP_BYTES = 384 << 20
with torch.inference_mode():
    print("B128 inference_mode", ev(fast))
with torch.no_grad():
    print("B128 no_grad", ev(fast))
print("B128 plain", ev(fast))
