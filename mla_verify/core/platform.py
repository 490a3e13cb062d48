"""What machine is this: GPUs and their SM versions, and the torch / CUDA / FlashInfer versions.

Used by backends (is FlashInfer importable?), the ``doctor`` command and run records. Nothing here raises
because a library or a GPU is missing: absence is reported as data.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import platform as _platform
from dataclasses import asdict, dataclass, field

import torch

from .tracebacks import exception_line

VERSION = "0.1.0"  # mla-verify's own; pyproject.toml's [project] version (tests/test_platform.py)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    capability: tuple[int, int]
    memory_gib: float

    @property
    def sm(self) -> str:
        return sm_name(self.capability)


@dataclass(frozen=True)
class PlatformInfo:
    python: str
    torch: str
    torch_cuda: str | None  # the CUDA version torch was built with (None: CPU-only build)
    flashinfer: str | None  # installed version, None when not installed
    flashinfer_error: str | None  # why `import flashinfer` failed, None when it works (or is not installed)
    gpus: list[GpuInfo] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        for g, info in zip(d["gpus"], self.gpus):
            g["capability"] = list(info.capability)
            g["sm"] = info.sm
        return d

    def flashinfer_text(self) -> str:
        """The FlashInfer version, whether it is outside the supported range, and why it fails to import."""
        if self.flashinfer is None and not flashinfer_installed():
            return f"not installed (its backends need it: {FLASHINFER_INSTALL})"
        notes = [flashinfer_range_note(self.flashinfer),
                 self.flashinfer_error and f"import fails: {self.flashinfer_error}"]
        return (self.flashinfer or "not installed") + "".join(f" ({n})" for n in notes if n)

    def describe(self) -> str:
        gpus = ", ".join(f"cuda:{g.index} {g.name} ({g.sm})" for g in self.gpus) or "no CUDA GPU"
        return (f"python {self.python}, torch {self.torch} (CUDA {self.torch_cuda or 'none'}), "
                f"flashinfer {self.flashinfer_text()}; {gpus}")


def sm_name(capability: tuple[int, int]) -> str:
    """(9, 0) -> 'SM90', (10, 3) -> 'SM103'."""
    return f"SM{capability[0]}{capability[1]}"


def gpu_info(index: int) -> GpuInfo:
    props = torch.cuda.get_device_properties(index)
    return GpuInfo(index, props.name, (props.major, props.minor), round(props.total_memory / 2**30, 1))


def visible_gpus() -> list[GpuInfo]:
    """Every CUDA device this process can see (empty on a CPU-only machine or build)."""
    if not torch.cuda.is_available():
        return []
    return [gpu_info(i) for i in range(torch.cuda.device_count())]


# pyproject.toml's flashinfer-python requirement: the envelopes and contract tests are read from these releases'
# sources (tests/test_platform.py keeps the two equal)
FLASHINFER_RANGE = ">=0.7.4,<0.8"


def flashinfer_range_note(version: str | None) -> str | None:
    """None when ``version`` is in FLASHINFER_RANGE (or FlashInfer is not installed); else one line saying so."""
    if version is None:
        return None
    from packaging.specifiers import SpecifierSet  # a dependency of flashinfer-python, which is installed here
    from packaging.version import InvalidVersion

    try:
        if SpecifierSet(FLASHINFER_RANGE).contains(version, prereleases=True):
            return None
    except InvalidVersion:
        pass
    return (f"outside the supported range {FLASHINFER_RANGE}: the backends' envelopes and contract tests are "
            "written against those releases")


def flashinfer_version() -> str | None:
    """The installed flashinfer-python version, read from package metadata (no import)."""
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def import_error(module: str) -> str | None:
    """None when ``import module`` works; otherwise one line saying why. Cached: an import can take seconds."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # any failure (missing, broken build, bad CUDA libs) is reported, not raised
        return exception_line(exc, located=False)
    return None


def flashinfer_import_error() -> str | None:
    return import_error("flashinfer")


# FlashInfer is an extra (pyproject.toml): the core package, user kernels and the CPU peer run without it
FLASHINFER_INSTALL = "pip install 'mla-verify[flashinfer]'"


def flashinfer_installed() -> bool:
    """Whether a ``flashinfer`` package is on the path (installed, or put there as the GPU bundle does)."""
    return importlib.util.find_spec("flashinfer") is not None


def flashinfer_unavailable() -> str | None:
    """A FlashInfer backend's reason not to run when FlashInfer cannot be imported; None when it can."""
    if not flashinfer_installed():
        return f"FlashInfer is not installed: {FLASHINFER_INSTALL}"
    error = flashinfer_import_error()
    return None if error is None else f"flashinfer cannot be imported ({error})"


def platform_info() -> PlatformInfo:
    return PlatformInfo(python=_platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda,
                        flashinfer=flashinfer_version(), flashinfer_error=flashinfer_import_error(),
                        gpus=visible_gpus())
