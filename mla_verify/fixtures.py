"""Reproducer fixtures: one decode problem as ``<id>.safetensors`` (tensors) + ``<id>.json`` (everything else).

Never pickle: tensors go through safetensors (fp8 kept as float8_e4m3fn), metadata through JSON. The JSON
records the sha256 of the .safetensors file and of every tensor, and is written last (each file atomically,
temp + rename), so a missing JSON, a missing or truncated tensor file, a tampered tensor or a file that is
not safetensors at all (a pickle, a zip) is refused on load with one line.
"""
from __future__ import annotations

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

from .dims import MLADims
from .errors import FixtureError, MLAVerifyError, UsageError
from .generate import ProblemSpec
from .layouts import LayoutSpec
from .problem import DecodeProblem

FORMAT = "mla-verify-fixture"
FORMAT_VERSION = 1
PROBLEM_TENSORS = ("query", "kv_cache", "block_table", "seq_lens")
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
PICKLE_PROTOCOL_2_PLUS = b"\x80"
ZIP_MAGIC = b"PK"  # torch.save's archive, which holds a pickle


@dataclass
class Fixture:
    """A loaded fixture: the problem (on CPU), its metadata, and any further tensors (kernel output, ...)."""

    problem: DecodeProblem
    spec: ProblemSpec | None  # None for a problem that no spec generated
    layout: LayoutSpec
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    json_path: Path


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


def _tensor_record(t: torch.Tensor) -> dict[str, Any]:
    """What the JSON records of each tensor, and what loading checks it against: dtype, shape, sha256."""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": tensor_sha256(t)}


def save_fixture(directory: str | os.PathLike, fixture_id: str, problem: DecodeProblem, meta: dict[str, Any],
                 extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``<directory>/<fixture_id>.safetensors`` then ``.json``; returns the JSON path."""
    tensors = {name: getattr(problem, name) for name in PROBLEM_TENSORS}
    clash = set(tensors) & set(extra_tensors or {})
    if clash:
        raise ValueError(f"extra tensor names clash with the problem's: {sorted(clash)}")
    tensors.update(extra_tensors or {})
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    blob = st_save(tensors)
    tensors_path, json_path = fixture_paths(Path(directory) / fixture_id)
    record = {
        **meta,
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dims": problem.dims.__dict__,
        "bmm1_scale": problem.bmm1_scale,
        "bmm2_scale": problem.bmm2_scale,
        "max_seq_len": problem.max_seq_len,
        **({} if problem.window_left is None else {"window_left": problem.window_left}),
        "source_device": str(problem.device),
        "versions": library_versions(),
        "tensors_file": tensors_path.name,
        "tensors_sha256": hashlib.sha256(blob).hexdigest(),
        "tensors": {k: _tensor_record(v) for k, v in tensors.items()},
    }
    os.makedirs(directory, exist_ok=True)
    _atomic_write(tensors_path, blob)
    _atomic_write(json_path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    return json_path


def load_fixture(path: str | os.PathLike) -> Fixture:
    """Load and verify a fixture; any problem with it raises FixtureError (one line)."""
    tensors_path, json_path = fixture_paths(path)
    meta = _read_meta(json_path, tensors_path)
    try:
        data = tensors_path.read_bytes()
    except FileNotFoundError:
        raise FixtureError(f"{tensors_path}: missing (its JSON exists: a half-written or partly copied fixture)") from None
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
    try:
        problem = DecodeProblem(*(tensors.pop(n) for n in PROBLEM_TENSORS), MLADims(**meta["dims"]),
                                float(meta["bmm1_scale"]), float(meta["bmm2_scale"]), meta.get("max_seq_len"),
                                meta.get("window_left"))
        problem.validate()
        spec = ProblemSpec.from_json(meta["spec"]) if meta.get("spec") else None
        layout = LayoutSpec(**meta.get("layout", {}))
    except MLAVerifyError as e:
        raise FixtureError(f"{json_path}: invalid problem: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise FixtureError(f"{json_path}: malformed record ({type(e).__name__}: {e})") from None
    return Fixture(problem, spec, layout, meta, tensors, json_path)


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
    """Versions that can change a verdict: recorded in every fixture."""
    from . import __version__
    from .platform import flashinfer_version

    return {"python": python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "flashinfer": flashinfer_version(), "mla_verify": __version__}


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
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise FixtureError(f"{json_path}: not an mla-verify fixture (no \"format\": \"{FORMAT}\")")
    if meta.get("format_version") != FORMAT_VERSION:
        raise FixtureError(f"{json_path}: fixture format version {meta.get('format_version')!r}; "
                           f"this mla-verify reads version {FORMAT_VERSION}")
    return meta


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
    missing = [n for n in PROBLEM_TENSORS if n not in tensors]
    if missing:
        raise FixtureError(f"{path}: lacks problem tensor(s) {missing}")
    for name, t in tensors.items():
        want = recorded[name]
        got = _tensor_record(t)
        if got != {k: want.get(k) for k in got}:
            raise FixtureError(f"{path}: tensor {name!r} does not match its recorded dtype/shape/sha256: refused")


def _atomic_write(path: Path, data: bytes) -> None:
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
