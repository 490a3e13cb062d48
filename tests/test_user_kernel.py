"""``--kernel MODULE:ATTR``: loading, the trtllm-gen default envelope, declared envelopes, one-line errors."""
from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from mla_verify.backends.base import Envelope
from mla_verify.backends.trtllm_style import TRTLLM_ENVELOPE
from mla_verify.backends.user_kernel import _FIELDS, USER_ENVELOPE, envelope_from_overrides, load_kernel
from mla_verify.core.errors import UsageError
from mla_verify.problems.generate import ProblemSpec
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.run.harness import run_case

KERNELS = '''
from mla_verify.backends.cpu_peer import cpu_peer_decode

def plain(*args, **kwargs):
    """A Contract-1 kernel with no declaration."""
    return cpu_peer_decode(*args, **kwargs)

def narrow(*args, **kwargs):
    return cpu_peer_decode(*args, **kwargs)
narrow.mla_verify_envelope = {"page_sizes": [16], "devices": ["cpu"], "q_len": [1, 4], "dims": [[512, 64]],
                              "archs": None, "cache_dims": [4], "lse_base": 2.0}

class Holder:
    @staticmethod
    def nested(*args, **kwargs):
        return cpu_peer_decode(*args, **kwargs)

NOT_CALLABLE = 42

def typo(*args, **kwargs):
    return cpu_peer_decode(*args, **kwargs)
typo.mla_verify_envelope = {"page_size": [16]}

def ill_typed(*args, **kwargs):
    return cpu_peer_decode(*args, **kwargs)
ill_typed.mla_verify_envelope = {"q_len": [4, 1]}
'''


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_kernels.py").write_text(textwrap.dedent(KERNELS))
    (tmp_path / "broken_kernels.py").write_text("raise RuntimeError('cannot initialise the device')\n")
    (tmp_path / "exiting_kernels.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_kernels"


def test_a_plain_callable_is_held_to_trtllm_gens_envelope(kernels: str) -> None:
    backend = load_kernel(f"{kernels}:plain")
    # trtllm-gen's envelope, with no bit-level claim on the metamorphic relations (docs/contracts.md)
    assert backend.name == f"{kernels}:plain" and backend.envelope == TRTLLM_ENVELOPE.narrowed(bit_invariant=())
    assert backend.description == "A Contract-1 kernel with no declaration."


def test_a_declared_envelope_replaces_only_the_named_fields(kernels: str) -> None:
    env = load_kernel(f"{kernels}:narrow").envelope
    assert env.page_sizes == (16,) and env.devices == ("cpu",) and env.q_len == (1, 4)
    assert env.dims == ((512, 64),) and env.cache_dims == (4,) and env.archs is None
    assert env.heads == TRTLLM_ENVELOPE.heads and env.dtypes == TRTLLM_ENVELOPE.dtypes


def test_a_user_kernel_is_verified_within_its_declared_envelope(kernels: str) -> None:
    backend = load_kernel(f"{kernels}:narrow")
    spec = ProblemSpec(seq_lens=(3, 50), q_len=2, num_heads=4, page_size=16, seed=2)
    assert run_case(backend, spec, LayoutSpec(cache_dims=4), "cpu").verdict == "pass"
    skipped = run_case(backend, spec, LayoutSpec(cache_dims=3), "cpu")
    assert skipped.verdict == "skip" and "3-D cache" in skipped.reason


def test_dotted_attributes_resolve(kernels: str) -> None:
    assert load_kernel(f"{kernels}:Holder.nested").fn.__name__ == "nested"


@pytest.mark.parametrize("target,complaint", [
    ("my_kernels", "--kernel expects MODULE:ATTR"),
    ("my_kernels:", "--kernel expects MODULE:ATTR"),
    ("no_such_kernels:decode", "kernel module 'no_such_kernels' not found"),
    ("broken_kernels:decode", "importing kernel module 'broken_kernels' failed: RuntimeError: cannot initialise"),
    # a module that calls sys.exit at import must not take the command's exit code with it
    ("exiting_kernels:decode", "importing kernel module 'exiting_kernels' failed: SystemExit: 3"),
    ("my_kernels:missing", "'my_kernels' has no attribute 'missing'"),
    ("my_kernels:Holder.missing", "'Holder' has no attribute 'missing'"),
    ("my_kernels:NOT_CALLABLE", "is a int, not a callable"),
    ("my_kernels:typo", "unknown envelope field(s) ['page_size']"),
    ("my_kernels:ill_typed", "envelope field 'q_len' must be [min, max]"),
])
def test_loading_errors_are_one_line_usage_errors(kernels: str, target: str, complaint: str) -> None:
    with pytest.raises(UsageError) as err:
        load_kernel(target)
    assert complaint in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides,complaint", [
    ([16], "must be a dict of Envelope fields"),
    ({"devices": ["tpu"]}, "'devices' must be"),
    ({"devices": []}, "'devices' must be"),
    ({"dtypes": ["int8"]}, "'dtypes' must be"),
    ({"archs": [[9]]}, "'archs' must be"),
    ({"page_sizes": [0]}, "'page_sizes' must be"),
    ({"cache_dims": [5]}, "'cache_dims' must be"),
    ({"table_widths": ["pad64"]}, "'table_widths' must be"),
    ({"lse": "yes"}, "'lse' must be"),
    ({"max_heads": True}, "'max_heads' must be"),
    ({"lse_base": 1}, "'lse_base' must be"),
    ({"dims_by_dtype": [["fp4", [[512, 64]]]]}, "'dims_by_dtype' must be"),
    ({"dims_by_dtype": [["fp8", [512, 64]]]}, "'dims_by_dtype' must be"),
    ({"q_lens": [0, 1]}, "'q_lens' must be"),
    ({"batch_sizes": [2.5]}, "'batch_sizes' must be"),
    ({"windows": []}, "'windows' must be"),
    ({"windows": [-1]}, "'windows' must be"),
    ({"split_sizes": [0]}, "'split_sizes' must be a list of ints >= 1"),
    ({"special_lengths": 4096}, "'special_lengths' must be a list of ints >= 1"),
])
def test_bad_envelope_values_are_named(overrides, complaint: str) -> None:
    with pytest.raises(UsageError, match=complaint):
        envelope_from_overrides(overrides)


def test_every_envelope_field_can_be_declared() -> None:
    assert set(_FIELDS) == {f.name for f in dataclasses.fields(Envelope)}
    assert envelope_from_overrides({}) == USER_ENVELOPE
    declared = envelope_from_overrides({"dims": [[512, 64], [256, 64]], "dims_by_dtype": [["fp8", [[512, 64]]]]})
    assert declared.dims_for("fp8") == ((512, 64),) and declared.dims_for("bf16") == ((512, 64), (256, 64))
    assert envelope_from_overrides({"windows": [None, 128], "q_lens": [1, 4]}).windows == (None, 128)
    assert envelope_from_overrides({"split_sizes": [256, 64]}).split_sizes == (256, 64)


# ---------------------------------------------------------------- where a kernel is found
NEIGHBOUR = "SCALE = 1.0\n"
USES_NEIGHBOUR = '''
from helper_consts import SCALE  # a file beside it, as `python path/to/file.py` would find it
from mla_verify.backends.cpu_peer import cpu_peer_decode

def decode(*args, **kwargs):
    """Reads a constant from the file beside it."""
    return cpu_peer_decode(*args, **kwargs)
'''


@pytest.fixture
def kernel_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's folder with a kernel file and a helper it imports; the current directory, not on sys.path."""
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "user_decode.py").write_text(USES_NEIGHBOUR)
    (folder / "helper_consts.py").write_text(NEIGHBOUR)
    monkeypatch.chdir(folder)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".", str(folder))])
    for name in ("user_decode", "helper_consts"):
        monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    return folder


def test_a_module_in_the_current_directory_is_found(kernel_dir: Path) -> None:
    backend = load_kernel("user_decode:decode")
    assert backend.name == "user_decode:decode" and backend.description == "Reads a constant from the file beside it."


@pytest.mark.parametrize("where", ["relative", "absolute", "from elsewhere"])
def test_a_kernel_file_is_loaded_by_path(kernel_dir: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    target = {"relative": "user_decode.py:decode", "absolute": f"{kernel_dir / 'user_decode.py'}:decode",
              "from elsewhere": "work/user_decode.py:decode"}[where]
    if where == "from elsewhere":
        monkeypatch.chdir(kernel_dir.parent)
    backend = load_kernel(target)
    spec = ProblemSpec(seq_lens=(3, 40), num_heads=2, page_size=32, seed=1)
    assert run_case(backend, spec, LayoutSpec(), "cpu").verdict == "pass"
    assert load_kernel(target).fn is backend.fn  # the file runs once however often it is named


@pytest.mark.parametrize("write,target,complaint", [
    (None, "absent.py:decode", "--kernel: kernel file absent.py does not exist"),
    (None, "work:decode", "kernel module 'work' not found in the current directory"),
    ("raise ValueError('no GPU here')\n", "bad_file.py:decode",
     "running kernel file bad_file.py failed: ValueError: no GPU here at bad_file.py:1 in <module>"),
    ("def decode(:\n", "bad_file.py:decode", "running kernel file bad_file.py failed: SyntaxError"),
    ("import not_installed_anywhere\n", "bad_file:decode",
     "importing kernel module 'bad_file' failed: ModuleNotFoundError: No module named 'not_installed_anywhere'"),
    ("x = 1\n", "bad_file.py:decode", "kernel 'bad_file.py:decode': 'bad_file.py' has no attribute 'decode'"),
    ("def decode(*args):\n    pass\n", "bad_file.py:decod",
     "'bad_file.py' has no attribute 'decod' (did you mean 'decode'?)"),
    (None, "user_decod:decode", "kernel module 'user_decod' (did you mean 'user_decode'?) not found"),
    (None, "user_decode.py:", "--kernel expects MODULE:ATTR or path/to/file.py:ATTR"),
    (None, "user decode:decode", "is neither a module name nor a path to a .py file"),
])
def test_file_and_module_errors_are_one_line(kernel_dir: Path, write: str | None, target: str, complaint: str) -> None:
    if write is not None:
        (kernel_dir / "bad_file.py").write_text(write)
    with pytest.raises(UsageError) as err:
        load_kernel(target)
    assert complaint in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("target", ["bad_syntax.py:decode", "bad_syntax:decode"])
def test_a_syntax_error_is_reported_at_the_kernels_file_and_line(kernel_dir: Path, target: str) -> None:
    (kernel_dir / "bad_syntax.py").write_text("import torch\n\ndef decode(:\n    pass\n")
    with pytest.raises(UsageError) as err:
        load_kernel(target)
    assert str(err.value).endswith(f"SyntaxError: invalid syntax at {kernel_dir / 'bad_syntax.py'}:3"), err.value


RAISES_IN_TORCH = '''
import torch

def _pad(x):
    return torch.nn.functional.pad(x, (1, 1), mode="no-such-mode")  # raises inside torch's Python code

def decode(query, *args, **kwargs):
    return _pad(query)
'''


def test_a_kernel_that_raises_is_located_in_its_own_file(kernel_dir: Path) -> None:
    (kernel_dir / "raising.py").write_text(RAISES_IN_TORCH)
    result = run_case(load_kernel("raising.py:decode"), ProblemSpec(seq_lens=(5,), num_heads=2, page_size=32),
                      LayoutSpec(), "cpu")
    assert result.verdict == "fail" and result.reason.startswith("kernel raised ")
    # the kernel's own deepest line, not torch's, nor the suite's adapter that called it
    assert result.reason.endswith("at raising.py:5 in _pad"), result.reason
    assert result.diagnosis == []  # no output: nothing to diagnose, and no claim that nothing explains it
