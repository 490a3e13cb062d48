"""Shadow mode around an engine-style MLA decode backend (tests/engine_backend.py), on CPU.

Four routes: the engine's own Contract-1 PyTorch kernel; FlashInfer's real ``trtllm_batch_decode_with_kv_cache_mla``
(its Python layer runs for real, only the device queries and the native launcher are faked: test_trtllm_contract's
``fake_sm100``); FlashInfer's real ``BatchMLAPagedAttentionWrapper`` on fa2/fa3 (test_wrapper_contract's
``fake_hopper``). The correct engine raises nothing and gets bit-identical outputs with and without shadowing;
each planted integration bug is caught at the engine's own call, whose file:line the report names.
"""
from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
from engine_backend import TORCH_KERNELS, EngineBugs, MiniEngine
from test_trtllm_contract import fake_sm100  # noqa: F401 - fixture: FlashInfer's function on CPU
from test_wrapper_contract import fake_hopper  # noqa: F401 - fixture: FlashInfer's wrapper on CPU

from mla_verify.core.bits import same_bits
from mla_verify.shadow import ShadowError, shadow

# prompts of 31, 63 and 5 tokens in 32-token blocks: the first step fills two blocks to the brim, the q_len-2 step
# moves those requests onto a new block
PROMPTS = (31, 63, 5)
Q_LENS = (1, 2)
FAKES = {"flashinfer": "fake_sm100", "fa2": "fake_hopper", "fa3": "fake_hopper"}
# the line of the engine's call into each route (what a report must name)
CALLS = {"torch": "return kernel(", "flashinfer": "return trtllm_batch_decode_with_kv_cache_mla(",
         "fa2": "self.wrapper.run(", "fa3": "self.wrapper.run("}
ENGINE_FILE = Path(__file__).with_name("engine_backend.py")


@pytest.fixture
def on_cpu(request: pytest.FixtureRequest):
    """Makes a route runnable here: the fake FlashInfer device layer it needs, if any."""
    def prepare(route: str) -> None:
        if route in FAKES:
            request.getfixturevalue(FAKES[route])
    return prepare


def run_engine(route: str, bugs: EngineBugs = EngineBugs()) -> list[torch.Tensor]:
    engine = MiniEngine(route, bugs=bugs)
    for n in PROMPTS:
        engine.add_request(n)
    return [engine.step(q) for q in Q_LENS]


def shadowed(mode: str = "strict", **kwargs):
    return shadow(mode, kernels=TORCH_KERNELS, stream=io.StringIO(), summary=False, **kwargs)


def named_line(message: str) -> str:
    """The source line of the engine_backend.py call site a report names."""
    site = re.search(r"at (\S*engine_backend\.py):(\d+) in", message)
    assert site, message
    return ENGINE_FILE.read_text().splitlines()[int(site.group(2)) - 1]


@pytest.mark.parametrize("route", ["torch", "flashinfer", "fa2", "fa3"])
def test_the_correct_engine_raises_nothing_and_gets_the_same_bits(on_cpu, route: str, tmp_path: Path) -> None:
    on_cpu(route)
    plain = run_engine(route)
    with shadowed(fixtures_dir=tmp_path) as session:
        seen = run_engine(route)
    assert all(same_bits(a, b) for a, b in zip(plain, seen))
    total = session.tally.total()
    assert total.compared == len(Q_LENS)  # every call was checked against the reference...
    assert (total.mismatched, total.errors, total.warnings) == (0, 0, 0), session.summary_lines()  # ...and passed
    checked = [where for (entry, where) in session.tally.sites if not entry.endswith(".plan")]
    assert len(checked) == 1 and CALLS[route] in named_line(f"at {checked[0]} in")


BUGS = [
    ("torch", EngineBugs(cache_3d=True), "takes only 4-D [pages, 1, page_size, D]"),
    ("torch", EngineBugs(inplace_kernel=True), "wrote `out` in place but returned NoneType"),
    ("torch", EngineBugs(scale_absorbed=True), "1/sqrt(576), the absorbed width"),
    ("flashinfer", EngineBugs(scale_absorbed=True), "1/sqrt(576), the absorbed width"),
    ("fa2", EngineBugs(scale_absorbed=True), "1/sqrt(576), the absorbed width"),
    ("torch", EngineBugs(table_page_size=64), "block_tables: rows of 1 entries, but seq_lens[1] = 64 needs 2 pages"),
    ("flashinfer", EngineBugs(table_page_size=64), "block_tables: rows of 1 entries, but seq_lens[1] = 64 needs 2"),
    ("fa3", EngineBugs(scale_absorbed=True), "1/sqrt(576), the absorbed width"),
]


@pytest.mark.parametrize("route,bugs,says", BUGS, ids=[f"{r}-{s[:24]}" for r, _, s in BUGS])
def test_each_integration_bug_is_caught_at_the_engines_call(on_cpu, route: str, bugs: EngineBugs, says: str,
                                                            tmp_path: Path) -> None:
    on_cpu(route)
    with pytest.raises(ShadowError) as caught, shadowed(fixtures_dir=tmp_path):
        run_engine(route, bugs)
    message = str(caught.value)
    assert says in message
    assert CALLS[route] in named_line(message)


def test_record_mode_records_and_changes_nothing(tmp_path: Path) -> None:
    bugs = EngineBugs(scale_absorbed=True)
    plain = run_engine("torch", bugs)
    with shadowed("record", fixtures_dir=tmp_path) as session:
        seen = run_engine("torch", bugs)
    assert all(same_bits(a, b) for a, b in zip(plain, seen))
    (entry, where), tally = next(iter(session.tally.sites.items()))
    assert CALLS["torch"] in named_line(f"at {where} in")
    assert (tally.calls, tally.errors, tally.mismatched) == (len(Q_LENS), len(Q_LENS), 0)
    assert session.stream.getvalue().count("ARGUMENT ERROR") == 1  # reported once for its call site


def test_a_kernel_that_raises_keeps_its_exception_with_the_findings_attached(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not enough values to unpack") as caught, \
            shadowed("record", fixtures_dir=tmp_path) as session:
        run_engine("torch", EngineBugs(cache_3d=True))
    notes = getattr(caught.value, "__notes__", [""])
    assert "takes only 4-D" in notes[0] and CALLS["torch"] in named_line(notes[0])
    assert session.tally.total().not_checked["the kernel raised"] == 1
