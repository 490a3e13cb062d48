"""What a backend is: a name, an envelope, a reason it cannot run, and a prepared kernel call.

Backends know nothing about Hypothesis. The harness asks ``why_not`` before touching a kernel, then
``prepare`` builds the exact arguments (so every input can be snapshotted and ``out`` poisoned), then the
harness calls ``PreparedCall.invoke`` and maps the result to canonical form with ``to_canonical``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..generate import ProblemSpec
from ..layouts import LayoutSpec
from ..problem import DecodeProblem

LSE_BASE_2 = 2.0
ENVELOPE_PREFIX = "outside its envelope"  # how Envelope.why_not starts its sentence


@dataclass(frozen=True)
class Envelope:
    """The problems a backend claims to handle. ``None`` in a field means "any"."""

    devices: tuple[str, ...] = ("cuda",)  # device types: "cpu", "cuda"
    archs: tuple[tuple[int, int], ...] | None = None  # CUDA compute capabilities, e.g. ((10, 0), (10, 3))
    page_sizes: tuple[int, ...] | None = None
    dims: tuple[tuple[int, int], ...] = ((512, 64),)  # (kv_lora_rank, qk_rope_head_dim)
    # dtypes limited to a subset of ``dims`` (e.g. FlashInfer's FA paths take an fp8 cache only with (512, 64))
    dims_by_dtype: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()
    heads: tuple[int, ...] | None = None  # allowed head counts (None: 1..max_heads)
    max_heads: int = 128
    dtypes: tuple[str, ...] = ("bf16",)
    q_len: tuple[int, int] = (1, 1)  # inclusive range
    q_lens: tuple[int, ...] | None = None  # the only q_len values taken within that range (None: all of them)
    batch_sizes: tuple[int, ...] | None = None  # the only batch sizes taken (None: 1..max_batch)
    # per-request query lengths (ProblemSpec.q_lens): only a kernel told each request's own q_len takes them
    # (FlashInfer's wrapper, through qo_indptr); Contract 1's callable has one q_len for the whole batch
    ragged_q: bool = False
    windows: tuple[int | None, ...] = (None,)  # sliding windows (window_left) taken; None: plain causal
    cache_dims: tuple[int, ...] = (3,)
    page_strided: bool = True
    table_widths: tuple[str, ...] = ("native",)
    pass_out: tuple[bool, ...] = (True, False)
    lse: bool = True
    lse_base: float = LSE_BASE_2
    max_batch: int = 1024
    max_seq_len: int = 1 << 17
    notes: str = ""

    def dims_for(self, dtype: str) -> tuple[tuple[int, int], ...]:
        """The (kv_lora_rank, qk_rope_head_dim) pairs this envelope takes with ``dtype``."""
        limited = dict(self.dims_by_dtype).get(dtype)
        return self.dims if limited is None else tuple(d for d in self.dims if d in limited)

    def allows_heads(self, h: int) -> bool:
        return (h in self.heads) if self.heads is not None else 1 <= h <= self.max_heads

    def why_not(self, spec: ProblemSpec, layout: LayoutSpec) -> str | None:
        """A sentence saying why (spec, layout) is outside this envelope, or None."""
        checks = [
            (self.page_sizes is None or spec.page_size in self.page_sizes,
             f"page size {spec.page_size} (supported: {self.page_sizes})"),
            ((spec.kv_lora_rank, spec.qk_rope_head_dim) in self.dims,
             f"dims ({spec.kv_lora_rank}, {spec.qk_rope_head_dim}) (supported: {list(self.dims)})"),
            (self.allows_heads(spec.num_heads), f"{spec.num_heads} heads"),
            (spec.dtype in self.dtypes, f"dtype {spec.dtype} (supported: {list(self.dtypes)})"),
            ((spec.kv_lora_rank, spec.qk_rope_head_dim) not in self.dims  # said once, above
             or (spec.kv_lora_rank, spec.qk_rope_head_dim) in self.dims_for(spec.dtype),
             f"{spec.dtype} with dims ({spec.kv_lora_rank}, {spec.qk_rope_head_dim}) "
             f"(supported: {list(self.dims_for(spec.dtype))})"),
            (self.q_len[0] <= spec.q_len <= self.q_len[1],
             f"q_len {spec.q_len} (supported {self.q_len[0]}..{self.q_len[1]})"),
            (self.q_lens is None or spec.q_len in self.q_lens, f"q_len {spec.q_len} (supported: {self.q_lens})"),
            (self.ragged_q or spec.q_lens is None,
             f"per-request q_lens {list(spec.q_lens or ())} (this kernel takes one q_len for every request)"),
            (self.batch_sizes is None or spec.batch in self.batch_sizes,
             f"batch {spec.batch} (supported: {self.batch_sizes})"),
            (spec.window_left in self.windows, f"window_left {spec.window_left} (supported: {list(self.windows)})"),
            (layout.cache_dims in self.cache_dims, f"a {layout.cache_dims}-D cache"),
            (self.page_strided or layout.page_stride_pad == 0, "a page-strided cache"),
            (layout.table_width in self.table_widths, f"block-table width '{layout.table_width}'"),
            (layout.pass_out in self.pass_out, "out passed" if layout.pass_out else "out not passed"),
            (self.lse or not layout.return_lse, "returning LSE"),
            (spec.batch <= self.max_batch, f"batch {spec.batch} (max {self.max_batch})"),
            (max(spec.seq_lens) <= self.max_seq_len, f"seq_len {max(spec.seq_lens)} (max {self.max_seq_len})"),
        ]
        bad = [what for ok, what in checks if not ok]
        return (f"{ENVELOPE_PREFIX}: " + "; ".join(bad)) if bad else None

    def narrowed(self, **changes: Any) -> Envelope:
        return replace(self, **changes)


@dataclass
class PreparedCall:
    """One kernel call, ready to go: the harness snapshots ``inputs``, poisons ``out``, then invokes."""

    invoke: Callable[[], Any]
    inputs: dict[str, torch.Tensor]  # everything the kernel may read; must be unchanged afterwards
    out: torch.Tensor | None  # the buffer handed to the kernel (None: the kernel allocates)
    to_canonical: Callable[[Any], tuple[torch.Tensor, torch.Tensor | None]]
    # kernel result -> (out [B, q_len, H, L], lse in the backend's base [B, q_len, H] or None)
    output_scale: float = 1.0  # a bmm2 the kernel cannot take: the harness applies it, in float64, to judge
    # the output (doing it in bf16 after the kernel would add a rounding the kernel did not make)
    resolved_backend: str | None = None  # the library's own kernel choice when the backend is a policy
    # (FlashInfer's backend="auto"), as the library recorded it; None for a backend that is one kernel
    # the output tensor in the kernel's own result, where the canonical out is a copy of it (a ragged problem's
    # packed rows): the tensor the harness requires to be ``out`` (None: the canonical out itself)
    kernel_out: Callable[[Any], Any] | None = None

    def judged(self, result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output to compare with the reference: canonical, with ``output_scale`` applied in float64."""
        out, lse = self.to_canonical(result)
        return self.scaled(out), lse

    def scaled(self, out: torch.Tensor) -> torch.Tensor:
        """A canonical output with ``output_scale`` applied (in float64; unchanged when it is 1)."""
        return out if self.output_scale == 1.0 else out.to(torch.float64) * self.output_scale


class Backend(ABC):
    name: str
    envelope: Envelope
    description: str = ""

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device`` at all (library, architecture), or None."""
        return device_reason(self.envelope, device)

    def why_not(self, spec: ProblemSpec, layout: LayoutSpec, device: torch.device) -> str | None:
        """Checked before any kernel is touched: None when this backend can run (spec, layout) on device."""
        return self.unavailable_reason(device) or self.envelope.why_not(spec, layout)

    @abstractmethod
    def prepare(self, problem: DecodeProblem, layout: LayoutSpec) -> PreparedCall:
        """Lay out ``problem`` for this kernel and return the call (not yet run)."""


def device_reason(env: Envelope, device: torch.device) -> str | None:
    """Checks device type and CUDA architecture against an envelope; None if it fits."""
    if device.type not in env.devices:
        return f"runs on {'/'.join(env.devices)} devices, not {device.type}"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available in this PyTorch build or machine"
        if env.archs is not None:
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) not in env.archs:
                wanted = "/".join(f"SM{a}{b}" for a, b in env.archs)
                return f"needs {wanted}; this GPU ({torch.cuda.get_device_name(device)}) is SM{major}{minor}"
    return None
