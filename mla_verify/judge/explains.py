"""When a recomputed output explains a kernel's -- the one rule every kind's catalogue of misreadings is held to
(diagnose.py's, dense; sparse_catalog.py's, sparse) and localize.py's masked references too: the bar, the words of
an explanation, how the lines start, and when a misreading is named at all.

A recomputation explains the kernel's output when its relative L2 error against it is below ``OUT_TOL`` and
at least ``TRUTH_MARGIN`` times below that of the correct reference (``explaining``). A match that leans on NaN
where the reference is finite proves little (a kernel and a misreading that both read some NaN-poisoned slot
agree on the NaN, whatever slots each reads; all-NaN output "matches" every such misreading), so such a candidate
is named only once the kernel, re-run, confirms it (``Confirm``): with finite values in every poisoned slot (the
catalogue's ``finite_poison``) the kernel matches the candidate recomputed on that problem -- on some finite
values, or on the NaN of its own making, made with no NaN in its inputs, where the candidate makes them too; or
the kernel's only fault is the poison it reads -- re-run on the same cache it makes the same NaN, and with finite
poison it is right -- and the candidate reads exactly those slots. Without a re-run such a candidate is not
named. When several candidates explain the output, the kernel is re-run on the catalogue's nearby problems
(``Catalogue.nearby``: where the candidates part) and the candidates that miss there are dropped; those still
standing together are named only as candidates this case cannot tell apart (``CANDIDATES``,
``explanation_lines``): a misreading is named alone only when it explains the output better than any other.

Also here: the dense problem with finite values in its NaN-poisoned cache slots, which diagnose.py and
localize.py re-run the kernel on. Import rule: the problems, compare.py and torch only.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from ..problems.problem import FP8, DecodeProblem
from ..problems.reference import ReferenceResult
from .compare import judged_rows

# rel L2 below which a recomputation explains the output. fp8: a careful fp8 kernel (fp8 probabilities)
# reaches rel L2 ~3e-2 (compare.py), so it gets 4x that. Other (bf16, fp16): a correct kernel sits about its
# output rounding, 2^-9 ~ 2e-3, from exact arithmetic; 2e-2 leaves 10x for its accumulation order.
OUT_TOL = {"fp8": 1.2e-1, "other": 2e-2}
# ...and the recomputation must be this many times closer than the correct reference. A kernel that is only
# noisier than a correct one is about as far from every nearby recomputation as from the truth, so no
# explanation beats the truth by 4x; one that computes a wrong formula is close to that formula alone.
TRUTH_MARGIN = 4.0
WHERE = "where: "  # the start of every localization line (localize.py), as against an explanation
FAILED, SKIPPED = "diagnosis failed: ", "diagnosis skipped: "  # an error inside the diagnosis; no memory for it
CANDIDATES = "candidates: "  # starts the line saying the case cannot tell the named misreadings apart
OUT_METRIC = "rel L2 of out"
Rerun = Callable[[Any], "torch.Tensor | None"]  # the kernel's canonical out on another problem of its kind


@dataclass(frozen=True)
class Explanation:
    name: str  # catalog entry
    description: str  # what the kernel does, in words
    error: float  # kernel vs this misreading (rel L2 of out, or max |lse error| in natural-log units)
    truth_error: float  # kernel vs the correct reference, same measure
    metric: str

    def __str__(self) -> str:
        return (f"{self.description} [{self.name}] ({self.metric}: {self.error:.2g} under this misreading, "
                f"{self.truth_error:.2g} against the reference)")


class Catalogue(Protocol):
    """A kind's misreadings, as the rule above needs them."""

    def description(self, name: str) -> str:
        """What a kernel with misreading ``name`` does, in words."""

    def error(self, name: str, problem: Any, out: torch.Tensor, truth: ReferenceResult) -> float:
        """``out`` against misreading ``name`` recomputed on ``problem`` (whose reference is ``truth``), over the
        rows judged; inf where it does not apply."""

    def finite_poison(self, problem: Any) -> Any:
        """``problem`` with finite values in every slot that holds NaN (the kernel reads the same values
        elsewhere); None when none does."""

    def nearby(self, problem: Any) -> Iterator[Any]:
        """Problems close to ``problem`` on which the misreadings' outputs part (the kernel is re-run on each)."""

    def reference(self, problem: Any) -> ReferenceResult:
        """The reference a nearby problem's re-run is measured against."""

    @property
    def nearby_words(self) -> str:
        """What the nearby problems are, in words (" and on its sequences a token or two shorter"; "": none)."""


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| over finite values; inf if the non-finite values are not at the same places."""
    g, w = got.detach().to(torch.float64), want.detach().to(torch.float64).to(got.device)
    finite = torch.isfinite(g)
    if g.shape != w.shape or not torch.equal(finite, torch.isfinite(w)):
        return math.inf
    diff = float((g[finite] - w[finite]).norm())
    return diff / max(float(w[finite].norm()), 1e-30)


def truth_error(out: torch.Tensor, truth: ReferenceResult) -> float:
    """``out`` against the correct reference, over the rows judged."""
    return relative_error(judged_rows(out, truth), judged_rows(truth.out, truth))


def explaining(cat: Catalogue, problem: Any, out: torch.Tensor, truth: ReferenceResult, names: list[str],
               rerun: Rerun | None, tol: float) -> list[Explanation]:
    """The misreadings of ``names`` that explain ``out`` on ``problem`` (the rule above; ``rerun`` runs the
    kernel on another problem, to confirm a match through NaN and to tell candidates apart)."""
    wrong = truth_error(out, truth)
    confirm = Confirm(cat, problem, out, truth, rerun, tol) if _nan_beyond(out, truth) else None
    found = []
    for name in names:
        error = cat.error(name, problem, out, truth)
        if error < tol and error * TRUTH_MARGIN < wrong and (confirm is None or confirm(name)):
            found.append(Explanation(name, cat.description(name), error, wrong, OUT_METRIC))
    return _told_apart(cat, problem, found, rerun, tol)


def explanation_lines(cat: Catalogue, found: list[Explanation]) -> list[str]:
    """The explanations as a diagnosis says them: when more than one names the output's misreading, first the
    line saying this case cannot tell them apart."""
    named = [e.name for e in found if e.metric == OUT_METRIC]
    head = [CANDIDATES + f"this case cannot tell {len(named)} misreadings apart ({', '.join(named)}); each "
            f"explains the output equally, on this case{cat.nearby_words}"] if len(named) > 1 else []
    return head + [str(e) for e in found]


def _nan_beyond(out: torch.Tensor, truth: ReferenceResult) -> bool:
    """Whether ``out`` is non-finite in a judged element where the reference is finite."""
    got, want = judged_rows(out, truth), judged_rows(truth.out, truth)
    return bool((~torch.isfinite(got) & torch.isfinite(want).to(got.device)).any())


class Confirm:
    """Whether a candidate that matched ``out`` through NaN is confirmed by re-running the kernel (see the
    module docstring); each re-run happens once, on the first candidate that needs it."""

    def __init__(self, cat: Catalogue, p: Any, out: torch.Tensor, truth: ReferenceResult, rerun: Rerun | None,
                 tol: float):
        self.cat, self.p, self.out, self.truth, self.rerun, self.tol = cat, p, out, truth, rerun, tol
        self.poisoned = cat.finite_poison(p)
        self.runs: dict[str, torch.Tensor | None] = {}

    def _run(self, which: str) -> torch.Tensor | None:
        if which not in self.runs:
            p = self.poisoned if which == "finite" else self.p
            self.runs[which] = None if self.rerun is None or p is None else self.rerun(p)
        return self.runs[which]

    def __call__(self, name: str) -> bool:
        if self.poisoned is None:  # the cache holds no NaN: the NaN are the kernel's own, the candidate makes
            return bool(torch.isfinite(self.out).any())  # them at the same places, and the rest matched
        if self.rerun is None:
            return False
        finite = self._run("finite")
        if holds(self.cat, name, self.poisoned, finite, self.truth, self.tol) or \
                self._own_nan(name, finite):
            return True
        same = self._run("same")  # the NaN come from the cache (not from the layout) when they come again
        return (finite is not None and same is not None and tuple(same.shape) == tuple(self.out.shape)
                and torch.equal(torch.isfinite(same), torch.isfinite(self.out).to(same.device))
                and truth_error(finite, self.truth) < self.tol)

    def _own_nan(self, name: str, finite: torch.Tensor | None) -> bool:
        """With no NaN in its inputs the kernel still makes NaN, exactly where the candidate makes them, and
        matches it on every finite value (if any)."""
        if finite is None or tuple(finite.shape) != tuple(self.truth.out.shape):
            return False
        own = ~torch.isfinite(judged_rows(finite, self.truth))
        return bool(own.any()) and self.cat.error(name, self.poisoned, finite, self.truth) < self.tol


def holds(cat: Catalogue, name: str, p: Any, out: torch.Tensor | None, truth: ReferenceResult, tol: float) -> bool:
    """Whether misreading ``name`` explains the kernel's output ``out`` on ``p`` (whose reference is ``truth``) by
    the bar of ``explaining``, on some finite values; False without an output."""
    if out is None or tuple(out.shape) != tuple(truth.out.shape) or not bool(torch.isfinite(out).any()):
        return False
    error = cat.error(name, p, out, truth)
    return error < tol and error * TRUTH_MARGIN < truth_error(out, truth)


def _told_apart(cat: Catalogue, p: Any, found: list[Explanation], rerun: Rerun | None,
                tol: float) -> list[Explanation]:
    """``found`` less the output explanations that miss the kernel's output on a nearby problem where another
    one still holds; unchanged when no re-run parts them."""
    named = [e.name for e in found if e.metric == OUT_METRIC]
    if len(named) < 2 or rerun is None:
        return found
    for q in cat.nearby(p):
        out = rerun(q)
        if out is None:
            continue
        truth = cat.reference(q)
        holding = [n for n in named if holds(cat, n, q, out, truth, tol)]
        if holding and len(holding) < len(named):
            named = holding
    return [e for e in found if e.metric != OUT_METRIC or e.name in named]


def exact_bf16(problem: DecodeProblem) -> DecodeProblem:
    """An fp8 problem with query and cache in bf16, which holds every fp8 value exactly: the reference gives
    the same numbers, and the tensor operations fp8 lacks on CUDA (roll, indexing, where) all work."""
    if problem.query.dtype != FP8 and problem.kv_cache.dtype != FP8:
        return problem
    return replace(problem, query=problem.query.to(torch.bfloat16), kv_cache=problem.kv_cache.to(torch.bfloat16))


def finite_poison(p: DecodeProblem) -> DecodeProblem | None:
    """``p`` with a finite value (drawn like the cache's own) in every cache slot that holds NaN; None if none."""
    wide = exact_bf16(p).kv_cache
    holes = torch.isnan(wide)
    if not bool(holes.any()):
        return None
    gen = torch.Generator(device=wide.device).manual_seed(0)
    fill = torch.randn(wide.shape, generator=gen, device=wide.device, dtype=torch.float32).to(wide.dtype)
    return replace(p, kv_cache=torch.where(holes, fill, wide).to(p.kv_cache.dtype))
