"""A grid case, dense or sparse, and what the timing loop (``measure._time_case``) needs of it: what its rows
record, how to build its input sets and its reference, and which backends run it (each with its prepare) or why
not."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..backends.base import Backend, PreparedCall


class GridCase:
    """A grid point (a frozen dataclass of its axes): its problem kind, its key from ``KEY``, its workload."""

    kind: ClassVar[str]  # its problem kind's name (problems/envelope.py): only backends of that kind time it
    KEY: ClassVar[str]  # str.format template over the axes

    @property
    def key(self) -> str:
        """Stable, readable case key: what ``compare_results`` matches on (with the backend name)."""
        return self.KEY.format(**vars(self))

    def workload(self, backends: Sequence[Backend], device: torch.device, seed: int) -> Workload:
        """This case for ``backends`` (all of its kind): each runnable one with its prepare, or why not."""
        raise NotImplementedError


@dataclass
class Workload:
    kind: str  # "dense" | "sparse": the row's kind
    key: str  # what compare_results matches on, with the backend name
    case: dict[str, Any]  # the grid point's axes
    case_id: str  # the problem's case_id of input set 0
    bytes: int  # what the case must move (docs/bench.md, "What the numbers mean")
    flops: int
    build: Callable[[int], Any]  # input set i -> its problem, on the device
    reference: Callable[[Any], torch.Tensor]  # problem -> the reference out [B, q_len, H, 512]
    runnable: list[tuple[str, Callable[[Any], PreparedCall]]] = field(default_factory=list)  # (backend, prepare)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (backend, why not)
