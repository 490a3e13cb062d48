"""The machine facts every report and `doctor` print: here, whether the installed FlashInfer is one the
envelopes and contract tests were written against."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

from mla_verify.cli import main as cli
from mla_verify.core import platform
from mla_verify.core.errors import UsageError
from mla_verify.core.platform import FLASHINFER_RANGE, flashinfer_range_note

ROOT = Path(__file__).resolve().parents[1]


def test_the_range_is_pyproject_s_flashinfer_extra_and_the_core_does_not_need_it() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    required, = re.findall(r'^flashinfer = \["flashinfer-python([^"]*)"\]', text, re.M)
    assert SpecifierSet(required) == SpecifierSet(FLASHINFER_RANGE)
    core = text.split("[project.optional-dependencies]")[0]
    assert "flashinfer" not in core.split("dependencies = [")[1].split("]")[0]
    assert re.search(r'^test = \["mla-verify\[flashinfer\]"', text, re.M)  # the README's install gets it


@pytest.mark.parametrize("version", ["0.7.4", "0.7.5rc1", "0.7.9.post2", None])
def test_a_version_in_the_range_or_none_installed_says_nothing(version: str | None) -> None:
    assert flashinfer_range_note(version) is None


@pytest.mark.parametrize("version", ["0.7.2.post1", "0.7.3", "0.8.0", "not-a-version"])
def test_a_version_outside_the_range_is_named(version: str) -> None:
    assert f"outside the supported range {FLASHINFER_RANGE}" in str(flashinfer_range_note(version))


def test_doctor_and_the_report_s_platform_line_name_an_unsupported_flashinfer(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "flashinfer_version", lambda: "0.7.2.post1")
    assert cli.main(["doctor"]) == 0
    line, = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("flashinfer ")]
    assert line.startswith(f"flashinfer 0.7.2.post1 (outside the supported range {FLASHINFER_RANGE}")
    assert line[len("flashinfer "):] in platform.platform_info().describe()


def test_a_flashinfer_that_does_not_import_is_every_flashinfer_backend_s_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_verify.backends import get_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(platform, "flashinfer_import_error", lambda: "ImportError: libcudart.so.13: cannot open")
    for name in ("fa2", "fa3", "flashinfer-swa"):
        reason = get_backend(name).unavailable_reason(torch.device("cuda"))
        assert reason == "flashinfer cannot be imported (ImportError: libcudart.so.13: cannot open)", name


def test_a_missing_flashinfer_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from mla_verify.backends import get_backend

    monkeypatch.setattr(platform, "flashinfer_installed", lambda: False)
    monkeypatch.setattr(platform, "flashinfer_version", lambda: None)
    assert cli.main(["doctor"]) == 0
    line, = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("flashinfer ")]
    assert line == f"flashinfer not installed (its backends need it: {platform.FLASHINFER_INSTALL})"
    assert platform.FLASHINFER_INSTALL == "pip install 'mla-verify[flashinfer]'"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for name in ("fa2", "fa3", "fa-auto", "flashinfer-swa"):
        reason = get_backend(name).unavailable_reason(torch.device("cuda"))
        assert reason is not None and reason.endswith(platform.FLASHINFER_INSTALL), (name, reason)
    with pytest.raises(UsageError, match=re.escape(f"fa3 cannot run on cuda: FlashInfer is not installed: "
                                                   f"{platform.FLASHINFER_INSTALL}")):
        cli._select_backends(None, ["fa3"], torch.device("cuda"))  # check's one line for a named backend
