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
from mla_verify.core.platform import FLASHINFER_RANGE, flashinfer_range_note

ROOT = Path(__file__).resolve().parents[1]


def test_the_range_is_pyproject_s_flashinfer_requirement() -> None:
    required, = re.findall(r'^\s*"flashinfer-python([^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert SpecifierSet(required) == SpecifierSet(FLASHINFER_RANGE)


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
