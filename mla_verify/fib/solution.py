"""``--fib-solution SOLUTION.json``: a flashinfer-bench solution, built by flashinfer-bench's own builder, as a
backend of its definition's kind -- a calling-convention adapter, as user_kernel.py is for Contract-1
callables: an ``mla_paged`` decode definition's solution is judged on dense decode problems, a ``dsa_paged``
sparse attention one's on sparse (top-k) ones, through the one pipeline every backend runs in.

The solution is run as flashinfer-bench's evaluator runs it: its ``Runnable`` called with the definition's
inputs in the definition's order, then -- destination-passing style (``spec.destination_passing_style``, the
default) -- its outputs, which it writes in place; a value-returning solution returns them. mla-verify hands
it the outputs poisoned (``output`` with +inf by the harness, ``lse`` with NaN here), so an element it leaves
unwritten shows. The definition's constant axes are the envelope (fib/definition.py): every problem
drawn is one of the definition's. A python solution runs where torch does (``--device cpu`` too); triton,
tilelang, CUDA and C++ solutions need a CUDA device.

flashinfer-bench is an optional extra (``pip install 'mla-verify[fib]'``): without it, the option is a usage
error naming that command. Docs: docs/flashinfer-bench.md.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..backends import named_backend
from ..backends.base import Backend, PreparedCall
from ..core.errors import UsageError
from ..core.tracebacks import exception_line
from ..problems.layouts import LayoutSpec
from ..problems.problem import DecodeProblem
from ..problems.sparse import SparseDecodeProblem
from .definition import (
    FibDefinition,
    dense_inputs,
    output_buffers,
    read_definition,
    sparse_inputs,
)

INSTALL = "pip install 'mla-verify[fib]'"  # the extra pins the flashinfer-bench version read here
FIB_VERSION = "0.1.2"
SOURCE_SOLUTION, SOURCE_DEFINITION = "fib_solution", "fib_definition"  # Backend.source keys: replay finds both
NAME_PREFIX = "fib:"
POISON_LSE = float("nan")
CPU_LANGUAGES = ("python",)  # the others compile for, and run on, a CUDA device


def require_fib(flag: str = "--fib-solution") -> ModuleType:
    """flashinfer_bench, imported; a one-line UsageError saying how to install it when it is missing."""
    try:
        import flashinfer_bench
    except ImportError as exc:
        raise UsageError(f"{flag} needs flashinfer-bench {FIB_VERSION}, which is not installed here "
                         f"({exception_line(exc, located=False)}): {INSTALL}") from None
    return flashinfer_bench


@dataclass
class FibSolution:
    """A solution with the definition it solves: flashinfer-bench's models, and what mla-verify read."""

    solution: Any  # flashinfer_bench.data.Solution
    definition: Any  # flashinfer_bench.data.Definition
    read: FibDefinition
    solution_path: Path
    definition_path: Path

    @property
    def language(self) -> str:
        return str(getattr(self.solution.spec.language, "value", self.solution.spec.language))

    @property
    def destination_passing(self) -> bool:
        return bool(self.solution.spec.destination_passing_style)

    @property
    def devices(self) -> tuple[str, ...]:
        return ("cpu", "cuda") if self.language in CPU_LANGUAGES else ("cuda",)


def load_solution(solution: str | Path, definition: str | Path | None = None,
                  dataset: str | Path | None = None) -> FibSolution:
    """The solution at ``solution`` with its definition: the file ``definition``, else the one named by the
    solution in the flashinfer-bench dataset ``dataset`` (its ``definitions/`` folder), else in the dataset the
    solution's file lies in (a folder above it with ``definitions/``). Every error is a one-line UsageError."""
    require_fib()
    from flashinfer_bench.data import Definition, Solution

    solution_path = Path(solution).expanduser().resolve()
    sol = _model(Solution, solution_path, "--fib-solution", "solution")
    if definition is not None:
        definition_path = Path(definition).expanduser().resolve()
        flag = "--fib-definition"
    else:
        definition_path = _find_definition(sol.definition, solution_path, dataset)
        flag = "--fib-dataset" if dataset is not None else "--fib-solution"
    defn = _model(Definition, definition_path, flag, "definition")
    if defn.name != sol.definition:
        raise UsageError(f"--fib-solution: solution {sol.name!r} solves definition {sol.definition!r}, but "
                         f"{definition_path} is {defn.name!r}")
    read = read_definition(json.loads(definition_path.read_text()), str(definition_path))
    return FibSolution(sol, defn, read, solution_path, definition_path)


def _model(cls: Any, path: Path, flag: str, what: str) -> Any:
    """flashinfer-bench's ``cls`` (Solution, Definition) read from ``path``, or a UsageError in one line."""
    from pydantic import ValidationError

    if not path.is_file():
        raise UsageError(f"{flag}: {what} file {path} " + ("is not a file" if path.exists() else "does not exist"))
    try:
        return cls.model_validate_json(path.read_text())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "(top level)"
        raise UsageError(f"{flag}: {path} is not a flashinfer-bench {what}: {where}: {first.get('msg')} "
                         f"({exc.error_count()} error(s))") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{flag}: cannot read {path}: {exc}") from None


def _find_definition(name: str, solution_path: Path, dataset: str | Path | None) -> Path:
    """The file of definition ``name`` under ``dataset``'s ``definitions/``, or under the first folder above the
    solution that has one."""
    if dataset is not None:
        root = Path(dataset).expanduser().resolve()
        if not (root / "definitions").is_dir():
            raise UsageError(f"--fib-dataset: {root} has no definitions/ folder (a flashinfer-bench dataset has "
                             "definitions/, solutions/, workloads/)")
        roots = [root]
    else:
        roots = [p for p in solution_path.parents if (p / "definitions").is_dir()][:1]
    for root in roots:
        for path in sorted((root / "definitions").rglob(f"{name}.json")):
            return path
    where = f"in {roots[0] / 'definitions'}" if roots else "in a dataset above the solution's file"
    raise UsageError(f"--fib-solution: definition {name!r} not found {where}; name its file with "
                     "--fib-definition DEFINITION.json or its dataset with --fib-dataset DIR")


class _Built:
    """The solution built once per process by flashinfer-bench's BuilderRegistry (which caches by the
    solution's hash), and its reference."""

    def __init__(self, fib: FibSolution) -> None:
        self.fib = fib
        self._runnable: Any = None

    def runnable(self) -> Any:
        if self._runnable is None:
            from flashinfer_bench.compile import BuilderRegistry, BuildError

            try:
                self._runnable = BuilderRegistry.get_instance().build(self.fib.definition, self.fib.solution)
            except BuildError as exc:
                raise UsageError(f"--fib-solution: flashinfer-bench could not build {self.fib.solution.name!r} "
                                 f"({self.fib.language}): {exception_line(exc, located=False)}") from None
        return self._runnable

    def call(self, args: list[Any], outputs: dict[str, torch.Tensor] | None) -> Any:
        """The evaluator's call: ``runnable(*inputs, *outputs)`` (destination passing) or ``runnable(*inputs)``."""
        with torch.no_grad():
            return self.runnable()(*args, *(outputs.values() if outputs is not None else ()))


def _returned(result: Any, outputs: tuple[str, ...]) -> dict[str, Any]:
    """A value-returning solution's result by output name (the evaluator's normalize_result, without its
    conversion of scalars: an output must be a tensor)."""
    values = list(result) if isinstance(result, (tuple, list)) else [result]
    if len(values) != len(outputs):
        raise TypeError(f"a value-returning solution must return ({', '.join(outputs)}), got "
                        f"{len(values)} value(s)")
    return dict(zip(outputs, values))


class FibSolutionBackend(Backend):
    """A flashinfer-bench solution as a backend of its definition's kind -- dense for an ``mla_paged`` decode
    definition, sparse for a ``dsa_paged`` one (its envelope says which) -- called as the evaluator calls it.
    Destination passing: the outputs are handed over poisoned (the harness fills ``output``, ``invoke`` the LSE)."""

    def __init__(self, fib: FibSolution) -> None:
        self.fib, self.read, self.built = fib, fib.read, _Built(fib)
        self.name = NAME_PREFIX + str(fib.solution.name)
        self.description = f"flashinfer-bench solution {fib.solution.name} ({fib.language}) of {fib.read.describe()}"
        self.source = {SOURCE_SOLUTION: str(fib.solution_path), SOURCE_DEFINITION: str(fib.definition_path)}
        self.envelope = fib.read.envelope(fib.devices, fib.destination_passing)

    def unavailable_reason(self, device: torch.device) -> str | None:
        reason = super().unavailable_reason(device)
        if reason is not None and self.fib.language not in CPU_LANGUAGES:
            return f"a {self.fib.language} solution {reason}"
        return reason

    def definition_inputs(self, problem: DecodeProblem | SparseDecodeProblem) -> dict[str, torch.Tensor | float]:
        """``problem`` as the definition's named inputs (what the solution is called with, a workload stores)."""
        if isinstance(problem, SparseDecodeProblem):
            return sparse_inputs(self.read, problem)
        return dense_inputs(self.read, problem)

    def prepare(self, problem: DecodeProblem | SparseDecodeProblem, layout: LayoutSpec) -> PreparedCall:
        # the output's rows: one per request (dense, one query token each), one per query token (sparse)
        B, Q = problem.batch, problem.q_len
        named = self.definition_inputs(problem)
        outputs = output_buffers(self.read, B * Q, problem.query.device) if self.fib.destination_passing else None

        def invoke() -> Any:
            if outputs is not None:
                outputs["lse"].fill_(POISON_LSE)
            return self.built.call(list(named.values()), outputs)

        def to_canonical(result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            got = outputs if outputs is not None else _returned(result, self.read.outputs)
            for what in self.read.outputs:
                if not isinstance(got[what], torch.Tensor):
                    raise TypeError(f"{what} is a {type(got[what]).__name__}, not a tensor")
            out, lse = got["output"].unflatten(0, (B, Q)), got["lse"].unflatten(0, (B, Q))
            return out, (lse if layout.return_lse else None)

        inputs = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
        # the definitions have no output scale: a dense problem's bmm2 is applied by the harness, in float64
        scale = problem.bmm2_scale if isinstance(problem, DecodeProblem) else 1.0
        return PreparedCall(invoke, inputs, None if outputs is None else outputs["output"], to_canonical,
                            output_scale=scale)


def fib_backend(solution: str | Path, definition: str | Path | None = None,
                dataset: str | Path | None = None) -> FibSolutionBackend:
    """The backend of a solution (``load_solution``). Nothing is built yet (``build``)."""
    return FibSolutionBackend(load_solution(solution, definition, dataset))


def build(backend: FibSolutionBackend) -> None:
    """Build the solution now (flashinfer-bench's builder), so that a solution that does not build is a usage
    error before the first case, not a failure of every case."""
    backend.built.runnable()


def loaded_backend(name: str, source: object = None) -> Backend:
    """The backend a run recorded (``name``, ``source``: Backend.source): the flashinfer-bench solution
    ``source`` records, else backends.named_backend's (a registered name or a ``--kernel`` callable). How a
    case worker and ``replay`` find the backend."""
    if isinstance(source, dict) and isinstance(source.get(SOURCE_SOLUTION), str):
        definition = source.get(SOURCE_DEFINITION)
        return fib_backend(source[SOURCE_SOLUTION], definition if isinstance(definition, str) else None)
    return named_backend(name, source)


def run_as_evaluator(backend: FibSolutionBackend, args: list[Any], trials: int = 3,
                     references: list[list[torch.Tensor]] | None = None
                     ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor] | Exception]]:
    """flashinfer-bench's evaluator on ``args`` (the definition's inputs, in order): the definition reference's
    outputs per trial (unless given as ``references``) and the solution's -- destination passing into
    ``torch.empty`` buffers (its allocate_outputs), else as returned (its normalize_result) -- as
    DefaultEvaluator.build_baseline and check_correctness make them (their loop is ours only because theirs
    synchronizes CUDA, which a CPU run has not). A trial whose call raises gives the exception in place of its
    outputs."""
    from flashinfer_bench.bench.evaluators.utils import allocate_outputs, normalize_result
    from flashinfer_bench.compile import BuilderRegistry

    fib = backend.fib
    device = next((str(a.device) for a in args if isinstance(a, torch.Tensor)), "cpu")
    if references is None:
        reference = BuilderRegistry.get_instance().build_reference(fib.definition)
        with torch.no_grad():
            references = [normalize_result(fib.definition, reference(*args), device) for _ in range(trials)]
    runnable = backend.built.runnable()
    solutions: list[list[torch.Tensor] | Exception] = []
    for _ in references:
        try:
            with torch.no_grad():
                if fib.destination_passing:
                    out = allocate_outputs(fib.definition, args, device)
                    runnable(*args, *out)
                else:
                    out = normalize_result(fib.definition, runnable(*args), device)
            solutions.append(out)
        except Exception as exc:  # noqa: BLE001 - the evaluator's RUNTIME_ERROR
            solutions.append(exc)
    return references, solutions
