"""The warm-up's FlashInfer builds (backends/flashinfer_jit.py) with a real FlashInfer JitSpec: a one-line C++
module built by FlashInfer's own ninja rules, with the C++ compiler wrapped so that every compile and link is
written down. A module the warm-up built must be up to date for the ninja FlashInfer's getter runs at the
module's first use, in whatever process loads it; one its build_jit_specs built is not (the getter's ninja
runs in the module's directory, whose build log that build did not write, and compiles it all again:
docs/pytest.md, "Warm-up"). Each test runs in a fresh process, since FlashInfer reads its workspace once.

Needs a C++ compiler and ninja, no GPU and no CUDA toolkit: CUDA_HOME is a stand-in with the two libraries
FlashInfer links against (empty) and an nvcc that only tells its version.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("flashinfer")
CXX = shutil.which("c++")
NINJA = shutil.which("ninja", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
pytestmark = pytest.mark.skipif(CXX is None or NINJA is None, reason="needs a C++ compiler (c++) and ninja")

# what each test's process runs first: the module's JitSpec, as FlashInfer's generators make them, and a
# backend declaring it with the warm-up's builder
PROLOGUE = """
import io, subprocess, sys, time
from flashinfer.jit.core import gen_jit_spec
import torch
from mla_verify.backends.base import WarmupModule
from mla_verify.backends.flashinfer_jit import build_all

spec = gen_jit_spec("mla_verify_probe", [sys.argv[1]])

class Declaring:
    name = "probe"
    def warmup(self, device):
        return [WarmupModule(spec.name, spec, build_all, lambda: None)]

def compiles():
    with open(sys.argv[2]) as log:
        return len(log.read().splitlines())

# what FlashInfer's getter runs in the process that loads the module first (JitSpec.build_and_load)
GETTER = ("import sys; from flashinfer.jit.core import gen_jit_spec; "
          "gen_jit_spec('mla_verify_probe', [sys.argv[1]]).build_and_load()")
"""


@pytest.fixture
def probe(tmp_path: Path) -> tuple[dict[str, str], list[str], Path]:
    """(environment, [module source, compile log], compile log) of a process that builds the probe module."""
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "lib64" / "stubs").mkdir(parents=True)
    (cuda / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.48'\n")
    (cuda / "bin" / "nvcc").chmod(0o755)
    for lib in ("lib64/libcudart.so", "lib64/stubs/libcuda.so"):
        subprocess.run([CXX, "-shared", "-x", "c++", os.devnull, "-o", str(cuda / lib)], check=True)
    log = tmp_path / "compiles.log"
    log.touch()
    cxx = tmp_path / "cxx"  # each compile or link: a line in the log, and half a second
    cxx.write_text(f'#!/bin/sh\necho "$@" >> {log}\nsleep 0.5\nexec {CXX} "$@"\n')
    cxx.chmod(0o755)
    source = tmp_path / "probe.cpp"
    source.write_text('extern "C" int mla_verify_probe() { return 37; }\n')
    env = {**os.environ, "CUDA_HOME": str(cuda), "CXX": str(cxx), "FLASHINFER_CUDA_ARCH_LIST": "9.0a",
           "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "ws"),
           "PATH": os.pathsep.join([str(Path(NINJA).parent), os.environ.get("PATH", "")])}  # type: ignore[arg-type]
    return env, [str(source), str(log)], log


def run(script: str, probe: tuple[dict[str, str], list[str], Path]) -> str:
    env, args, _ = probe
    done = subprocess.run([sys.executable, "-c", PROLOGUE + textwrap.dedent(script), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_module_the_warm_up_built_is_up_to_date_for_flashinfer_s_getter(probe) -> None:
    out = run("""
        from mla_verify.run.warmup import warm_up

        result = warm_up([Declaring()], torch.device("cpu"), io.StringIO(), load=False)
        assert not result.failures, result.failures
        print("built:", compiles())
        explain = subprocess.run(["ninja", "-n", "-d", "explain", "-C", str(spec.build_dir), "-f",
                                  str(spec.ninja_path)], capture_output=True, text=True)
        print("ninja in the module's directory:", (explain.stdout + explain.stderr).strip().splitlines())
        # a fresh process, as a case worker loading it: its getter's ninja must find nothing to do
        subprocess.run([sys.executable, "-c", GETTER, sys.argv[1]], check=True)
        print("after the getter:", compiles())
        """, probe)
    assert "built: 2" in out, out  # one compile, one link
    assert "ninja: no work to do." in out, out
    assert "after the getter: 2" in out, out


def test_a_process_loading_a_module_meanwhile_waits_for_its_build_and_compiles_nothing(probe) -> None:
    """The getter, in another process started while the warm-up builds, waits on FlashInfer's lock, which
    the builder took before it returned, instead of compiling the module itself; it then finds it built."""
    out = run("""
        from filelock import FileLock, Timeout
        from mla_verify.run.warmup import start_warm_up

        warming = start_warm_up([Declaring()], torch.device("cpu"), io.StringIO(), load=False)
        try:  # the compile takes half a second: the build is still running
            FileLock(spec.lock_path, thread_local=False).acquire(timeout=0)
            print("unlocked while building")
        except Timeout:
            print("locked while building")
        getter = subprocess.Popen([sys.executable, "-c", GETTER, sys.argv[1]])
        result = warming.wait()
        assert not result.failures, result.failures
        assert getter.wait() == 0
        print("compiles:", compiles())
        """, probe)
    assert "locked while building" in out, out
    assert "compiles: 2" in out, out
