"""Time to the first verdict and to the end of the main job on a fresh GPU runner, without and with a restored CI
cache, and isolated runs started from a process that initialised CUDA first (issues #33, #37).

Every phase runs in fresh processes with FlashInfer's workspace at one fixed path, <work>/ws
(FLASHINFER_WORKSPACE_BASE), and the CUDA driver's compute cache at <work>/nv (CUDA_CACHE_PATH), both emptied
first:

  nocache    `check --device cuda` (the README's main job) with both empty; then the workspace is packed as a CI
             cache keeps it: GNU tar in POSIX (pax) format, as actions/cache packs, its absolute path kept
  restored   the same command after the workspace is deleted and the tarball unpacked at the same path, the
             compute cache left empty (docs/pytest.md, "What a CI cache must keep")
  profile    the restored command again under cProfile (the parent process: where it waits for its workers,
             draws, judges); profile.prof and its 40 costliest calls by cumulative time, profile.txt
  cudainit   isolated runs from processes that initialised CUDA as Python started (a sitecustomize calling
             torch.cuda.init(), which the fork server runs too), on the restored cache: `check --backend fa3
             --device cuda`, and `pytest -n 2 --mla-kernel cli_kernels:needs_cuda --mla-device cuda`
  moved      the tarball unpacked at another path (what a cache restored elsewhere costs: everything rebuilt)
  reinstalled  unpacked at the same path, but every file of the FlashInfer installation made as new as a fresh
             `pip install` leaves it (pip writes each file at the time of the install; their times are put back
             afterwards): what a cache of the workspace alone costs when the environment is not cached too
  fuzz       `check --backend fa3 --profile fuzz --minutes M` on the restored cache: judged cases per second
             over the whole command (start-up and warm-up included) and within the cases

    source .gpu-bundle/activate.sh && python3 benchmarks/fresh_runner.py --out $OUT/fresh [--phases ...]

For each command: its exit code, seconds, and the seconds at which each of its summary lines appeared (a
backend's verdict line, `fa2: PASS -- ...`, among them: `first_verdict_s` is the first). Writes
$OUT/fresh/fresh_runner.json (merged over calls), one log per command and the check runs' reports; the
tarball stays in --work (default /tmp/mla-fresh). Exit code 0 when every command ran and passed.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pstats
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PHASES = ("nocache", "restored", "profile", "cudainit", "moved", "reinstalled", "fuzz")
CHECK = [sys.executable, "-m", "mla_verify.cli", "check", "--device", "cuda"]
TESTS = Path(__file__).resolve().parents[1] / "tests"
VERDICT = re.compile(r"^\S+: (PASS|FAIL|SKIP) -- ")  # a backend's summary line (cli/main.py, _summary_line)
KEPT = ("warm-up", "  warm-up", "reference self-check", "mla-verify:", "skipped ")
SITECUSTOMIZE = "import torch\ntorch.cuda.init()  # as an engine's plugin or a conftest may, as Python starts\n"


def caches(work: Path, root: Path | None = None) -> dict[str, str]:
    """The environment of a run whose workspace is ``root``/ws (default ``work``) and compute cache
    ``work``/nv, the compute cache emptied."""
    shutil.rmtree(work / "nv", ignore_errors=True)
    (work / "nv").mkdir(parents=True)
    ws = (root or work) / "ws"
    ws.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(ws), "CUDA_CACHE_PATH": str(work / "nv")}


def pack(work: Path) -> dict[str, Any]:
    """The workspace as a CI cache saves it: pax format (nanosecond modification times), absolute path."""
    began = time.perf_counter()
    tar = work / "cache.tar"
    subprocess.run(["tar", "--posix", "-cf", str(tar), "-C", "/", str((work / "ws").relative_to("/"))], check=True)
    return {"bytes": tar.stat().st_size, "pack_s": round(time.perf_counter() - began, 1)}


def restore(work: Path, root: Path) -> float:
    """The tarball unpacked under ``root`` (``/``: at the path it was saved from), into an emptied workspace."""
    began = time.perf_counter()
    target = root / (work / "ws").relative_to("/")
    shutil.rmtree(target, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-xf", str(work / "cache.tar"), "-C", str(root)], check=True)
    return round(time.perf_counter() - began, 1)


@contextlib.contextmanager
def reinstalled_flashinfer() -> Iterator[None]:
    """Every file of the FlashInfer installation this Python imports dated now, as a fresh install dates them;
    their times put back after."""
    import flashinfer

    files = [f for f in Path(flashinfer.__file__).parent.rglob("*") if f.is_file()]
    saved = {f: (f.stat().st_atime_ns, f.stat().st_mtime_ns) for f in files}
    for f in files:
        os.utime(f)
    try:
        yield
    finally:
        for f, times in saved.items():
            os.utime(f, ns=times)


def timed(command: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> dict[str, Any]:
    """Runs ``command``, its output to ``log`` (each line after the second it appeared at); its summary lines
    with those seconds."""
    began = time.perf_counter()
    lines: list[tuple[float, str]] = []
    with log.open("w") as out, subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((round(time.perf_counter() - began, 1), line.rstrip("\n")))
            out.write(f"{lines[-1][0]:7.1f} s  {line}")  # every line with the second it appeared at
    seconds = round(time.perf_counter() - began, 1)
    verdicts = [t for t, ln in lines if VERDICT.match(ln)]
    print(f"{log.stem}: rc {proc.returncode} in {seconds} s"
          + (f", first verdict at {verdicts[0]} s" if verdicts else ""), flush=True)
    return {"command": " ".join(command), "rc": proc.returncode, "seconds": seconds,
            "first_verdict_s": verdicts[0] if verdicts else None,
            "lines": [f"{t:7.1f} s  {ln}" for t, ln in lines if ln.startswith(KEPT) or VERDICT.match(ln)
                      or "judged in" in ln or "passed" in ln or "failed" in ln]}


def phase_check(work: Path, out: Path, name: str, env: dict[str, str], *argv: str) -> dict[str, Any]:
    report = out / f"{name}.json"
    result = timed([*CHECK, *argv, "--report", str(report), "--fixtures-dir", str(work / "reg")], env,
                   out / f"{name}.log")
    if report.exists():
        run = json.loads(report.read_text())["run"]
        result.update(warmup=run.get("warmup"), warmup_s=run.get("warmup_s"), throughput=run.get("throughput"))
    return result


def phase_profile(work: Path, out: Path) -> dict[str, Any]:
    unpack = restore(work, Path("/"))
    prof = out / "profile.prof"
    result = timed([sys.executable, "-m", "cProfile", "-o", str(prof), *CHECK[1:], "--fixtures-dir",
                    str(work / "reg")], caches(work), out / "profile.log")
    if prof.exists():
        text = io.StringIO()
        pstats.Stats(str(prof), stream=text).sort_stats("cumulative").print_stats(40)
        (out / "profile.txt").write_text(text.getvalue())
    return {"unpack_s": unpack, **result}


def phase_cudainit(work: Path, out: Path) -> dict[str, Any]:
    """Both isolated runs from processes whose sitecustomize initialised CUDA, on the restored cache."""
    site = work / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    restore(work, Path("/"))
    env = caches(work)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    found = {"check": phase_check(work, out, "cudainit_check_fa3", env, "--backend", "fa3")}
    empty = work / "pytest"
    shutil.rmtree(empty, ignore_errors=True)
    empty.mkdir()
    # the plugin by module, installed or not (docs/pytest.md); only the kernel's tests are collected
    found["pytest"] = timed([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:mla_verify",
                             "-p", "mla_verify.pytest_plugin", "-n", "2", "--mla-device", "cuda", "--mla-kernel",
                             "cli_kernels:needs_cuda", "--mla-fixtures-dir", str(work / "reg")], env,
                            out / "cudainit_pytest_n2.log", cwd=empty)
    # check says it once, on stderr; pytest keeps a passing test's output to itself
    found["check"]["workers_by_spawn"] = "start by spawn" in (out / "cudainit_check_fa3.log").read_text()
    return found


def phase_reinstalled(work: Path, out: Path) -> dict[str, Any]:
    unpack = restore(work, Path("/"))
    with reinstalled_flashinfer():
        return {"unpack_s": unpack, **phase_check(work, out, "reinstalled", caches(work))}


def phase_fuzz(work: Path, out: Path, minutes: float) -> dict[str, Any]:
    restore(work, Path("/"))
    result = phase_check(work, out, "fuzz_fa3", caches(work), "--backend", "fa3", "--profile", "fuzz",
                         "--minutes", str(minutes))
    if result.get("throughput"):
        fa3 = result["throughput"]["fa3"]
        result["judged_per_s_overall"] = round(fa3["judged"] / result["seconds"], 2)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/mla-out")) / "fresh")
    parser.add_argument("--work", type=Path, default=Path("/tmp/mla-fresh"), help="caches and reproducers")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=["nocache", "restored", "cudainit"])
    parser.add_argument("--fuzz-minutes", type=float, default=2.0)
    ns = parser.parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    work = ns.work.resolve()
    record_path = ns.out / "fresh_runner.json"
    record: dict[str, Any] = json.loads(record_path.read_text()) if record_path.exists() else {}
    record.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), cores=os.cpu_count(),
                  max_jobs=os.environ.get("MAX_JOBS"), workspace=str(work / "ws"))
    phases = {
        "nocache": lambda: phase_check(work, ns.out, "nocache", caches(work)),
        "restored": lambda: {"unpack_s": restore(work, Path("/")),
                             **phase_check(work, ns.out, "restored", caches(work))},
        "profile": lambda: phase_profile(work, ns.out),
        "cudainit": lambda: phase_cudainit(work, ns.out),
        "moved": lambda: {"unpack_s": restore(work, work / "moved"),
                          **phase_check(work, ns.out, "moved", caches(work, work / "moved" / work.relative_to("/")))},
        "reinstalled": lambda: phase_reinstalled(work, ns.out),
        "fuzz": lambda: phase_fuzz(work, ns.out, ns.fuzz_minutes)}
    for name in (p for p in PHASES if p in ns.phases):
        if name == "nocache":
            shutil.rmtree(work, ignore_errors=True)
        elif not (work / "cache.tar").exists():
            print("no cache.tar: run the nocache phase first", file=sys.stderr)
            return 2
        record[name] = phases[name]()
        if name == "nocache":
            record["cache_tarball"] = pack(work)
        record_path.write_text(json.dumps(record, indent=1))  # after each phase: a run cut short keeps them
    runs = {p: record[p] for p in ("nocache", "restored", "profile", "moved", "reinstalled", "fuzz") if p in record}
    runs.update((f"cudainit {k}", v) for k, v in record.get("cudainit", {}).items())
    for name, run in runs.items():
        print(f"{name}: rc {run['rc']}, {run['seconds']} s, first verdict at {run['first_verdict_s']} s")
    return 0 if all(r["rc"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
