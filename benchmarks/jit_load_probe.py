"""Where a built FlashInfer module's "first load" goes (issue #37): each step timed alone, in fresh processes.

Each phase is a fresh process with its own FlashInfer workspace, and the same two fa2/fa3 modules:

  prebuild   the parallel build FlashInfer offers (``build_jit_specs``: one ninja over every module's
             ``subninja``, run in the JIT directory), then per module: ``ninja -d explain -n`` in the module's own
             directory (what FlashInfer's getter runs at a first call: does ninja think it is up to date, and
             why not), the getter's ``build()`` timed, ``build()`` again, ``tvm_ffi.load_module`` alone, and the
             module's first and second kernel call through the suite's backend
  permodule  every module's own ``build()`` (ninja in its own directory) started at once in threads; then the
             same steps as above
  again      the permodule workspace, a new process: the steps alone
  restored   the permodule workspace packed as a CI cache keeps it, unpacked at its own path, and elsewhere

Also timed: ``import torch``, CUDA's start, ``import flashinfer`` and ``CUDA_MODULE_LOADING``.

    source .gpu-bundle/activate.sh && python3 benchmarks/jit_load_probe.py --out $OUT/jit_load.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

began = time.perf_counter()
import torch  # noqa: E402 - timed

IMPORT_TORCH_S = time.perf_counter() - began
MODULES = (("fa3", "bf16"), ("fa2", "bf16"))


def seconds(fn: Any) -> tuple[float, Any]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    value = fn()
    torch.cuda.synchronize()
    return round(time.perf_counter() - t, 3), value


def explain(spec: Any) -> list[str]:
    """ninja's own reason for rebuilding, dry run (-n), in the directory FlashInfer's getter runs it in."""
    done = subprocess.run(["ninja", "-d", "explain", "-n", "-C", str(spec.build_dir), "-f", str(spec.ninja_path)],
                          capture_output=True, text=True)
    lines = (done.stdout + done.stderr).splitlines()
    return [ln for ln in lines if "explain" in ln or "no work" in ln][:6] + [f"({len(lines)} lines)"]


def first_calls(name: str, dtype: str) -> dict[str, float]:
    from mla_verify.backends import get_backend
    from mla_verify.draw.strategies import budget_for, corner_cases
    from mla_verify.problems.generate import build_problem

    backend = get_backend(name)
    first = next(c for c in corner_cases(backend.envelope, budget_for(torch.device("cuda")))
                 if c.spec.dtype == dtype and c.spec.kv_lora_rank == 512 and c.spec.qk_rope_head_dim == 64)
    problem = build_problem(first.spec, torch.device("cuda"))
    out = {}
    for attempt in ("first", "second"):
        s, call = seconds(lambda: backend.prepare(problem, first.layout))
        out[f"{attempt} prepare"] = s
        out[f"{attempt} call"], _ = seconds(call.invoke)
    return out


def steps(modules: list[Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for (name, dtype), module in zip(MODULES, modules):
        spec = module.spec
        one: dict[str, Any] = {"ninja explain (dry run) in the module's directory": explain(spec)}
        one["getter's build() #1 s"], _ = seconds(spec.build)
        one["getter's build() #2 s"], _ = seconds(spec.build)
        one["tvm_ffi.load_module s"], _ = seconds(spec.load)
        one["FlashInfer getter (cached after) s"], _ = seconds(module.load)
        one.update(first_calls(name, dtype))
        one["library MiB"] = round(spec.get_library_path().stat().st_size / 2**20, 1)
        found[module.name] = one
        print(module.name, json.dumps(one), flush=True)
    return found


def phase(kind: str) -> dict[str, Any]:
    """One phase in this process, whose FLASHINFER_WORKSPACE_BASE the parent set."""
    record: dict[str, Any] = {"import torch s": round(IMPORT_TORCH_S, 3),
                              "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING")}
    record["cuda start s"], _ = seconds(lambda: torch.zeros(1, device="cuda"))
    record["import flashinfer s"], fi = seconds(lambda: importlib.import_module("flashinfer"))
    record["versions"] = {"torch": torch.__version__, "flashinfer": fi.__version__,
                          "gpu": torch.cuda.get_device_name()}
    from flashinfer.jit.core import build_jit_specs

    from mla_verify.backends.flashinfer_jit import fa_module

    modules = [fa_module(fi_name, torch.bfloat16, 512, 64) for fi_name, _ in MODULES]
    if kind == "prebuild":
        record["build_jit_specs s"], _ = seconds(lambda: build_jit_specs([m.spec for m in modules]))
    elif kind == "permodule":
        with ThreadPoolExecutor(len(modules)) as pool:
            record["each build() at once s"], _ = seconds(lambda: list(pool.map(lambda m: m.spec.build(), modules)))
    record["modules"] = steps(modules)
    return record


def child(kind: str, ws: Path, out: Path) -> dict[str, Any]:
    env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(ws)}
    t = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--phase", kind, "--out", str(out)], env=env)
    found = json.loads(out.read_text()) if out.exists() else {}
    return {"rc": done.returncode, "wall s": round(time.perf_counter() - t, 1), **found}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/jit-probe"))
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.phase:
        ns.out.write_text(json.dumps(phase(ns.phase), indent=1))
        return 0
    shutil.rmtree(ns.work, ignore_errors=True)
    ns.work.mkdir(parents=True)
    record: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    record["prebuild"] = child("prebuild", ns.work / "a", ns.work / "prebuild.json")
    record["permodule"] = child("permodule", ns.work / "b", ns.work / "permodule.json")
    record["again, same workspace"] = child("none", ns.work / "b", ns.work / "again.json")
    t = time.perf_counter()
    with tarfile.open(ns.work / "cache.tar.gz", "w:gz") as tar:
        tar.add(ns.work / "b", "ws")
    (ns.work / "b").rename(ns.work / "b.orig")
    with tarfile.open(ns.work / "cache.tar.gz") as tar:  # our own tarball
        tar.extractall(ns.work / "b-restored", filter="tar")
    (ns.work / "b-restored" / "ws").rename(ns.work / "b")
    record["pack+unpack s"] = round(time.perf_counter() - t, 1)
    record["restored at its own path"] = child("none", ns.work / "b", ns.work / "restored.json")
    with tarfile.open(ns.work / "cache.tar.gz") as tar:
        tar.extractall(ns.work / "elsewhere", filter="tar")
    record["restored elsewhere"] = child("none", ns.work / "elsewhere" / "ws", ns.work / "elsewhere.json")
    ns.out.write_text(json.dumps(record, indent=1))
    return 0 if all(v.get("rc") == 0 for v in record.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
