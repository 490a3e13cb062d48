"""The flashmla adapters on CPU, through stand-ins with FlashMLA's calling conventions (upstream's and the
sgl-flash-mla wheel's, mla_verify.kernels.flashmla_cpu).

1. A recorder in place of ``flash_mla``: the exact arguments -- the cache as a ``[blocks, 64, 1, 576]`` view of
   the pool (page-strided too), the table, ``cache_seqlens``, ``head_dim_v``, the scale always passed (FlashMLA's
   default is 1/sqrt(576)), ``causal=True``, the metadata handed back as received, and ``use_legacy=True``
   exactly when the interface has it.
2. The stand-ins, which refuse what FlashMLA refuses, computing with the correct kernel: the harness passes them
   through the backend (LSE transposed from ``[B, H, q_len]``, natural log; bmm2 as the output scale).
3. Without the ``flash_mla`` package (this machine): listed, checked and doctored as "install FlashMLA: ...".
The fp8 backend: tests/test_flashmla_fp8.py. The 23 mutants: tests/test_flashmla_kill_matrix.py.
"""
from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch

from mla_verify.backends import flashmla_api, get_backend
from mla_verify.backends.flashmla import FlashMLABackend
from mla_verify.backends.flashmla_api import FlashMLAApi
from mla_verify.cli.main import main
from mla_verify.kernels.flashmla_cpu import CPU_ENVELOPE, FlashMLAStandIn, SchedMeta, WheelStandIn, stand_in_backend
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec, padded_width
from mla_verify.run.harness import run_case

SPEC = ProblemSpec(seq_lens=(5, 130, 64), q_len=1, num_heads=16, page_size=64, extra_pages=2, table_pad=1,
                   softmax_scale=0.1352, bmm2_extra=1.25, seed=9)
LAYOUTS = [LayoutSpec(), LayoutSpec(page_stride_pad=3, table_width="pad128"), LayoutSpec(return_lse=False)]
CASES = [  # (spec, layout): TP head counts and tile edges, q_len > 1 (causal), one token, a long sequence
    (SPEC, LayoutSpec(pass_out=False)),
    (replace(SPEC, q_len=4, num_heads=128, seq_lens=(4, 67, 200)), LayoutSpec(page_stride_pad=2, pass_out=False)),
    (replace(SPEC, num_heads=3, seq_lens=(1, 1000), pad_fill="garbage"),
     LayoutSpec(table_width="pad128", pass_out=False)),
    (replace(SPEC, q_len=2, num_heads=63, seq_lens=(2, 65)), LayoutSpec(return_lse=False, pass_out=False)),
    (replace(SPEC, q_len=3, qk_rope_head_dim=0, seq_lens=(3, 64, 129)), LayoutSpec(pass_out=False)),  # no rope
]
INTERFACES = ("upstream", "wheel")
CPU = torch.device("cpu")


class Recorder:
    """Stands in for both flash_mla functions: records each call, answers in FlashMLA's shapes."""

    def __init__(self) -> None:
        self.metadata_args: tuple = ()
        self.args: tuple = ()
        self.kwargs: dict[str, Any] = {}
        self.metadata = SchedMeta()

    def get_mla_metadata(self, *args: Any) -> tuple[SchedMeta, None]:
        self.metadata_args = args
        return self.metadata, None

    def flash_mla_with_kvcache(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.args, self.kwargs = args, kwargs
        q = args[0]
        B, Q, H, _ = q.shape
        return torch.zeros(B, Q, H, args[4], dtype=q.dtype), torch.zeros(B, H, Q)


class WheelRecorder(Recorder):
    """The recorder with the wheel's signature: ``use_legacy`` among its parameters."""

    def flash_mla_with_kvcache(self, *args: Any, use_legacy: bool = False,  # type: ignore[override]
                               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return super().flash_mla_with_kvcache(*args, use_legacy=use_legacy, **kwargs)


@pytest.mark.parametrize("interface", INTERFACES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[str(i) for i in range(len(LAYOUTS))])
@pytest.mark.parametrize("spec", [SPEC, replace(SPEC, q_len=4, num_heads=128)], ids=["q1", "q4"])
def test_adapter_passes_exactly_flashmlas_arguments(spec: ProblemSpec, layout: LayoutSpec, interface: str) -> None:
    rec = WheelRecorder() if interface == "wheel" else Recorder()
    backend = FlashMLABackend(api=FlashMLAApi(rec.get_mla_metadata, rec.flash_mla_with_kvcache),
                              envelope=CPU_ENVELOPE)
    problem = build_problem(spec)
    prepared = backend.prepare(problem, layout)
    out, lse = prepared.to_canonical(prepared.invoke())
    P, page, D, B, Q, H = problem.num_pages, spec.page_size, 576, spec.batch, spec.q_len, spec.num_heads
    # the metadata call gets what FlashMLA of 2025 needs (the 2026 interface ignores its arguments)
    seqlens, tokens_per_head_k, heads_k = rec.metadata_args
    assert seqlens is problem.seq_lens and (tokens_per_head_k, heads_k) == (Q * H, 1)
    q, k_cache, table, lens, head_dim_v, metadata, num_splits = rec.args
    assert q is problem.query and lens is problem.seq_lens and head_dim_v == 512
    assert metadata is rec.metadata and num_splits is None
    assert k_cache.shape == (P, page, 1, D) and k_cache.dtype == torch.bfloat16
    assert k_cache.data_ptr() == prepared.inputs["kv_pool"].data_ptr()  # a view of the pool, no copy
    assert k_cache.stride(0) == (page + layout.page_stride_pad) * D and k_cache.stride(1) == D
    assert k_cache.stride(-1) == 1
    assert torch.equal(k_cache[:, :, 0].float().nan_to_num(7.0), problem.kv_cache.float().nan_to_num(7.0))
    native = problem.block_table.shape[1]
    assert table.dtype == torch.int32 and torch.equal(table[:, :native], problem.block_table)
    assert table.shape[1] == (padded_width(native, page) if layout.table_width == "pad128" else native)
    legacy = {"use_legacy": True} if interface == "wheel" else {}  # the wheel's SM90 kernels need it, every call
    assert rec.kwargs == {"softmax_scale": problem.bmm1_scale, "causal": True, **legacy}
    assert isinstance(rec.kwargs["softmax_scale"], float)
    # FlashMLA allocates out; LSE [B, H, q_len] comes back as [B, q_len, H]; bmm2 is the harness's to apply
    assert prepared.out is None and out.shape == (B, Q, H, 512)
    assert lse is None if not layout.return_lse else lse.shape == (B, Q, H)
    assert prepared.output_scale == problem.bmm2_scale != 1.0


@pytest.mark.parametrize("interface", INTERFACES)
@pytest.mark.parametrize("spec,layout", CASES, ids=[str(i) for i in range(len(CASES))])
def test_the_harness_passes_the_correct_stand_in_through_the_backend(spec: ProblemSpec, layout: LayoutSpec,
                                                                    interface: str) -> None:
    result = run_case(stand_in_backend(interface=interface), spec, layout, "cpu", transform="pages")
    if interface == "upstream" and spec.qk_rope_head_dim == 0:  # its SM90 kernel asserts 576 (exiting)
        assert result.verdict == "skip" and "head dim 576 only" in result.reason
        return
    assert result.verdict == "pass", result.failures


def test_the_interface_is_read_from_the_signature() -> None:
    assert stand_in_backend(interface="wheel").api.use_legacy
    assert not stand_in_backend(interface="upstream").api.use_legacy
    assert not FlashMLAApi(print, len).use_legacy  # builtins without a signature: upstream's 2025 bindings


def test_the_envelope_is_flashmlas() -> None:
    env = get_backend("flashmla").envelope
    # the wheel's dense_decode: "Only head_size_k == 576 or 512 is supported", "page_block_size must be 64"
    assert env.archs == ((9, 0),) and env.page_sizes == (64,) and env.dims == ((512, 64), (512, 0))
    assert env.lse_base == math.e and env.pass_out == (False,) and env.dtypes == ("bf16",)
    assert all(env.allows_heads(h) for h in (1, 3, 9, 63, 64, 126, 128))  # the head counts FlashMLA's tests use


# --- the stand-in refuses what FlashMLA refuses, so its accepting the backend's arguments means something -----

def _valid_call() -> dict[str, Any]:
    p = build_problem(SPEC)
    return dict(q=p.query, k_cache=p.kv_cache.unsqueeze(2), block_table=p.block_table, cache_seqlens=p.seq_lens,
                head_dim_v=512, tile_scheduler_metadata=SchedMeta(), softmax_scale=0.1, causal=True)


@pytest.mark.parametrize("change,words", [
    (lambda a: dict(k_cache=a["k_cache"][:, :32]), "page_block_size must be 64"),
    (lambda a: dict(k_cache=a["k_cache"].to(torch.float8_e4m3fn)), "same dtype"),
    (lambda a: dict(block_table=a["block_table"].long()), "block_table must have dtype torch.int32"),
    (lambda a: dict(cache_seqlens=a["cache_seqlens"].long()), "seqlens_k must have dtype int32"),
    (lambda a: dict(head_dim_v=256), "head_size_v"),
    (lambda a: dict(q=a["q"][..., :448], k_cache=a["k_cache"][..., :448]), "576 or 512"),
    (lambda a: dict(k_cache=a["k_cache"][..., :512]), "kcache must have shape"),
    (lambda a: dict(k_cache=a["k_cache"].squeeze(2)), "4-D"),
    (lambda a: dict(q=torch.cat([a["q"], a["q"]], dim=-1)[..., ::2]), "q must have contiguous last dimension"),
])
@pytest.mark.parametrize("interface", INTERFACES)
def test_the_stand_in_refuses_what_flashmla_refuses(change, words: str, interface: str) -> None:
    stand_in, extra = (WheelStandIn(), {"use_legacy": True}) if interface == "wheel" else (FlashMLAStandIn(), {})
    stand_in.flash_mla_with_kvcache(**_valid_call(), **extra)  # the valid call runs
    args = {**_valid_call(), **change(_valid_call()), **extra}
    with pytest.raises(RuntimeError, match=words):
        stand_in.flash_mla_with_kvcache(**args)


def test_the_stand_in_keeps_flashmlas_python_rules() -> None:
    stand_in = FlashMLAStandIn()
    args = _valid_call()
    stand_in.flash_mla_with_kvcache(**args)
    other = build_problem(replace(SPEC, seq_lens=(5, 9)))
    with pytest.raises(AssertionError, match="inconsistent with sched_meta"):  # metadata reused for another batch
        stand_in.flash_mla_with_kvcache(**{**args, "q": other.query, "block_table": other.block_table,
                                           "cache_seqlens": other.seq_lens})
    with pytest.raises(AssertionError, match="num_splits must be None"):
        stand_in.flash_mla_with_kvcache(**{**_valid_call(), "num_splits": torch.zeros(4, dtype=torch.int32)})
    with pytest.raises(AssertionError, match="FlashMLASchedMeta"):
        stand_in.flash_mla_with_kvcache(**{**_valid_call(), "tile_scheduler_metadata": None})
    with pytest.raises(AssertionError, match="sparse only"):  # upstream refuses what its dense path cannot take
        stand_in.flash_mla_with_kvcache(**_valid_call(), attn_sink=torch.zeros(16))


def test_the_wheel_stand_in_keeps_the_wheels_python_rules() -> None:
    """The wheel's dense branch: use_legacy required, its schedule filled by the first call and then reused
    without any Python check (a call with other lengths goes through; one of another batch size is refused by the
    kernel's num_splits check, as on the H200), the sparse-only arguments ignored."""
    stand_in = WheelStandIn()
    with pytest.raises(AssertionError, match="pass use_legacy=True"):
        stand_in.flash_mla_with_kvcache(**_valid_call())
    args = {**_valid_call(), "use_legacy": True}
    meta = args["tile_scheduler_metadata"]
    stand_in.flash_mla_with_kvcache(**args)
    made = meta.tile_scheduler_metadata
    assert made is not None and meta.config is None
    for lens in ((5, 9, 70), (5, 9)):
        other = build_problem(replace(SPEC, seq_lens=lens))
        call = {**args, "q": other.query, "block_table": other.block_table, "cache_seqlens": other.seq_lens}
        if len(lens) == SPEC.batch:
            stand_in.flash_mla_with_kvcache(**call, attn_sink=torch.zeros(16))
        else:
            with pytest.raises(RuntimeError, match=r"num_splits must have shape \(batch_size\+1\)"):
                stand_in.flash_mla_with_kvcache(**call)
    assert meta.tile_scheduler_metadata is made  # the stale schedule, kept
    with pytest.raises(AssertionError, match="dense fp8 path only"):
        stand_in.flash_mla_with_kvcache(**args, descale_q=torch.ones(1))


def test_the_wheel_stand_ins_lse_is_a_non_contiguous_view_as_the_wheels() -> None:
    """The wheel's LSE [B, H, q_len] came back non-contiguous on the H200 (docs/backends.md): the stand-in's does
    too, so the backend and shadow mode are proven on that form."""
    p = build_problem(replace(SPEC, q_len=2))
    _, lse = WheelStandIn().flash_mla_with_kvcache(p.query, p.kv_cache.unsqueeze(2), p.block_table, p.seq_lens, 512,
                                                   SchedMeta(), softmax_scale=0.1, causal=True, use_legacy=True)
    assert tuple(lse.shape) == (SPEC.batch, SPEC.num_heads, 2) and not lse.is_contiguous()


def test_the_stand_ins_defaults_are_flashmlas() -> None:
    """softmax_scale=None is 1/sqrt(576) and causal=False attends to every token, as in FlashMLA: the backend
    passing neither would be caught (its scale and causality then differ from the reference)."""
    backend = stand_in_backend()
    stand_in = backend.api.flash_mla_with_kvcache

    def with_flashmla_defaults(*args: Any, softmax_scale: float, causal: bool) -> Any:
        return stand_in(*args)
    dropped = FlashMLABackend("drops-scale-and-causal", FlashMLAApi(backend.api.get_mla_metadata,
                                                                     with_flashmla_defaults), CPU_ENVELOPE)
    result = run_case(dropped, replace(SPEC, q_len=4), LayoutSpec(pass_out=False), "cpu", diagnose=False)
    assert result.verdict == "fail", result.failures


# --- without the flash_mla package ------------------------------------------------------------------------------

needs_no_flash_mla = pytest.mark.skipif(importlib.util.find_spec("flash_mla") is not None,
                                        reason="FlashMLA is installed here")
INSTALL = "install FlashMLA: no flash_mla package here (pip install --no-deps sgl-flash-mla==1.0.0, or build " \
          "it from https://github.com/deepseek-ai/FlashMLA)"


@needs_no_flash_mla
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_without_flash_mla_it_says_install_flashmla(device: str) -> None:
    assert get_backend("flashmla").unavailable_reason(torch.device(device)) == INSTALL
    result = run_case(get_backend("flashmla"), SPEC, LayoutSpec(pass_out=False), device)
    assert (result.verdict, result.reason) == ("skip", f"flashmla: {INSTALL}")


@needs_no_flash_mla
def test_doctor_and_check_name_it_not_installed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^  flashmla +cannot run: {re.escape(INSTALL)}$", out, re.MULTILINE), out
    assert "flashmla none (pip install --no-deps sgl-flash-mla==1.0.0, or build it from" in out
    assert main(["check", "--backend", "flashmla", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert INSTALL in err and err.count("\n") == 1


@needs_no_flash_mla
def test_listing_backends_never_imports_flash_mla() -> None:
    code = ("import sys, torch; from mla_verify.backends import all_backends; "
            "[b.unavailable_reason(torch.device(d)) for b in all_backends().values() for d in ('cpu', 'cuda')]; "
            "print('flash_mla' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_installed_but_broken_or_off_sm90_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flashmla_api, "install_hint", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    backend = FlashMLABackend()
    assert backend.unavailable_reason(torch.device("cuda")) == "needs SM90; this GPU (NVIDIA B200) is SM100"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flashmla_api, "flash_mla_import_error", lambda: "ImportError: libcudart.so.13: cannot open")
    assert backend.unavailable_reason(torch.device("cuda")) == \
        "FlashMLA is installed but cannot be imported (ImportError: libcudart.so.13: cannot open)"
    monkeypatch.setattr(flashmla_api, "flash_mla_import_error", lambda: None)
    assert backend.unavailable_reason(torch.device("cuda")) is None


@pytest.mark.parametrize("distributions,version,says", [
    (["sgl-flash-mla"], "1.0.0", "wheel sgl-flash-mla 1.0.0 (SM90 through use_legacy=True)"),
    (["sgl_flash_mla"], "1.0.0", "wheel sgl_flash_mla 1.0.0 (SM90 through use_legacy=True)"),
    (["flash_mla"], "1.0.0+9241ae3", "upstream source build flash_mla 1.0.0+9241ae3"),
    ([], None, "upstream source build flash_mla (no version)"),  # a source tree on the path
])
def test_doctor_names_the_flashmla_build(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                         request: pytest.FixtureRequest, distributions: list[str], version: str | None,
                                         says: str) -> None:
    """Read from package metadata, so doctor tells the wheel from a source build without importing either."""
    flashmla_api.installed_build.cache_clear()  # read once per process: the fakes below are read afresh, and
    request.addfinalizer(flashmla_api.installed_build.cache_clear)  # forgotten after
    monkeypatch.setattr(flashmla_api.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(flashmla_api.importlib.metadata, "packages_distributions",
                        lambda: {"flash_mla": distributions})
    monkeypatch.setattr(flashmla_api.importlib.metadata, "version", lambda name: version)
    assert flashmla_api.installed_build().describe() == says
    monkeypatch.setattr(flashmla_api, "flash_mla_import_error", lambda: "ImportError: no GPU here")
    assert main(["doctor"]) == 0
    assert f"\nflashmla {says}\n" in capsys.readouterr().out
