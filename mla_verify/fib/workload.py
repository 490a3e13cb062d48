"""A failing case as a flashinfer-bench workload, so it can join a dataset and its evaluator can run on it.

The workload is written through flashinfer-bench's TraceSet API into a dataset folder (its layout:
``definitions/<op_type>/<name>.json``, ``workloads/<op_type>/<name>.jsonl``, ``blob/workloads/<op_type>/<name>/``):
every tensor input in one safetensors blob, ``sm_scale`` as a scalar, the variable axes as flashinfer-bench
computes them from the inputs, one JSON line appended per workload. Its uuid is ``mla-verify-<case id>``, so
the same case is exported once. ``load_workload_inputs`` reads it back the way the evaluator does
(``load_safetensors`` and ``gen_inputs`` on a TraceSet loaded from the folder): what a round trip gives is what
flashinfer-bench would run.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.errors import UsageError

UUID_PREFIX = "mla-verify-"


@dataclass(frozen=True)
class ExportedWorkload:
    root: Path  # the dataset folder
    definition: str
    uuid: str
    jsonl: Path  # the workload's line is in this file
    blob: Path  # its tensors
    added: bool  # False when the dataset held it already

    def describe(self) -> str:
        return (f"{self.jsonl} (uuid {self.uuid}, tensors in {self.blob.relative_to(self.root)}"
                f"{', already there' if not self.added else ''})")


def export_workload(root: Path, definition_path: Path, case_id: str,
                    inputs: dict[str, torch.Tensor | float]) -> ExportedWorkload:
    """Add the workload of ``inputs`` (the definition's named inputs) to the dataset at ``root``, creating it
    (and copying the definition into it) as needed."""
    from flashinfer_bench.data import Definition, SafetensorsInput, ScalarInput, Trace, TraceSet, Workload

    definition = Definition.model_validate_json(definition_path.read_text())
    target = root / "definitions" / definition.op_type / f"{definition.name}.json"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(definition_path, target)
    elif json.loads(target.read_text()) != json.loads(definition_path.read_text()):
        raise UsageError(f"{target} is another definition named {definition.name!r} than {definition_path}: "
                         "export into another folder")
    traces = TraceSet(root=root, definitions={definition.name: definition})
    uuid = UUID_PREFIX + case_id
    jsonl = traces.workloads_path / definition.op_type / f"{definition.name}.jsonl"
    blob = traces.blob_workloads_path / definition.op_type / definition.name / f"{definition.name}_{uuid}.safetensors"
    if jsonl.exists() and any(json.loads(line)["workload"]["uuid"] == uuid
                              for line in jsonl.read_text().splitlines() if line.strip()):
        return ExportedWorkload(root, definition.name, uuid, jsonl, blob, added=False)
    blob.unlink(missing_ok=True)  # a blob left by an export that stopped before its line: written again
    tensors = {k: v.detach().cpu().contiguous() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    path = traces.add_workload_blob_tensor(definition.name, uuid, tensors)
    specs: dict[str, Any] = {k: SafetensorsInput(path=path, tensor_key=k) for k in tensors}
    specs.update({k: ScalarInput(value=v) for k, v in inputs.items() if not isinstance(v, torch.Tensor)})
    axes = definition.get_axes_values_from_inputs(list(inputs.values()))
    traces.add_workload_traces([Trace(definition=definition.name, workload=Workload(axes=axes, inputs=specs,
                                                                                    uuid=uuid))])
    return ExportedWorkload(root, definition.name, uuid, jsonl, blob, added=True)


def load_workload_inputs(root: Path, definition: str, uuid: str, device: str = "cpu") -> tuple[Any, list[Any]]:
    """(flashinfer-bench's Definition, the workload's inputs in the definition's order) as its evaluator loads
    them from the dataset at ``root``; a UsageError when the dataset has no such workload."""
    from flashinfer_bench.bench.utils import gen_inputs, load_safetensors
    from flashinfer_bench.data import TraceSet

    traces = TraceSet.from_path(str(root))
    found = [t.workload for t in traces.workloads.get(definition, []) if t.workload.uuid == uuid]
    if definition not in traces.definitions or not found:
        raise UsageError(f"{root}: no workload {uuid} of definition {definition!r}")
    defn = traces.definitions[definition]
    blobs = load_safetensors(defn, found[0], traces.root)
    return defn, gen_inputs(defn, found[0], device, safe_tensors=blobs)
