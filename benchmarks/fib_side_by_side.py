"""flashinfer-bench's evaluator and mla-verify side by side, on the suite's mutants wrapped as flashinfer-bench
solutions -- the dense ones a CPU can catch (and the CPU peer, which both must pass) as solutions of ``mla_paged``
decode definitions, the sparse ones (and the sparse stand-in) of ``dsa_paged`` sparse attention ones: a benchmark,
nothing is asserted.

For each definition asked for (default: h16 MLA decode and DSA at page sizes 1 and 64) and each kernel wrapped by
mla_verify.fib.contract1:

- flashinfer-bench's judgement, its way: 47 workload shapes -- the definition's own captured ones for MLA decode
  (flashinfer-bench ecafa9c2, ``flashinfer_trace/workloads/mla_paged/mla_paged_decode_h16_ckv512_kpe64_ps1.jsonl``:
  batch 1/16/64 and the total KV tokens of each; the same shapes at page size 64, where the dataset has none),
  and for DSA, which has no captured workloads there, the same shapes as decode batches of one query token per
  request, each token's top-k the slots of its own sequence (all of them up to 2048, in random order, then -1)
  -- 3 trials each of fresh ``torch.randn`` values drawn by its own ``gen_inputs``, judged as its
  DefaultEvaluator does (fib/judgement.py). Two things differ from its dataset, and are said in the table's notes:
  the per-request lengths of a batch (their blobs are not in its git repository: a seeded random split of the
  recorded total here) and the pool (989669 pages there, ~1.1 GB of cache per trial; here the pages the batch
  uses, in random order), which changes nothing its reference or a solution reads. Caught: any workload flagged.
- mla-verify's: ``mla-verify check --fib-solution`` on the premerge profile (run.engine.verify on the solution's
  backend), its verdict, minimal case and first failure.

Writes the raw record (``--out``, JSON) and the tables, one per kind of definition, into ``--docs`` between its two
marker lines. ``--evaluator-from`` an earlier record takes flashinfer-bench's verdicts of the kernels judged there
from it, and runs its evaluator on the others only: those verdicts depend on the kernel, flashinfer-bench and the
seeded inputs alone, not on mla-verify's judgement, which is run again on every kernel (the evaluator is most of
the run's time). The record and the tables say which verdicts were taken, and from which commit.

    python benchmarks/fib_side_by_side.py --out mla-verify-results/cpu/fib_side_by_side.json \\
        --docs docs/flashinfer-bench.md [--definitions ps1,ps64,dsa_ps1,dsa_ps64] [--kernels a,b] [--workloads N] \\
        [--evaluator-from EARLIER.json]
    python benchmarks/fib_side_by_side.py --from-record RECORD.json --docs docs/flashinfer-bench.md  # render only
"""
from __future__ import annotations

import argparse
import json
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch
from run_record import REPO, machine_line, machine_record, measured

from mla_verify.fib.contract1 import not_expressible, write_solution
from mla_verify.fib.definition import FibDefinition, read_definition
from mla_verify.fib.judgement import fib_judgement
from mla_verify.fib.solution import FibSolutionBackend, fib_backend, run_as_evaluator
from mla_verify.kernels.mutants import MUTANTS, SPARSE_MUTANTS
from mla_verify.problems.envelope import DENSE, SPARSE
from mla_verify.records.report import invariance_counts
from mla_verify.run.engine import verify

DEFINITIONS = {"ps1": "mla_paged/mla_paged_decode_h16_ckv512_kpe64_ps1.json",
               "ps64": "mla_paged/mla_paged_decode_h16_ckv512_kpe64_ps64.json",
               "h8ps1": "mla_paged/mla_paged_decode_h8_ckv512_kpe64_ps1.json",
               "dsa_ps1": "dsa_paged/dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps1.json",
               "dsa_ps64": "dsa_paged/dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64.json"}
PEER, STAND_IN = "cpu_peer", "correct_sparse_kernel"
# each kind's kernels: the correct one first; the sparse ones by their trtllm-sparse face, which takes a bf16 cache.
# A CPU run: a mutant whose fault shows only past 2^32 elements of the pool (Mutant.device) is left out
TARGETS = {DENSE: {PEER: "mla_verify.backends.cpu_peer:cpu_peer_decode",
                   **{m: f"mla_verify.kernels.mutants:{m}" for m, mutant in MUTANTS.items() if mutant.device == "cpu"}},
           SPARSE: {k: f"mla_verify.kernels.mutants:{k}.trtllm_sparse" for k in (STAND_IN, *SPARSE_MUTANTS)}}
# (batch_size, num_kv_indices) of the 47 workloads of mla_paged_decode_h16_ckv512_kpe64_ps1 at ecafa9c2, in order
WORKLOADS = ((1, 8), (1, 108), (1, 208), (1, 308), (1, 408), (1, 508), (1, 608), (1, 708), (1, 808), (1, 2708),
             (1, 1908), (1, 1008), (1, 2408), (1, 1108), (1, 1208), (16, 2757), (16, 1857), (16, 3557), (16, 4357),
             (16, 7257), (16, 8057), (16, 5057), (16, 9657), (16, 5857), (16, 10857), (16, 6657), (16, 12857),
             (16, 457), (16, 14857), (16, 17257), (16, 8857), (64, 27545), (64, 30745), (64, 33945), (64, 37145),
             (64, 40345), (64, 44845), (64, 48045), (64, 51245), (64, 54445), (64, 57645), (64, 75145), (64, 9945),
             (64, 62345), (64, 16345), (64, 22745), (64, 68745))
SM_SCALE = 0.1352337747812271  # every one of those workloads' sm_scale (1/sqrt(192) with DeepSeek's YaRN mscale)
TRIALS = 3  # its BenchmarkConfig.num_trials
MARK_BEGIN = "<!-- fib side by side: begin (generated by benchmarks/fib_side_by_side.py; do not edit) -->"
MARK_END = "<!-- fib side by side: end -->"


def lengths(batch: int, total: int, seed: int) -> list[int]:
    """``batch`` lengths >= 1 adding up to ``total``: a seeded random split (module docstring)."""
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, total), batch - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(int).tolist()


def _metadata(read: FibDefinition, batch: int, total: int, index: int) -> tuple[dict[str, torch.Tensor], int]:
    """(the workload's index inputs, the pool's pages): each request's pages in random order; for MLA decode the
    CSR page lists, for DSA each request's one query token's top-k -- its sequence's slots, all of them up to topk,
    in random order, then -1."""
    page = read.page_size
    lens = torch.tensor(lengths(batch, total, index), dtype=torch.int32)
    pages = (lens + page - 1) // page
    indptr = torch.nn.functional.pad(torch.cumsum(pages, 0), (1, 0)).to(torch.int32)
    gen = torch.Generator().manual_seed(index)
    table = torch.randperm(int(indptr[-1]), generator=gen).to(torch.int32)
    if read.kind == DENSE:
        meta = {"kv_indptr": indptr, "kv_indices": table,
                "kv_last_page_len": (lens - (pages - 1) * page).to(torch.int32)}
        return {k: v for k, v in meta.items() if k in read.inputs}, int(indptr[-1])
    assert read.topk is not None
    rows = torch.full((batch, read.topk), -1, dtype=torch.int32)
    for b in range(batch):
        own = table[indptr[b]:indptr[b + 1]].long()
        slots = (own[:, None] * page + torch.arange(page)).flatten()[:int(lens[b])]
        chosen = slots[torch.randperm(len(slots), generator=gen)[:read.topk]]
        rows[b, :len(chosen)] = chosen.to(torch.int32)
    return {"sparse_indices": rows}, int(indptr[-1])


def workload_inputs(fib: Any, read: FibDefinition, batch: int, total: int, index: int, trial: int) -> list[Any]:
    """One trial's inputs of workload ``index``, as flashinfer-bench's gen_inputs draws them (random tensors,
    seeded here) around the index inputs of the split lengths."""
    from flashinfer_bench.bench.utils import gen_inputs
    from flashinfer_bench.data import SafetensorsInput, ScalarInput, Workload

    meta, num_pages = _metadata(read, batch, total, index)
    axes = fib.definition.get_axes_values_from_inputs(
        [meta.get(n) if n in meta else _shaped(n, batch, num_pages, read) for n in read.inputs])
    workload = Workload(axes=axes, uuid=f"side-by-side-{index}",
                        inputs={**{k: SafetensorsInput(path="-", tensor_key=k) for k in meta},
                                "sm_scale": ScalarInput(value=SM_SCALE)})
    torch.manual_seed(1000 * index + trial)
    return gen_inputs(fib.definition, workload, "cpu", safe_tensors=meta)


def _shaped(name: str, batch: int, num_pages: int, read: FibDefinition) -> Any:
    """A stand-in of input ``name``'s shape, for flashinfer-bench to read the variable axes from."""
    shapes = {"q_nope": (batch, read.heads, read.kv_lora_rank), "q_pe": (batch, read.heads, read.rope),
              "ckv_cache": (num_pages, read.page_size, read.kv_lora_rank),
              "kpe_cache": (num_pages, read.page_size, read.rope)}
    return torch.empty(shapes[name], dtype=torch.bfloat16) if name in shapes else 0.0


def judge_by_fib(backends: dict[str, FibSolutionBackend], read: FibDefinition, workloads: int) -> dict[str, Any]:
    """Per kernel: the workloads flashinfer-bench's evaluator flags, their statuses, its largest errors."""
    from flashinfer_bench.bench.evaluators.utils import normalize_result
    from flashinfer_bench.compile import BuilderRegistry

    first = next(iter(backends.values()))
    reference = BuilderRegistry.get_instance().build_reference(first.fib.definition)
    found: dict[str, Any] = {k: {"flagged": [], "statuses": {}, "max_abs": 0.0, "max_rel": 0.0} for k in backends}
    for index, (batch, total) in enumerate(WORKLOADS[:workloads]):
        trials = [workload_inputs(first.fib, read, batch, total, index, t) for t in range(TRIALS)]
        with torch.no_grad():
            refs = [normalize_result(first.fib.definition, reference(*args), "cpu") for args in trials]
        for kernel, backend in backends.items():
            solutions = [run_as_evaluator(backend, args, references=[ref])[1][0] for args, ref in zip(trials, refs)]
            verdict = fib_judgement(refs, solutions)
            record = found[kernel]
            if verdict.flagged:
                record["flagged"].append(index)
                record["statuses"][verdict.status] = record["statuses"].get(verdict.status, 0) + 1
            if verdict.max_abs is not None:
                record["max_abs"] = max(record["max_abs"], verdict.max_abs)
                record["max_rel"] = max(record["max_rel"], verdict.max_rel)
        print(f"  workload {index} (B={batch}, {total} tokens): flagged "
              f"{sum(index in r['flagged'] for r in found.values())} of {len(backends)}", flush=True)
    return found


def judge_by_mla_verify(backend: FibSolutionBackend) -> dict[str, Any]:
    with measured() as m:
        result = verify(backend, "cpu", "premerge")
    f = result.failure
    return {"verdict": result.verdict, "cases": len(result.cases), "seconds": round(result.seconds, 2),
            "minimal_case": f.spec.describe() if f else "", "reason": f.reason if f else "",
            "diagnosis": f.diagnosis if f else [], "invariance": invariance_counts(result.cases), **m}


def _gist(reason: str) -> str:
    """A failure's first words: up to where it goes on to say where and by how much."""
    cut = min((i for i in (reason.find(m) for m in (" at ", ": ", ", ")) if i > 0), default=len(reason))
    return reason[:cut].replace("|", "\\|")


def _shape(case: str) -> str:
    """A minimal case's description up to its incidental fields (scales, values, seed)."""
    cut = min((i for i in (case.find(m) for m in (" bmm1=", " topk_lengths=")) if i > 0), default=len(case))
    return case[:cut]


def _cells(record: dict[str, Any], name: str, kernel: str) -> tuple[str, str]:
    d = record["definitions"][name]
    fib, ours, why = d["fib"][kernel], d["mla_verify"][kernel], d["not_expressible"].get(kernel)
    if fib["flagged"]:
        statuses = ", ".join(f"{v} {k}" for k, v in fib["statuses"].items())
        fib_cell = f"**caught** on {len(fib['flagged'])} of {record['workloads']} ({statuses})"
    else:
        fib_cell = f"passed (max abs error {fib['max_abs']:.2g})"
    moved = ours.get("invariance", {}).get("moved", 0)  # a solution's relations are judged within tolerance
    ours_cell = f"passed (bits moved within tolerance on {moved} cases: notes)" if moved else "passed"
    if ours["verdict"] == "fail":
        ours_cell = f"**caught**: {_gist(ours['reason'])}; minimal `{_shape(ours['minimal_case'])}`"
    return (f"{fib_cell}; not expressible: {why}" if why else fib_cell), ours_cell


def table(record: dict[str, Any], kind: str) -> str:
    """The summary lines and the table of the recorded definitions of ``kind``."""
    names = [n for n, d in record["definitions"].items() if d["kind"] == kind]
    correct, mutants = (PEER, MUTANTS) if kind == DENSE else (STAND_IN, SPARSE_MUTANTS)
    kernels = record["kernels"][kind]
    lines = []
    for name in names:
        d = record["definitions"][name]
        expressible = [k for k in kernels if k in mutants and k not in d["not_expressible"]]
        fib = sum(bool(d["fib"][k]["flagged"]) for k in expressible)
        ours = sum(d["mla_verify"][k]["verdict"] == "fail" for k in expressible)
        passes = correct not in d["fib"] or (not d["fib"][correct]["flagged"]
                                             and d["mla_verify"][correct]["verdict"] == "pass")
        lines.append(f"- `{d['definition']}`: of the {len(expressible)} mutants it can express, flashinfer-bench's "
                     f"evaluator catches {fib}, mla-verify {ours}; the correct kernel (`{correct}`) passes both: "
                     f"{'yes' if passes else 'NO'}.")
    lines += ["", f"| kernel | {'bug class' if kind == DENSE else 'fault'} | " + " | ".join(
        f"{n}: flashinfer-bench's evaluator ({record['workloads']} workloads x {TRIALS} trials) | {n}: mla-verify "
        "premerge" for n in names) + " |", "|---|---|" + "---|---|" * len(names)]
    for kernel in kernels:
        what = MUTANTS[kernel].bug_class if kind == DENSE and kernel in MUTANTS else \
            SPARSE_MUTANTS[kernel].description if kernel in SPARSE_MUTANTS else "(correct kernel)"
        cells = [c for name in names for c in _cells(record, name, kernel)]
        lines.append(f"| {kernel} | {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(record: dict[str, Any]) -> str:
    kinds = [k for k in (DENSE, SPARSE) if any(d["kind"] == k for d in record["definitions"].values())]
    taken = record.get("evaluator_from")
    reused = "" if not taken else (
        f" flashinfer-bench's evaluator's verdicts of {_count_taken(taken)} are taken from the run at commit "
        f"{taken['commit'][:7]} ({taken['date'][:10]}, `results:cpu/{taken['record']}`; `--evaluator-from`: they "
        "depend on the kernel, flashinfer-bench and the seeded inputs alone); the evaluator judged any other "
        "kernel here, mla-verify every one.")
    return "\n\n".join([f"Generated by `benchmarks/fib_side_by_side.py`: {machine_line(record['machine'])}; "
                         f"flashinfer-bench {record['flashinfer_bench']}. Raw record: "
                         f"`results:cpu/fib_side_by_side.json`.{reused}", *(table(record, k) for k in kinds)])


def _count_taken(taken: dict[str, Any]) -> str:
    """How many (kernel, definition) verdicts were taken, in words."""
    kernels = {k for ks in taken["kernels"].values() for k in ks}
    return f"{len(kernels)} kernels on {len(taken['kernels'])} definitions"


def earlier_verdicts(path: Path, flashinfer_bench: str, workloads: int) -> dict[str, Any]:
    """An earlier raw record whose evaluator's verdicts can stand for this run's: the same flashinfer-bench
    version, workload shapes and trials (SystemExit naming what differs)."""
    earlier = json.loads(path.read_text())
    asked = {"flashinfer_bench": flashinfer_bench, "workloads": workloads, "trials": TRIALS}
    differs = {k: (earlier.get(k), v) for k, v in asked.items() if earlier.get(k) != v}
    if differs:
        what = ", ".join(f"{k} {a} (here {b})" for k, (a, b) in differs.items())
        raise SystemExit(f"--evaluator-from {path}: its {what} differ: its evaluator's verdicts are not this run's")
    return earlier


def write_table(docs: Path, record: dict[str, Any]) -> None:
    text = docs.read_text()
    begin, end = text.index(MARK_BEGIN) + len(MARK_BEGIN), text.index(MARK_END)
    docs.write_text(text[:begin] + "\n" + tables(record) + "\n" + text[end:])
    print(f"wrote the tables into {docs}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="the raw record (JSON)")
    ap.add_argument("--docs", type=Path, help="a Markdown file with the marker lines: the tables go between them")
    ap.add_argument("--definitions", default="ps1,ps64,dsa_ps1,dsa_ps64",
                    help=f"comma-separated, of {', '.join(DEFINITIONS)}")
    ap.add_argument("--kernels", default="", help="comma-separated kernel names of either kind (default: all)")
    ap.add_argument("--workloads", type=int, default=len(WORKLOADS), help="the first N workload shapes only")
    ap.add_argument("--from-record", type=Path, help="only render --docs' tables from this raw record")
    ap.add_argument("--evaluator-from", type=Path, metavar="EARLIER.json",
                    help="take flashinfer-bench's verdicts of the kernels judged in this earlier raw record from it "
                         "(module docstring)")
    args = ap.parse_args(argv)
    if args.from_record is not None:
        write_table(args.docs, json.loads(args.from_record.read_text()))
        return
    if args.out is None:
        ap.error("--out is required to run (only --from-record renders without it)")
    torch.set_num_threads(1)  # as mla-verify check runs on CPU
    asked = [k for k in args.kernels.split(",") if k]
    kernels = {kind: [k for k in targets if not asked or k in asked] for kind, targets in TARGETS.items()}
    record: dict[str, Any] = {"machine": machine_record(), "flashinfer_bench": version("flashinfer-bench"),
                              "workloads": args.workloads, "trials": TRIALS, "kernels": kernels, "definitions": {}}
    earlier = None
    if args.evaluator_from is not None:
        earlier = earlier_verdicts(args.evaluator_from, record["flashinfer_bench"], args.workloads)
        record["evaluator_from"] = {"record": args.evaluator_from.name, "commit": earlier["machine"]["commit"],
                                    "date": earlier["machine"]["date"], "kernels": {}}
    scratch = Path(tempfile.mkdtemp(prefix="fib-side-by-side-"))
    for name in args.definitions.split(","):
        path = REPO / "fixtures" / "fib" / "definitions" / DEFINITIONS[name]
        read = read_definition(json.loads(path.read_text()), str(path))
        backends: dict[str, FibSolutionBackend] = {}
        for kernel in kernels[read.kind]:
            solution = write_solution(scratch / f"{kernel}_{read.name}.json", f"{kernel}_{read.name}",
                                      TARGETS[read.kind][kernel], read)
            backends[kernel] = fib_backend(solution, path)
        fib = dict(earlier["definitions"].get(name, {}).get("fib", {})) if earlier is not None else {}
        fib = {k: v for k, v in fib.items() if k in backends}
        if earlier is not None:
            record["evaluator_from"]["kernels"][name] = sorted(fib)
        print(f"{read.name}: flashinfer-bench's evaluator ({len(fib)} verdicts taken)", flush=True)
        with measured() as m:
            todo = {k: b for k, b in backends.items() if k not in fib}
            fib.update(judge_by_fib(todo, read, args.workloads) if todo else {})
        ours = {}
        for kernel, backend in backends.items():
            ours[kernel] = judge_by_mla_verify(backend)
            print(f"{read.name}: mla-verify on {kernel}: {ours[kernel]['verdict']}", flush=True)
        record["definitions"][name] = {"definition": read.name, "kind": read.kind, "fib": fib, "fib_measured": m,
                                       "mla_verify": ours,
                                       "not_expressible": {k: not_expressible(k, read) for k in backends
                                                           if not_expressible(k, read)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    if args.docs is not None:
        write_table(args.docs, record)


if __name__ == "__main__":
    main()
