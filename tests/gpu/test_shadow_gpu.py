"""Shadow mode on an SM90 GPU: the engine-style backend (tests/engine_backend.py) calling FlashInfer's fa2 and fa3
through ``BatchMLAPagedAttentionWrapper``, with nothing faked. The correct engine must raise nothing (no mismatch,
no argument error or warning: zero false alarms) and get the same bits as without shadowing; the planted
integration bug (the softmax scale of the absorbed width) must be caught at the engine's ``run`` call.

Marked ``gpu``; skips with the reason without a CUDA GPU of compute capability 9.0 and FlashInfer. With
MLA_VERIFY_GPU_RECORD=DIR each correct run writes DIR/shadow-<route>-<case>.json (the session's summary).
"""
from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from mla_verify.backends import get_backend
from mla_verify.core.platform import platform_info
from mla_verify.shadow import ShadowError, shadow

pytestmark = pytest.mark.gpu

ENGINE_FILE = Path(__file__).resolve().parents[1] / "engine_backend.py"
RECORD_DIR = os.environ.get("MLA_VERIFY_GPU_RECORD")
# TP head counts, page edges (63/64/65 tokens in 64-token blocks), a 1-token and a 4k-token request, MTP steps
CASES = {
    "h16-page64": dict(heads=16, block_size=64, prompts=(1, 63, 64, 65, 1000, 4097), q_lens=(1, 1, 2, 4)),
    "h128-page32": dict(heads=128, block_size=32, prompts=(5, 31, 300, 2048), q_lens=(1, 2)),
}


def _engine_module():
    """tests/engine_backend.py (tests/gpu is its own import root), registered under its own name."""
    if "engine_backend" not in sys.modules:
        spec = importlib.util.spec_from_file_location("engine_backend", ENGINE_FILE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["engine_backend"] = module
        spec.loader.exec_module(module)
    return sys.modules["engine_backend"]


def _sm90(route: str) -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    device = torch.device("cuda")
    reason = get_backend(route).unavailable_reason(device)
    if reason is not None:
        pytest.skip(f"{route}: {reason}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        pytest.skip(f"shadow mode's GPU run is specified on SM90 (H100/H200); this GPU is SM{major}{minor}")
    return device


def _run(route: str, case: dict, device: torch.device, **bugs) -> list[torch.Tensor]:
    eb = _engine_module()
    blocks = sum(-(-(n + sum(case["q_lens"])) // case["block_size"]) for n in case["prompts"]) + 8
    engine = eb.MiniEngine(route, heads=case["heads"], block_size=case["block_size"], num_blocks=blocks,
                           device=device, seed=len(case["prompts"]), bugs=eb.EngineBugs(**bugs))
    for n in case["prompts"]:
        engine.add_request(n)
    outs = [engine.step(q) for q in case["q_lens"]]
    torch.cuda.synchronize(device)
    return outs


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("route", ["fa2", "fa3"])
def test_the_correct_engine_gets_no_false_alarm_and_the_same_bits(route: str, case: str, tmp_path: Path) -> None:
    device = _sm90(route)
    plain = _run(route, CASES[case], device)
    with shadow("strict", stream=io.StringIO(), summary=False, fixtures_dir=tmp_path) as session:
        seen = _run(route, CASES[case], device)
    total = session.tally.total()
    if RECORD_DIR:
        path = Path(RECORD_DIR) / f"shadow-{route}-{case}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"platform": platform_info().to_json(), "case": CASES[case],
                                    "summary": session.summary_lines(), "tally": session.tally.to_json()},
                                   indent=1) + "\n")
    assert (total.mismatched, total.errors, total.warnings) == (0, 0, 0), session.summary_lines()
    assert total.compared == len(CASES[case]["q_lens"]), session.summary_lines()
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(plain, seen))


@pytest.mark.parametrize("route", ["fa2", "fa3"])
def test_the_planted_scale_bug_is_caught_at_the_engines_call(route: str, tmp_path: Path) -> None:
    device = _sm90(route)
    with pytest.raises(ShadowError) as caught, shadow("strict", stream=io.StringIO(), summary=False,
                                                      fixtures_dir=tmp_path):
        _run(route, CASES["h16-page64"], device, scale_absorbed=True)
    message = str(caught.value)
    assert "1/sqrt(576), the absorbed width" in message
    line = int(re.search(r"engine_backend\.py:(\d+) in", message).group(1))
    assert "self.wrapper.run(" in ENGINE_FILE.read_text().splitlines()[line - 1]
