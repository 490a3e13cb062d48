"""What a backend is: a name, an envelope, a reason it cannot run, and a prepared kernel call.

Backends know nothing about Hypothesis. The harness asks ``why_not`` before touching a kernel, then
``prepare`` builds the exact arguments (so every input can be snapshotted and ``out`` poisoned), then the
harness calls ``PreparedCall.invoke`` and maps the result to canonical form with ``to_canonical``.

A backend judges one kind of problem, the one its envelope bounds (``kind``: an ``Envelope`` bounds dense
decode problems, a ``SparseEnvelope`` sparse top-k ones): its ``prepare`` takes that kind's problem
(problems/problem.py's ``DecodeProblem``, problems/sparse.py's ``SparseDecodeProblem``) and the layout of the
call, and everything else -- registry, harness, search, isolation, reports -- is the same for every kind.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ..problems.arithmetic import DEFAULT, Arithmetic
from ..problems.envelope import ENVELOPE_PREFIX, LSE_BASE_2, Envelope, SparseEnvelope
from ..problems.layouts import LayoutSpec

__all__ = ["ENVELOPE_PREFIX", "LSE_BASE_2", "INVARIANT_BITS", "INVARIANT_WITHIN_TOLERANCE", "AnyEnvelope", "Backend",
           "Envelope", "PreparedCall", "SparseEnvelope", "WarmupModule", "device_reason"]
AnyEnvelope = Envelope | SparseEnvelope

# How a metamorphic relation was judged (CaseResult.invariance): the very same bits, where the relation keeps the
# arithmetic (kinds.Relation.bits) and the backend claims them (its envelope's ``bit_invariant``), else the same
# values within the tolerance model
INVARIANT_BITS = "bits"
INVARIANT_WITHIN_TOLERANCE = "tolerance"


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


@dataclass(frozen=True)
class WarmupModule:
    """A compiled module a backend's cases load, made ready before the first case (run/warmup.py).

    ``build`` takes every pending module of one library at once (so that it can share the host's cores among
    them), starts building them and returns at once, one future per module, done when that module is built;
    before it returns, each module is locked against other processes' loads, which then wait for its build
    (``ready`` returns once no process is building it). Builders of different libraries run side by side.
    ``load`` then brings the built module into this process. Modules are keyed by ``name``: one shared by two
    backends is made once.
    """

    name: str
    spec: Any  # what ``build`` compiles (FlashInfer: a JitSpec)
    build: Callable[[Sequence[Any]], Sequence[Future[None]]]
    load: Callable[[], Any]
    ready: Callable[[], None] | None = None  # None: nothing to wait for (no lock between processes)


class Backend(ABC):
    name: str
    envelope: AnyEnvelope  # an Envelope (dense decode) or a SparseEnvelope (sparse top-k decode): ``kind`` says which
    description: str = ""
    # a user kernel's file ("file"), the folder its module is imported from ("sys_path") and the calling
    # convention it was named with ("convention"): reproducers record it, so that replay finds the kernel from
    # any directory and calls it the same way (user_kernel.load_kernel)
    source: dict[str, str] | None = None
    # what the kernel rounds, by problem dtype (problems/arithmetic.py): the tolerance model's baseline emulates
    # it; a dtype not named here is judged against the plain baseline (arithmetic.DEFAULT)
    arithmetic: dict[str, Arithmetic] = {}
    # sparse: formats whose packed bytes the kernel never sees: ``prepare`` widens such a problem's cache to bf16
    # rows (outside the call), so the kernel's traffic is the bf16 problem's (the bench times those as bf16 only)
    widened_formats: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """The kind of problem this backend is judged on (problems/envelope.py's DENSE or SPARSE)."""
        return self.envelope.kind

    def arithmetic_for(self, dtype: str, resolved_backend: str | None = None) -> Arithmetic:
        """The arithmetic of this backend's kernel on ``dtype`` problems (``resolved_backend``: the kernel a
        policy backend chose for the case, which declares its own)."""
        return self.arithmetic.get(dtype, DEFAULT)

    def claims_bits(self, relation: str) -> bool:
        """Whether the backend claims the very same bits under the metamorphic ``relation`` (else its output is
        judged within tolerance)."""
        return relation in self.envelope.bit_invariant

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device`` at all (library, architecture), or None."""
        return device_reason(self.envelope, device)

    def why_not(self, spec: Any, layout: LayoutSpec, device: torch.device) -> str | None:
        """Checked before any kernel is touched: None when this backend can run (spec, layout) on device."""
        return self.unavailable_reason(device) or self.envelope.why_not(spec, layout)

    def warmup(self, device: torch.device) -> list[WarmupModule]:
        """The modules this backend's cases on ``device`` can load, made ready before the first case. None by
        default: a kernel handed over already compiled (a user's, the CPU peer) has nothing to warm."""
        return []

    @abstractmethod
    def prepare(self, problem: Any, layout: LayoutSpec) -> PreparedCall:
        """Lay out ``problem`` (of this backend's kind) for this kernel and return the call (not yet run)."""


def device_reason(env: AnyEnvelope, device: torch.device) -> str | None:
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
