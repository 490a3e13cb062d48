"""The backend registry: built-ins, third-party entry points, one-line errors, and CPU-only behaviour."""
from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest
import torch

import mla_verify.backends as registry
from mla_verify.backends import ENTRY_POINT_GROUP, all_backends, builtin_backends, get_backend
from mla_verify.backends.cpu_peer import cpu_peer_backend
from mla_verify.core.errors import UsageError
from mla_verify.problems.generate import ProblemSpec
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.run.harness import run_case

GPU_BACKENDS = ("trtllm-gen", "cute-dsl", "xqa", "fa2", "fa3", "fa-auto", "cutlass", "cutile", "flashinfer-swa")
SPEC = ProblemSpec(seq_lens=(9, 40), num_heads=8, page_size=32, seed=1)


def test_builtins_are_every_flashinfer_path_and_the_cpu_peer() -> None:
    names = [b.name for b in builtin_backends()]
    sparse = ("flashmla-sparse", "fa3-sparse", "trtllm-gen-sparse", "flashinfer-sparse-sm120")
    assert sorted(names) == sorted(GPU_BACKENDS + ("flashmla", "flashmla-fp8", "cpu-peer") + sparse)
    assert list(all_backends()) == names  # no plugins installed here; order is stable
    for backend in builtin_backends():
        assert backend.description and backend.envelope.devices


def test_listing_backends_never_imports_flashinfer() -> None:
    code = ("import sys, torch; from mla_verify.backends import all_backends; "
            "from mla_verify.problems.generate import ProblemSpec; from mla_verify.problems.layouts import LayoutSpec; "
            "[b.why_not(ProblemSpec((5,)), LayoutSpec(), torch.device('cpu')) for b in all_backends().values()]; "
            "print('flashinfer' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_a_gpu_backend_asked_to_run_on_cpu_is_skipped_with_its_reason(name: str) -> None:
    result = run_case(get_backend(name), SPEC, LayoutSpec(), "cpu")
    assert result.verdict == "skip"
    assert result.reason == f"{name}: runs on cuda devices, not cpu"


def test_the_cpu_peer_runs_on_cpu() -> None:
    assert get_backend("cpu-peer").why_not(SPEC, LayoutSpec(), torch.device("cpu")) is None


@pytest.mark.parametrize("name, hint", [("fa33", " (did you mean 'fa3'?)"), ("flashmal", " (did you mean 'flashmla'?)"),
                                        ("zzz", "")])
def test_unknown_backend_is_a_one_line_usage_error(name: str, hint: str) -> None:
    with pytest.raises(UsageError) as err:
        get_backend(name)
    message = str(err.value)
    assert "\n" not in message
    known = list(all_backends())  # dense and sparse (top-k) backends alike
    assert message == f"unknown backend '{name}'{hint}; known: {', '.join(known)}"


# --- third-party backends through the entry-point group ---------------------------------------------------------

PLUGIN_INSTANCE = cpu_peer_backend()
PLUGIN_INSTANCE.name = "plugin-instance"
NOT_A_BACKEND = object()


def plugin_factory():
    backend = cpu_peer_backend()
    backend.name = "plugin-factory"
    return backend


def _install(monkeypatch: pytest.MonkeyPatch, *targets: tuple[str, str]) -> None:
    points = [EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in targets]

    def fake_entry_points(*, group: str):
        assert group == ENTRY_POINT_GROUP
        return points
    monkeypatch.setattr(registry, "entry_points", fake_entry_points)


def test_plugins_register_as_instances_or_factories(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, ("a", f"{__name__}:PLUGIN_INSTANCE"), ("b", f"{__name__}:plugin_factory"))
    names = list(all_backends())
    assert names[-2:] == ["plugin-instance", "plugin-factory"]
    assert get_backend("plugin-instance") is PLUGIN_INSTANCE


@pytest.mark.parametrize("value,complaint", [
    (f"{__name__}:NOT_A_BACKEND", "gave a object, not a mla_verify Backend"),
    ("no_such_module_anywhere:thing", "failed to load: ModuleNotFoundError"),
    (f"{__name__}:missing_attribute", "failed to load: AttributeError"),
    ("mla_verify.backends.cpu_peer:cpu_peer_backend", "two backends are named 'cpu-peer'"),
])
def test_a_bad_plugin_is_a_one_line_usage_error(monkeypatch: pytest.MonkeyPatch, value: str,
                                                complaint: str) -> None:
    _install(monkeypatch, ("bad", value))
    with pytest.raises(UsageError, match=complaint) as err:
        all_backends()
    assert "\n" not in str(err.value)


def test_dims_outside_the_envelope_are_said_once() -> None:
    from mla_verify.backends.flashinfer_wrapper import WRAPPER_PATHS
    from mla_verify.problems.generate import ProblemSpec
    from mla_verify.problems.layouts import LayoutSpec

    reason = WRAPPER_PATHS["fa2"].envelope.why_not(ProblemSpec((8,), kv_lora_rank=1024), LayoutSpec())
    assert reason is not None and reason.count("(1024, 64)") == 1, reason


def test_a_case_of_another_kind_than_the_backend_judges_says_which_kind_each_is() -> None:
    from mla_verify.problems.generate import ProblemSpec
    from mla_verify.problems.layouts import LayoutSpec

    with pytest.raises(UsageError) as err:  # e.g. replaying a dense fixture with --backend flashmla-sparse
        run_case(get_backend("flashmla-sparse"), ProblemSpec((8,)), LayoutSpec(), "cpu")
    assert str(err.value) == "flashmla-sparse judges sparse decode problems; this case is a dense one"


def test_sparse_backends_are_registered_as_their_kind() -> None:
    kinds = {name: b.kind for name, b in all_backends().items()}
    assert {n for n, k in kinds.items() if k == "sparse"} == {"flashmla-sparse", "fa3-sparse", "trtllm-gen-sparse",
                                                                "flashinfer-sparse-sm120"}
    assert kinds["fa3"] == kinds["cpu-peer"] == "dense"
