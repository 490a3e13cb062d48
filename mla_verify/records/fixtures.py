"""Reproducer fixtures: one decode case as ``<id>.json`` (everything but tensors) and ``<id>.safetensors``.

Never pickle: tensors go through safetensors (fp8 kept as float8_e4m3fn), metadata through JSON. The JSON
records the dtype, shape and sha256 of every tensor, and is written last (each file atomically, temp +
rename), so a missing JSON, a missing or truncated tensor file, a tampered tensor or a file that is not
safetensors at all (a pickle, a zip) is refused on load with one line.

A problem drawn from a spec is rebuilt bit for bit from it on the same device type (``build_problem`` is
deterministic there), so a regression fixture (``write_reproducer``) keeps the spec, the layout and a summary
of the kernel's output, and stores tensors only where they cannot be rebuilt, within a size cap. A case record
(``write_case_record``: a crash's reproducer, or the case in flight written before its kernel is called) is
the JSON alone, with no records of the problem's tensors to check a rebuilt one against. Version 1
fixtures (every one holding its problem's tensors, e.g. fixtures/golden) load as before.

One format serves every problem kind (mla_verify/kinds): ``problem_kind`` names the kind whose spec ``spec`` is
(absent: dense). A case of another kind than dense is recorded by its spec alone (``write_case_record``, with the
kernel's output summarised): its spec rebuilds its problem bit for bit on the same device type. The sparse
reproducers of earlier versions (``"kind": "sparse-regression"``) are read as such records.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from platform import python_version
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..core.bits import same_bits
from ..core.dims import MLADims
from ..core.errors import FixtureError, MLAVerifyError, UsageError
from ..kinds import ProblemKind, kind_named, kind_of
from ..problems.envelope import DENSE, SPARSE
from ..problems.generate import ProblemSpec, build_problem
from ..problems.layouts import LayoutSpec
from ..problems.problem import DecodeProblem
from ..problems.sparse import SPARSE_LAYOUT

FORMAT = "mla-verify-fixture"
FORMAT_VERSION = 2  # 2: the problem's tensors may be left out (rebuilt from the spec); 1: always stored
READABLE_VERSIONS = (1, 2)
PROBLEM_TENSORS = ("query", "kv_cache", "block_table", "seq_lens")
KERNEL_TENSORS = {"out": "kernel_out", "lse": "kernel_lse"}  # what a reproducer stores of the kernel, if it fits
DEFAULT_MAX_REPRODUCER_MIB = 16  # a reproducer's files; a 131072-token problem alone is ~150 MiB
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
LEGACY_SPARSE = "sparse-regression"  # the ``kind`` of a sparse reproducer written before one format served all
PICKLE_PROTOCOL_2_PLUS = b"\x80"
ZIP_MAGIC = b"PK"  # torch.save's archive, which holds a pickle


@dataclass
class Fixture:
    """A loaded fixture: the problem (on CPU) or the spec that rebuilds it, its metadata, and any further
    tensors it stored (kernel output, reference answers)."""

    problem: DecodeProblem | None  # None: not stored, ``problem_on`` rebuilds it from ``spec``
    spec: Any  # its kind's spec (ProblemSpec, SparseSpec); None for a problem that no spec generated
    layout: LayoutSpec
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    json_path: Path

    @property
    def kind(self) -> ProblemKind:
        return kind_named(self.meta.get("problem_kind", DENSE))

    def problem_on(self, device: torch.device | str) -> tuple[Any, bool | None]:
        """(the case's problem on ``device``, whether it has the recorded bits). A stored problem is moved
        there (True). A spec-only one is rebuilt there: True or False on the device type it was recorded on,
        None on another (each device type draws its own values from a seed)."""
        device = torch.device(device)
        if self.problem is not None:
            return self.problem.to(device), True
        assert self.spec is not None  # load_fixture refuses a fixture with neither
        problem = self.kind.build(self.spec, device)
        if str(self.meta.get("source_device", "cpu")).split(":")[0] != device.type:
            return problem, None
        recorded = self.meta["problem_tensors"]
        if recorded is None:  # a case record: nothing to check the rebuilt problem against
            return problem, None
        return problem, all(tensor_record(getattr(problem, n)) == recorded[n] for n in PROBLEM_TENSORS)


@dataclass(frozen=True)
class Reproducer:
    """What ``write_reproducer`` wrote (``path`` None: nothing, and ``reason`` says why)."""

    path: Path | None
    bytes: int = 0  # the fixture's two files together
    problem_stored: bool = False  # False: rebuilt from the spec on replay
    stored: tuple[str, ...] = ()  # the tensors in the .safetensors file
    reason: str = ""


def fixture_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """(tensors, json) for a fixture named by its .json, its .safetensors or their common stem."""
    p = Path(path)
    if p.suffix in (".json", ".safetensors"):
        p = p.with_suffix("")
    return p.with_name(p.name + ".safetensors"), p.with_name(p.name + ".json")


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in row-major order (dtype and shape are recorded beside it)."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def tensor_record(t: torch.Tensor) -> dict[str, Any]:
    """What the JSON records of each tensor, and what loading checks it against: dtype, shape, sha256."""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": tensor_sha256(t)}


def tensor_summary(t: torch.Tensor) -> dict[str, Any]:
    """``tensor_record`` plus what a reader of the JSON wants to know of a tensor it does not hold."""
    x = t.detach()
    finite = x[torch.isfinite(x)]
    stats: dict[str, Any] = {"finite": finite.numel(), "nan": int(torch.isnan(x).sum()),
                             "inf": int(torch.isinf(x).sum())}
    if finite.numel():  # the mean summed in float64 without a float64 copy of the tensor
        stats.update(min=float(finite.min()), max=float(finite.max()),
                     mean=float(finite.sum(dtype=torch.float64)) / finite.numel())
    return {**tensor_record(t), **stats}


def save_fixture(directory: str | os.PathLike, fixture_id: str, problem: DecodeProblem, meta: dict[str, Any],
                 extra_tensors: dict[str, torch.Tensor] | None = None, store_problem: bool = True) -> Path:
    """Write ``<directory>/<fixture_id>.safetensors`` (when there is a tensor to store) then ``.json``; returns
    the JSON path. With ``store_problem=False`` the problem's tensors are left out -- ``meta["spec"]`` must
    rebuild them -- and only their records are kept, to check the rebuilt problem against."""
    blob, record = _encode(fixture_id, problem, meta, extra_tensors or {}, store_problem)
    return _write(Path(directory), fixture_id, blob, record)


def _encode(fixture_id: str, problem: DecodeProblem, meta: dict[str, Any], extra: dict[str, torch.Tensor],
            store_problem: bool) -> tuple[bytes | None, dict[str, Any]]:
    """(the tensor file's bytes or None, the JSON record) of a fixture."""
    if not store_problem and not meta.get("spec"):
        raise ValueError("a fixture without its problem's tensors needs the spec that rebuilds them")
    problem_tensors = {name: getattr(problem, name) for name in PROBLEM_TENSORS}
    clash = set(problem_tensors) & set(extra)
    if clash:
        raise ValueError(f"extra tensor names clash with the problem's: {sorted(clash)}")
    tensors = {**(problem_tensors if store_problem else {}), **extra}
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    blob = st_save(tensors) if tensors else None
    record = {
        **meta,
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dims": problem.dims.__dict__,
        "bmm1_scale": problem.bmm1_scale,
        "bmm2_scale": problem.bmm2_scale,
        "max_seq_len": problem.max_seq_len,
        **({} if problem.window_left is None else {"window_left": problem.window_left}),
        **({} if problem.q_lens is None else {"q_lens": list(problem.q_lens)}),
        "source_device": str(problem.device),
        # CPU sums split over threads: a replay needs the same count to reproduce the output bit for bit
        **({"torch_threads": torch.get_num_threads()} if problem.device.type == "cpu" else {}),
        "versions": library_versions(),
        "problem_stored": store_problem,
        "problem_tensors": {k: tensor_record(v) for k, v in problem_tensors.items()},
        "tensors_file": None if blob is None else fixture_paths(fixture_id)[0].name,
        "tensors_sha256": None if blob is None else hashlib.sha256(blob).hexdigest(),
        "tensors": {k: tensor_record(v) for k, v in tensors.items()},
    }
    return blob, record


def _json_bytes(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, indent=1, sort_keys=True) + "\n").encode()


def _write(directory: Path, fixture_id: str, blob: bytes | None, record: dict[str, Any]) -> Path:
    tensors_path, json_path = fixture_paths(directory / fixture_id)
    os.makedirs(directory, exist_ok=True)
    if blob is not None:
        atomic_write(tensors_path, blob)
    elif tensors_path.exists():  # a stale pair from an earlier run must not pass for this fixture's tensors
        tensors_path.unlink()
    atomic_write(json_path, _json_bytes(record))
    return json_path


def write_reproducer(directory: str | os.PathLike, fixture_id: str, problem: DecodeProblem,
                     spec: ProblemSpec | None, meta: dict[str, Any], out: torch.Tensor | None,
                     lse: torch.Tensor | None, max_bytes: int) -> Reproducer:
    """A failing case as a fixture of at most ``max_bytes`` (both files). The problem is stored only if ``spec``
    does not rebuild it bit for bit, and then it must fit, or nothing is written; the kernel's output and LSE
    are summarised in the JSON and stored only if they fit too. A fixture whose spec rebuilds its problem is
    always written: its JSON alone (a few kB) is the least a reproducer can be."""
    rebuilt = spec is not None and _rebuilds(spec, problem)
    kernel = {KERNEL_TENSORS[k]: t for k, t in (("lse", lse), ("out", out)) if t is not None}
    meta = {**meta, "kernel_output": {k: None if t is None else tensor_summary(t)
                                      for k, t in (("out", out), ("lse", lse))}}
    # the most that fits: both kernel tensors, then the smaller LSE alone, then none
    for keep in (kernel, dict(list(kernel.items())[:1]), {}):
        blob, record = _encode(fixture_id, problem, meta, keep, store_problem=not rebuilt)
        size = len(blob or b"") + len(_json_bytes(record))
        if size <= max_bytes or rebuilt and not keep:
            path = _write(Path(directory), fixture_id, blob, record)
            return Reproducer(path, size, not rebuilt, tuple(record["tensors"]))
    need = sum(getattr(problem, n).nbytes for n in PROBLEM_TENSORS)
    why = "no spec rebuilds its problem" if spec is None else "its spec does not rebuild its problem bit for bit"
    return Reproducer(None, reason=f"{why}, and the problem's {need / 2**20:.1f} MiB of tensors exceed the cap "
                                   f"of {max_bytes / 2**20:g} MiB (--max-reproducer-mib)")


def write_case_record(directory: str | os.PathLike, fixture_id: str, spec: Any, device: torch.device,
                      meta: dict[str, Any], durable: bool = True) -> Path:
    """A case as a JSON-only fixture that its spec rebuilds, written without building its problem: the
    reproducer of a kernel that crashed (its device may be unusable), or the record of the case about to run
    (``durable=False``: written over in place, overwrite_in_place)."""
    record = {**meta, "spec": spec.to_json(), "problem_kind": kind_of(spec).name, "format": FORMAT,
              "format_version": FORMAT_VERSION,
              "source_device": str(device),
              **({"torch_threads": torch.get_num_threads()} if device.type == "cpu" else {}),
              "versions": library_versions(), "problem_stored": False, "problem_tensors": None,
              "tensors_file": None, "tensors_sha256": None, "tensors": {}}
    if durable:
        return _write(Path(directory), fixture_id, None, record)
    os.makedirs(directory, exist_ok=True)
    path = fixture_paths(Path(directory) / fixture_id)[1]
    overwrite_in_place(path, _json_bytes(record))
    return path


def _rebuilds(spec: ProblemSpec, problem: DecodeProblem) -> bool:
    """Whether ``build_problem(spec)`` on the problem's device gives exactly this problem."""
    try:
        again = build_problem(spec, problem.device)
    except MLAVerifyError:
        return False
    same_scalars = (again.dims, again.bmm1_scale, again.bmm2_scale, again.max_seq_len, again.window_left,
                    again.q_lens) == (problem.dims, problem.bmm1_scale, problem.bmm2_scale, problem.max_seq_len,
                                      problem.window_left, problem.q_lens)
    return same_scalars and all(same_bits(getattr(again, n), getattr(problem, n)) for n in PROBLEM_TENSORS)


def kernel_output_records(fx: Fixture) -> dict[str, dict[str, Any]]:
    """The recorded kernel output's records (dtype, shape, sha256) by name ("out", "lse"): from the summary a
    version 2 reproducer keeps, or from the tensors a version 1 one stored."""
    summary = fx.meta.get("kernel_output") or {}
    records = {k: {f: v[f] for f in ("dtype", "shape", "sha256")} for k, v in summary.items() if v}
    for k, name in KERNEL_TENSORS.items():
        if k not in records and name in fx.tensors:
            records[k] = tensor_record(fx.tensors[name])
    return records


def load_fixture(path: str | os.PathLike) -> Fixture:
    """Load and verify a fixture; any problem with it raises FixtureError (one line)."""
    tensors_path, json_path = fixture_paths(path)
    meta = _read_meta(json_path, tensors_path)
    _check_case_fields(json_path, meta)
    stored = meta.get("problem_stored", True)  # version 1 always stored it
    if meta.get("tensors_file", True):  # version 1 always had one
        tensors = _read_tensors(tensors_path, json_path, meta)
    elif meta.get("tensors"):
        raise FixtureError(f"{json_path}: records tensors {sorted(meta['tensors'])} but no file holding them")
    else:
        tensors = {}
    missing = [n for n in PROBLEM_TENSORS if n not in tensors]
    if stored and missing:
        raise FixtureError(f"{tensors_path}: lacks problem tensor(s) {missing}")
    try:
        kind = kind_named(meta.get("problem_kind", DENSE))
        spec = kind.spec_from_json(meta["spec"]) if meta.get("spec") else None
        layout = LayoutSpec(**meta.get("layout", {}))
        problem = None
        if stored:
            query, kv_cache, block_table, seq_lens = (tensors.pop(n) for n in PROBLEM_TENSORS)
            problem = DecodeProblem(query, kv_cache, block_table, seq_lens, MLADims(**meta["dims"]),
                                    float(meta["bmm1_scale"]), float(meta["bmm2_scale"]), meta.get("max_seq_len"),
                                    meta.get("window_left"),
                                    None if meta.get("q_lens") is None else tuple(meta["q_lens"]))
            problem.validate()
        elif spec is None or not _problem_records_ok(meta):
            raise FixtureError(f"{json_path}: stores no problem, and no spec with its problem's records to "
                               "rebuild it from")
    except MLAVerifyError as e:
        if isinstance(e, FixtureError):
            raise
        raise FixtureError(f"{json_path}: invalid problem or spec: {e}") from None
    except (KeyError, TypeError, ValueError) as e:  # a field missing or mistyped, or an unknown problem_kind
        raise FixtureError(f"{json_path}: malformed record ({type(e).__name__}: {e})") from None
    return Fixture(problem, spec, layout, meta, tensors, json_path)


def _problem_records_ok(meta: dict[str, Any]) -> bool:
    """A fixture without its problem records the problem's tensors (to check a rebuilt one), or records None
    for them (a case record, write_case_record)."""
    if "problem_tensors" not in meta:
        return False
    records = meta["problem_tensors"]
    return records is None or isinstance(records, dict) and set(records) == set(PROBLEM_TENSORS)


def _check_case_fields(json_path: Path, meta: dict[str, Any]) -> None:
    """The fields replay reads besides the problem: a wrong type is one FixtureError, not a crash later."""
    try:
        relations = ["none", *kind_named(meta.get("problem_kind", DENSE)).relations]
    except ValueError as e:
        raise FixtureError(f"{json_path}: {e}") from None
    if meta.get("metamorphic", "none") not in relations:
        raise FixtureError(f"{json_path}: metamorphic {meta['metamorphic']!r} is not one of {relations}")
    if not isinstance(meta.get("backend", ""), str):
        raise FixtureError(f"{json_path}: backend {meta['backend']!r} is not a name")
    threads = meta.get("torch_threads", 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise FixtureError(f"{json_path}: torch_threads {threads!r} is not a thread count (an integer >= 1)")
    summary = meta.get("kernel_output") or {}
    if not isinstance(summary, dict) or not all(
            v is None or (isinstance(v, dict) and {"dtype", "shape", "sha256"} <= set(v)) for v in summary.values()):
        raise FixtureError(f"{json_path}: kernel_output is not a record of dtype, shape and sha256 per tensor")


def _read_tensors(tensors_path: Path, json_path: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The fixture's tensor file, checked against the hashes its JSON recorded."""
    try:
        data = tensors_path.read_bytes()
    except FileNotFoundError:
        raise FixtureError(f"{tensors_path}: missing (its JSON exists: a half-written or partly copied "
                           "fixture)") from None
    except OSError as e:
        raise FixtureError(f"{tensors_path}: cannot read: {e.strerror}") from None
    _check_safetensors_framing(tensors_path, data)
    if hashlib.sha256(data).hexdigest() != meta.get("tensors_sha256"):
        raise FixtureError(f"{tensors_path}: sha256 does not match the one recorded in {json_path.name} "
                           "(modified, truncated or swapped): refused")
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors raises its own error types; any of them means unreadable
        raise FixtureError(f"{tensors_path}: not a readable safetensors file: {e}") from None
    _check_tensors(tensors_path, tensors, meta.get("tensors"))
    return tensors


def check_writable_dir(directory: Path, what: str) -> None:
    """Raise UsageError unless files can be created in ``directory`` (or, if it does not exist yet, in the
    nearest existing directory above it, where it will be created). Probes with a real file: permission
    bits say nothing to root or on a read-only mount."""
    target = directory
    while not target.exists():
        target = target.parent
    if not target.is_dir():
        raise UsageError(f"{what}: {target} is not a directory")
    probe = target / f".mla-verify-write-test-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{what}: cannot write in {target}: {e.strerror}") from None


def library_versions() -> dict[str, str | None]:
    """Versions that can change a verdict: recorded in every fixture (looked up once a process: the record of
    each case in flight has them too)."""
    return dict(_versions())


@functools.cache
def _versions() -> tuple[tuple[str, str | None], ...]:
    from ..core.platform import VERSION as __version__
    from ..core.platform import flashinfer_version

    return (("python", python_version()), ("torch", torch.__version__), ("cuda", torch.version.cuda),
            ("flashinfer", flashinfer_version()), ("mla_verify", __version__))


def _read_meta(json_path: Path, tensors_path: Path) -> dict[str, Any]:
    try:
        text = json_path.read_bytes()
    except FileNotFoundError:
        if tensors_path.exists():
            raise FixtureError(f"{json_path}: missing while {tensors_path.name} exists "
                               "(a half-written fixture: its JSON is written last)") from None
        raise FixtureError(f"{json_path}: no such fixture") from None
    except OSError as e:
        raise FixtureError(f"{json_path}: cannot read: {e.strerror}") from None
    if _is_pickle_or_zip(text):
        raise FixtureError(f"{json_path}: is a pickle or zip archive, not JSON: refused (fixtures are never unpickled)")
    try:
        meta = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FixtureError(f"{json_path}: not valid JSON ({e.__class__.__name__}: truncated or garbage)") from None
    if isinstance(meta, dict) and meta.get("kind") == LEGACY_SPARSE and "format" not in meta:
        meta = _from_legacy_sparse(meta)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise FixtureError(f"{json_path}: not an mla-verify fixture (no \"format\": \"{FORMAT}\")")
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise FixtureError(f"{json_path}: fixture format version {meta.get('format_version')!r}; "
                           f"this mla-verify reads versions {', '.join(map(str, READABLE_VERSIONS))}")
    return meta


def _from_legacy_sparse(meta: dict[str, Any]) -> dict[str, Any]:
    """A sparse reproducer of an earlier version as the case record it is: its spec, rebuilt on replay."""
    return {**meta, "kind": "regression", "problem_kind": SPARSE, "format": FORMAT, "format_version": FORMAT_VERSION,
            "layout": SPARSE_LAYOUT.to_json(), "metamorphic": "none", "problem_stored": False,
            "problem_tensors": None, "tensors_file": None, "tensors_sha256": None, "tensors": {}}


def _is_pickle_or_zip(data: bytes) -> bool:
    """Whether ``data`` starts like a pickle (protocol 2+) or a zip (torch.save's archive): refused, never parsed."""
    return data[:1] == PICKLE_PROTOCOL_2_PLUS or data[:2] == ZIP_MAGIC


def _check_safetensors_framing(path: Path, data: bytes) -> None:
    """Refuse anything that is not a safetensors file before any parser sees it."""
    if _is_pickle_or_zip(data):
        raise FixtureError(f"{path}: is a pickle or zip archive (torch.save?), not safetensors: refused")
    if len(data) < 8:
        raise FixtureError(f"{path}: {len(data)} bytes: truncated or not a safetensors file")
    n = int.from_bytes(data[:8], "little")
    if n > min(MAX_HEADER_BYTES, len(data) - 8) or data[8:9] != b"{":
        raise FixtureError(f"{path}: not a safetensors file (bad header), or truncated")


def _check_tensors(path: Path, tensors: dict[str, torch.Tensor], recorded: Any) -> None:
    if not isinstance(recorded, dict) or set(recorded) != set(tensors):
        raise FixtureError(f"{path}: tensors {sorted(tensors)} differ from those recorded in the JSON")
    for name, t in tensors.items():
        want = recorded[name]
        got = tensor_record(t)
        if got != {k: want.get(k) for k in got}:
            raise FixtureError(f"{path}: tensor {name!r} does not match its recorded dtype/shape/sha256: refused")


def overwrite_in_place(path: Path, data: bytes) -> None:
    """``data`` written over ``path`` in place, then cut to its length: neither renamed, nor synced, nor
    truncated to zero first, each of which makes ext4 flush the file (milliseconds per case in flight,
    against microseconds). The record is whole before the kernel is called, and a crash of the process
    loses nothing already written; only a crash of the machine could leave it partial."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666), "wb") as f:  # an fd: open() would truncate it
        f.write(data)
        f.truncate()


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies, unlike mkstemp's 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
