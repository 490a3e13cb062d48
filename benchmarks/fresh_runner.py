"""Minutes to the first verdict on a fresh GPU runner, with and without a restored JIT cache (issue #33).

Phases, each in fresh processes with its own cache directories (FLASHINFER_WORKSPACE_BASE for FlashInfer's JIT
workspace, CUDA_CACHE_PATH for the driver's compute cache, ~/.nv/ComputeCache by default):

  nocache    `check --device cuda` (the README's main job) with both caches empty; then both are packed into
             cache.tar.gz, as a CI cache would keep them
  restored   the same command with the tarball unpacked into new, empty directories
  fuzz       `check --backend fa3 --profile fuzz --minutes M` with the tarball unpacked: judged cases per
             second over the whole command (start-up and warm-up included) and within the cases
  firstcall  where a cached module's first call goes: CUDA start, `import flashinfer`, then per module the
             ninja up-to-date check, the library load, and the first and second prepare (the wrapper's plan)
             and kernel call of one small case, each timed alone; once with the driver's compute cache
             restored and once with it empty (what the driver compiles from PTX shows as the difference and as
             the files it adds to its cache); plus the PTX and SASS each module's library holds (cuobjdump)

    source .gpu-bundle/activate.sh && python3 benchmarks/fresh_runner.py --out $OUT/fresh [--phases ...]

Writes $OUT/fresh/fresh_runner.json (every number, merged over calls), one log per command, and the reports of
the check runs; the tarball stays in --work (default /tmp/mla-fresh; --cache takes one from elsewhere).
Exit code 0 when every command ran and passed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

PHASES = ("nocache", "restored", "fuzz", "firstcall")
CHECK = [sys.executable, "-m", "mla_verify.cli", "check", "--device", "cuda"]


def cache_env(root: Path) -> dict[str, str]:
    """The environment of a run whose two caches live under ``root`` (created empty when missing)."""
    (root / "ws").mkdir(parents=True, exist_ok=True)
    (root / "nv").mkdir(parents=True, exist_ok=True)
    return {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(root / "ws"), "CUDA_CACHE_PATH": str(root / "nv")}


def restored(work: Path, name: str) -> Path:
    """A new directory with cache.tar.gz unpacked into it, as a CI runner restores its cache."""
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with tarfile.open(work / "cache.tar.gz") as tar:
        tar.extractall(root, filter="tar")  # our own tarball, made by the nocache phase
    return root


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed(command: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    began = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = round(time.perf_counter() - began, 1)
    lines = log.read_text().splitlines()
    keep = [ln for ln in lines if ln.startswith(("warm-up", "  warm-up", "reference self-check")) or ": PASS" in ln
            or ": FAIL" in ln or "judged in" in ln]
    print(f"{log.stem}: rc {rc} in {seconds} s", flush=True)
    return {"command": " ".join(command), "rc": rc, "seconds": seconds, "lines": keep}


def phase_check(work: Path, out: Path, name: str, root: Path) -> dict[str, Any]:
    report = out / f"{name}.json"
    result = timed([*CHECK, "--report", str(report), "--fixtures-dir", str(work / "reg")], cache_env(root),
                   out / f"{name}.log")
    if report.exists():
        run = json.loads(report.read_text())["run"]
        result.update(warmup=run.get("warmup"), warmup_s=run.get("warmup_s"), throughput=run.get("throughput"))
    return result


def phase_fuzz(work: Path, out: Path, minutes: float) -> dict[str, Any]:
    report = out / "fuzz_fa3.json"
    command = [*CHECK, "--backend", "fa3", "--profile", "fuzz", "--minutes", str(minutes), "--report", str(report),
               "--fixtures-dir", str(work / "reg")]
    result = timed(command, cache_env(restored(work, "fuzz")), out / "fuzz_fa3.log")
    if report.exists():
        run = json.loads(report.read_text())["run"]
        fa3 = run["throughput"]["fa3"]
        result.update(warmup=run.get("warmup"), warmup_s=run.get("warmup_s"), throughput=fa3,
                      judged_per_s_overall=round(fa3["judged"] / result["seconds"], 2))
    return result


def phase_firstcall(work: Path, out: Path) -> dict[str, Any]:
    """The probe below in a fresh process: with the compute cache as restored, then with it emptied."""
    found: dict[str, Any] = {}
    for label, empty_nv in (("restored", False), ("compute_cache_empty", True)):
        root = restored(work, f"first_{label}")
        if empty_nv:
            shutil.rmtree(root / "nv", ignore_errors=True)
        env = cache_env(root)
        before = du(root / "nv")
        log = out / f"firstcall_{label}.log"
        run = timed([sys.executable, __file__, "--probe", str(out / f"firstcall_{label}.json")], env, log)
        probe = out / f"firstcall_{label}.json"
        found[label] = {"rc": run["rc"], "seconds": run["seconds"],
                        "compute_cache_bytes_added": du(root / "nv") - before,
                        **(json.loads(probe.read_text()) if probe.exists() else {})}
    return found


# ---------------------------------------------------------------- the probe (run in its own process)
def probe(path: Path) -> None:
    import torch

    stages: dict[str, Any] = {}

    def clock(key: str, fn: Any) -> Any:
        torch.cuda.synchronize()
        began = time.perf_counter()
        value = fn()
        torch.cuda.synchronize()
        stages[key] = round(time.perf_counter() - began, 3)
        return value

    began = time.perf_counter()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    start = {"cuda_start": round(time.perf_counter() - began, 3)}
    clock("import flashinfer.mla", lambda: __import__("flashinfer.mla"))
    start.update(stages)
    from mla_verify.backends import get_backend
    from mla_verify.draw.strategies import budget_for, corner_cases
    from mla_verify.problems.generate import build_problem

    device = torch.device("cuda")
    modules: dict[str, Any] = {}
    for name in ("fa3", "fa2", "flashinfer-swa"):
        backend = get_backend(name)
        first = corner_cases(backend.envelope, budget_for(device))[0]
        for module in backend.warmup(device):
            spec = module.spec
            one: dict[str, Any] = {"backend": name, "library": str(spec.get_library_path()), "stages_s": {}}
            modules[module.name] = one
            stages.clear()
            try:
                clock("ninja up-to-date check", spec.build)
                clock("library load", spec.load)
                clock("load through FlashInfer's getter", module.load)
                one["stages_s"].update(stages)
                one["cuobjdump"] = cuobjdump(spec.get_library_path())
                dtype, rank, rope = module_case(name, module.name)
                spec_case = replace(first.spec, dtype=dtype, kv_lora_rank=rank, qk_rope_head_dim=rope)
                problem = build_problem(spec_case, device)
                for attempt in ("first", "second"):
                    stages.clear()
                    call = clock(f"{attempt} prepare (plan)", partial(backend.prepare, problem, first.layout))
                    clock(f"{attempt} kernel call", call.invoke)
                    one["stages_s"].update(stages)
            except Exception as exc:  # noqa: BLE001 - the other modules are still measured
                one["stages_s"].update(stages)
                one["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            print(module.name, one, flush=True)
    path.write_text(json.dumps({"start_s": start, "modules": modules}, indent=1))


def module_case(backend: str, module: str) -> tuple[str, int, int]:
    """(dtype, kv_lora_rank, rope) of a module, read from its FlashInfer name."""
    if backend == "flashinfer-swa":
        return "bf16", 1024, 64
    dtype = "fp8" if "dtype_kv_e4m3" in module else "bf16"
    rank = int(module.split("head_dim_ckv_")[1].split("_")[0])
    rope = int(module.split("head_dim_kpe_")[1].split("_")[0])
    return dtype, rank, rope


def cuobjdump(library: Path) -> dict[str, int] | str:
    """How many SASS (ELF) and PTX images the library holds: PTX only would be compiled by the driver."""
    tool = shutil.which("cuobjdump")
    if tool is None:
        return "cuobjdump not found"
    counts = {}
    for kind, flag in (("sass", "-lelf"), ("ptx", "-lptx")):
        listed = subprocess.run([tool, flag, str(library)], capture_output=True, text=True)
        counts[kind] = sum(1 for ln in listed.stdout.splitlines() if ln.strip())
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/mla-out")) / "fresh")
    parser.add_argument("--work", type=Path, default=Path("/tmp/mla-fresh"), help="caches and reproducers")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--fuzz-minutes", type=float, default=2.0)
    parser.add_argument("--cache", type=Path, help="cache.tar.gz of an earlier nocache phase (default: --work's)")
    parser.add_argument("--probe", type=Path, help=argparse.SUPPRESS)  # the firstcall phase's child
    ns = parser.parse_args(argv)
    if ns.probe:
        probe(ns.probe)
        return 0
    ns.out.mkdir(parents=True, exist_ok=True)
    record_path = ns.out / "fresh_runner.json"
    record: dict[str, Any] = json.loads(record_path.read_text()) if record_path.exists() else {}
    record["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    record["cores"] = os.cpu_count()
    if "nocache" in ns.phases:
        shutil.rmtree(ns.work, ignore_errors=True)
        cold = ns.work / "cold"
        record["nocache"] = phase_check(ns.work, ns.out, "nocache", cold)
        began = time.perf_counter()
        with tarfile.open(ns.work / "cache.tar.gz", "w:gz") as tar:
            tar.add(cold / "ws", "ws")
            tar.add(cold / "nv", "nv")
        record["cache_tarball"] = {"bytes": (ns.work / "cache.tar.gz").stat().st_size, "workspace_bytes":
                                   du(cold / "ws"), "compute_cache_bytes": du(cold / "nv"),
                                   "pack_s": round(time.perf_counter() - began, 1)}
    if ns.cache is not None:  # a tarball made by an earlier nocache phase, e.g. on another machine
        ns.work.mkdir(parents=True, exist_ok=True)
        shutil.copy(ns.cache, ns.work / "cache.tar.gz")
    if not (ns.work / "cache.tar.gz").exists():
        print("no cache.tar.gz: run the nocache phase first", file=sys.stderr)
        return 2
    if "restored" in ns.phases:
        began = time.perf_counter()
        root = restored(ns.work, "restored")
        unpack = round(time.perf_counter() - began, 1)
        record["restored"] = {**phase_check(ns.work, ns.out, "restored", root), "unpack_s": unpack}
    if "fuzz" in ns.phases:
        record["fuzz"] = phase_fuzz(ns.work, ns.out, ns.fuzz_minutes)
    if "firstcall" in ns.phases:
        record["firstcall"] = phase_firstcall(ns.work, ns.out)
    record_path.write_text(json.dumps(record, indent=1))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk in ("rc", "seconds", "judged_per_s_overall")}
                      if isinstance(v, dict) else v for k, v in record.items()}, indent=1))
    runs = [record[p] for p in ("nocache", "restored", "fuzz") if p in record]
    runs += list(record.get("firstcall", {}).values())
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
