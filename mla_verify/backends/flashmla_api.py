"""Which FlashMLA is installed, and how to drive its interface: shared by the dense and the sparse backends.

Two Python interfaces name the same functions (docs/backends.md has the source lines):
- SGLang's wheel ``sgl-flash-mla`` (1.0.0): ``flash_mla_with_kvcache(..., use_legacy=False, kv_format=None,
  descale_q=None, descale_k=None)``. Its SM90 kernels live in the "legacy" extension, reached only with
  ``use_legacy=True`` on every call; ``get_mla_decoding_metadata(..., use_legacy)`` precomputes a schedule
  (required by dense fp8).
- upstream FlashMLA (a source build, 9241ae3 and before): no ``use_legacy``; SM90 is its only kernel set.
Both return an empty ``FlashMLASchedMeta`` from ``get_mla_metadata()`` that the first dense call fills
(``num_splits`` must be None); FlashMLA of 2025 returned real ``(tile_scheduler_metadata, num_splits)``
tensors instead. Which interface is present is read from the installed function's signature, never assumed.
Whether a FlashMLA backend can run at all (``flashmla_unavailable``) is decided here too, for both.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.platform import import_error
from ..problems.envelope import Envelope, SparseEnvelope
from .base import device_reason

WHEEL = "sgl-flash-mla"
WHEEL_PIN = f"{WHEEL}==1.0.0"
SOURCE = "https://github.com/deepseek-ai/FlashMLA"
INSTALL_ROUTE = f"pip install --no-deps {WHEEL_PIN}, or build it from {SOURCE}"


@dataclass(frozen=True)
class FlashMLABuild:
    """What ``doctor`` says about the installed FlashMLA: ``kind`` is "wheel", "source" or "none"."""

    kind: str
    distribution: str | None = None
    version: str | None = None

    def describe(self) -> str:
        if self.kind == "wheel":
            return f"wheel {self.distribution} {self.version} (SM90 through use_legacy=True)"
        if self.kind == "source":
            return f"upstream source build {self.distribution or 'flash_mla'} {self.version or '(no version)'}"
        return f"none ({INSTALL_ROUTE})"


@functools.cache  # packages_distributions() scans every installed distribution: asked for every case
def installed_build() -> FlashMLABuild:
    """Read from the package metadata, without importing ``flash_mla`` (its import loads CUDA extensions)."""
    if importlib.util.find_spec("flash_mla") is None:
        return FlashMLABuild("none")
    names = importlib.metadata.packages_distributions().get("flash_mla", [])
    for name in names:
        if name.lower().replace("_", "-") == WHEEL:
            return FlashMLABuild("wheel", name, importlib.metadata.version(name))
    if not names:  # a folder on the path, not an installed distribution
        return FlashMLABuild("source")
    return FlashMLABuild("source", names[0], importlib.metadata.version(names[0]))


def takes_use_legacy(flash_mla_with_kvcache: Callable[..., Any]) -> bool:
    """True for the wheel's interface (its decode call has ``use_legacy``), False for upstream's."""
    try:
        return "use_legacy" in inspect.signature(flash_mla_with_kvcache).parameters
    except (TypeError, ValueError):  # a builtin without a signature: upstream's C++ binding of 2025
        return False


@dataclass(frozen=True)
class FlashMLAApi:
    """The functions a FlashMLA backend calls, with ``flash_mla``'s signatures; ``use_legacy`` is read from
    ``flash_mla_with_kvcache`` (True: the wheel's interface, whose SM90 kernels need it on every call)."""

    get_mla_metadata: Callable[..., Any]
    flash_mla_with_kvcache: Callable[..., Any]
    get_mla_decoding_metadata: Callable[..., Any] | None = None  # the wheel's; None in upstream's interface

    @property
    def use_legacy(self) -> bool:
        return takes_use_legacy(self.flash_mla_with_kvcache)

    def call_kwargs(self) -> dict[str, Any]:
        """Keyword arguments every decode call adds: ``use_legacy=True`` where the interface has it."""
        return {"use_legacy": True} if self.use_legacy else {}

    def schedule(self, cache_seqlens: torch.Tensor, q_tokens_per_head_k: int, heads_k: int) -> tuple[Any, Any]:
        """``(tile_scheduler_metadata, num_splits)`` for a dense bf16 call: an empty ``FlashMLASchedMeta`` and
        None today (the first call fills it); real tensors from FlashMLA of 2025, which computed them here."""
        return self.get_mla_metadata(cache_seqlens, q_tokens_per_head_k, heads_k)

    def fp8_schedule(self, cache_seqlens: torch.Tensor, q_tokens_per_head_k: int, heads_k: int) -> Any:
        """The wheel's dense fp8 schedule: ``get_mla_decoding_metadata(..., is_fp8_kvcache=True,
        use_legacy=True)`` assigned to a fresh ``FlashMLASchedMeta`` before the first call, which requires it."""
        if self.get_mla_decoding_metadata is None or not self.use_legacy:
            raise RuntimeError("dense fp8 decode needs the sgl-flash-mla interface (get_mla_decoding_metadata)")
        meta, _ = self.get_mla_metadata()
        meta.tile_scheduler_metadata, meta.num_splits = self.get_mla_decoding_metadata(
            cache_seqlens, q_tokens_per_head_k, heads_k, is_fp8_kvcache=True, use_legacy=True)
        return meta


@functools.cache
def installed_api() -> FlashMLAApi:
    import flash_mla

    return FlashMLAApi(flash_mla.get_mla_metadata, flash_mla.flash_mla_with_kvcache,
                       getattr(flash_mla, "get_mla_decoding_metadata", None))


def needs_wheel(api: FlashMLAApi | None, what: str) -> str | None:
    """None where ``api`` (the installed interface when None) is sgl-flash-mla's; else why ``what``, which only
    the wheel's interface has on SM90, cannot run."""
    if (api or installed_api()).use_legacy:
        return None
    found = "this interface" if api else installed_build().describe()
    return f"{what} is sgl-flash-mla's; {found} has none ({INSTALL_ROUTE})"


def install_hint() -> str | None:
    """None when a ``flash_mla`` package is installed; otherwise the one line saying how to get it."""
    if installed_build().kind == "none":
        return f"install FlashMLA: no flash_mla package here ({INSTALL_ROUTE})"
    return None


def flash_mla_import_error() -> str | None:
    """None when ``import flash_mla`` works; else one line saying why (an extension built for another torch...)."""
    return import_error("flash_mla")


def flashmla_unavailable(api: FlashMLAApi | None, envelope: Envelope | SparseEnvelope,
                         device: torch.device) -> str | None:
    """Why a FlashMLA backend calling ``api`` (the installed ``flash_mla`` when None) cannot run on ``device``."""
    if api is not None:
        return device_reason(envelope, device)
    reason = install_hint() or device_reason(envelope, device)
    if reason is None and (error := flash_mla_import_error()):
        reason = f"FlashMLA is installed but cannot be imported ({error})"
    return reason
