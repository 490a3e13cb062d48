"""flashinfer-bench definitions of MLA decode: what one says, the envelope it fixes, and its layout of a problem.

A definition (flashinfer-bench's ``Definition`` JSON) names a kernel's inputs and outputs and fixes some axes.
Two kinds are read here (docs/flashinfer-bench.md):

- ``mla_paged`` decode (e.g. ``mla_paged_decode_h16_ckv512_kpe64_ps64``): inputs ``q_nope`` [B, H, ckv],
  ``q_pe`` [B, H, kpe], ``ckv_cache`` [P, page, ckv], ``kpe_cache`` [P, page, kpe], ``kv_indptr`` [B+1] and
  ``kv_indices`` (the CSR page lists), ``kv_last_page_len`` [B] (only where the page size is above 1: at page
  size 1 a sequence is as long as its page list) and the scalar ``sm_scale``; outputs ``output`` [B, H, ckv]
  bf16 and ``lse`` [B, H] fp32 in base 2. One query token per request, no output scale.
- ``dsa_paged`` sparse attention (``dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64``): ``q_nope``/``q_pe``
  per query token [T, H, .], the caches as above, ``sparse_indices`` [T, topk] int32 slots (page * page_size +
  offset, -1 masked) and ``sm_scale``; the same two outputs, one row per query token.

Its constant axes (heads, ckv/kpe widths, page size, topk) become an envelope: the problems drawn are the
definition's problems. The layouts below give a canonical problem as the definition's named inputs.

Conventions that differ from the canonical problem's, and how they are handled:
- a request's output is not scaled (the definition has no bmm2): the harness applies a drawn bmm2 to the
  output itself, in float64 (``PreparedCall.output_scale``), as for FlashInfer's wrapper;
- the sparse LSE of a row with no valid entry is -inf in the definition's reference, +inf in FlashMLA's
  convention (the canonical sparse problem's): the envelope says which (``SparseEnvelope.empty_lse``), and such
  a row is judged by it; flashinfer-bench's own evaluator fails any non-finite LSE, the reference's too
  (docs/flashinfer-bench.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import UsageError
from ..problems.envelope import DENSE, LSE_BASE_2, SPARSE, Envelope, SparseEnvelope
from ..problems.layouts import csr_metadata
from ..problems.problem import DecodeProblem
from ..problems.sparse import D_V, UNPACKED, SparseDecodeProblem

# the inputs and outputs each kind's definitions have, in the definitions' order
DENSE_INPUTS = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "kv_indptr", "kv_indices", "kv_last_page_len",
                "sm_scale")
SPARSE_INPUTS = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "sparse_indices", "sm_scale")
OUTPUTS = ("output", "lse")
_CONST_AXES = {DENSE: ("num_qo_heads", "head_dim_ckv", "head_dim_kpe", "page_size"),
               SPARSE: ("num_qo_heads", "head_dim_ckv", "head_dim_kpe", "page_size", "topk")}
_DTYPES = {"q_nope": "bfloat16", "q_pe": "bfloat16", "ckv_cache": "bfloat16", "kpe_cache": "bfloat16",
           "kv_indptr": "int32", "kv_indices": "int32", "kv_last_page_len": "int32", "sparse_indices": "int32",
           "sm_scale": "float32", "output": "bfloat16", "lse": "float32"}
# a solution JSON has nowhere to claim bit-level invariance (a user kernel's mla_verify_envelope): its metamorphic
# relations are judged within tolerance, as an unclaiming user kernel's; the repeat call stays bit for bit
NO_BIT_CLAIMS: tuple[str, ...] = ()
SPARSE_ROPE = 64  # a bf16 sparse problem's rows: D_V latent values, then these rope ones (problems/sparse.py)
READ = ("mla_paged decode definitions (inputs q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, "
        "[kv_last_page_len,] sm_scale) and dsa_paged sparse attention ones (q_nope, q_pe, ckv_cache, kpe_cache, "
        "sparse_indices, sm_scale), each with outputs output and lse")


@dataclass(frozen=True)
class FibDefinition:
    """What mla-verify reads from a flashinfer-bench definition."""

    name: str
    op_type: str
    kind: str  # DENSE or SPARSE
    heads: int
    kv_lora_rank: int  # head_dim_ckv
    rope: int  # head_dim_kpe
    page_size: int
    topk: int | None  # sparse only
    inputs: tuple[str, ...]  # in the definition's order: the order a solution's run takes them
    outputs: tuple[str, ...]

    def describe(self) -> str:
        topk = f" topk={self.topk}" if self.topk is not None else ""
        return (f"{self.name} ({self.op_type}, {self.kind}: H={self.heads} ckv={self.kv_lora_rank} "
                f"kpe={self.rope} page={self.page_size}{topk})")

    def envelope(self, devices: tuple[str, ...], pass_out: bool) -> Envelope | SparseEnvelope:
        """The problems this definition takes, of its kind: an ``Envelope`` (dense) or a ``SparseEnvelope``.
        ``pass_out``: whether the solution is given its outputs (destination passing) or returns them."""
        return self._dense(devices, pass_out) if self.kind == DENSE else self._sparse(devices, pass_out)

    def _dense(self, devices: tuple[str, ...], pass_out: bool) -> Envelope:
        """Its heads, dims and page size, bf16, one query token, 3-D caches handed over contiguous (the
        definition's ckv and kpe caches are tensors of their own) and the table as CSR page lists (no width to
        vary)."""
        return Envelope(devices=devices, page_sizes=(self.page_size,), dims=((self.kv_lora_rank, self.rope),),
                        heads=(self.heads,), max_heads=self.heads, dtypes=("bf16",), q_len=(1, 1), cache_dims=(3,),
                        page_strided=False, table_widths=("native",), pass_out=(pass_out,), lse=True,
                        lse_base=LSE_BASE_2, bit_invariant=NO_BIT_CLAIMS,
                        notes=f"flashinfer-bench definition {self.name}")

    def _sparse(self, devices: tuple[str, ...], pass_out: bool) -> SparseEnvelope:
        """bf16 rows, its heads, topk and page size, no sink, no topk_length, LSE in base 2; one or two query
        tokens per request (the definition's rows are query tokens, whichever request they come from)."""
        assert self.topk is not None  # a sparse definition has one (read_definition)
        return SparseEnvelope(devices=devices, formats=(UNPACKED,), scales=("pow2",), topk_multiple=self.topk,
                              max_topk=self.topk, heads=(self.heads,), max_heads=self.heads, q_len=(1, 2),
                              page_sizes=(self.page_size,), topk_length_formats=(), sinks=False,
                              pass_out=(pass_out,), lse_base=LSE_BASE_2, bit_invariant=NO_BIT_CLAIMS,
                              empty_lse=-math.inf,  # its reference's: the log of an empty sum
                              notes=f"flashinfer-bench definition {self.name}")


def read_definition(data: Any, where: str) -> FibDefinition:
    """The definition a flashinfer-bench definition JSON (parsed) describes; a UsageError naming ``where`` and
    what is off when it is not one mla-verify reads."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: not a flashinfer-bench definition (a JSON object), got {type(data).__name__}")
    name, op_type = data.get("name"), data.get("op_type")
    inputs = tuple(data.get("inputs") or ())
    outputs = tuple(data.get("outputs") or ())
    if set(inputs) == set(SPARSE_INPUTS):
        kind = SPARSE
    elif set(inputs) in (set(DENSE_INPUTS), set(DENSE_INPUTS) - {"kv_last_page_len"}):
        kind = DENSE
    else:
        raise UsageError(f"{where}: definition {name!r} ({op_type}) has inputs {list(inputs)}; mla-verify reads "
                         f"{READ}")
    if set(outputs) != set(OUTPUTS):
        raise UsageError(f"{where}: definition {name!r} has outputs {list(outputs)}; expected {list(OUTPUTS)}")
    axes = data.get("axes") or {}
    const = {}
    for axis in _CONST_AXES[kind]:
        spec = axes.get(axis)
        if not (isinstance(spec, dict) and spec.get("type") == "const" and isinstance(spec.get("value"), int)
                and spec["value"] >= 1):
            raise UsageError(f"{where}: definition {name!r}: axis {axis!r} must be a constant >= 1 "
                             f"(got {spec!r}); mla-verify draws every other axis itself")
        const[axis] = spec["value"]
    specs = {**data.get("inputs", {}), **data.get("outputs", {})}
    for tensor, want in _DTYPES.items():
        if tensor in specs and (specs[tensor] or {}).get("dtype") != want:
            raise UsageError(f"{where}: definition {name!r}: {tensor} is {(specs[tensor] or {}).get('dtype')}, "
                             f"mla-verify reads it as {want}")
    if kind == DENSE and const["page_size"] > 1 and "kv_last_page_len" not in inputs:
        raise UsageError(f"{where}: definition {name!r} has pages of {const['page_size']} tokens but no "
                         "kv_last_page_len: its sequences' lengths cannot be told")
    if kind == SPARSE and (const["head_dim_ckv"], const["head_dim_kpe"]) != (D_V, SPARSE_ROPE):
        raise UsageError(f"{where}: definition {name!r} has rows of {const['head_dim_ckv']} + "
                         f"{const['head_dim_kpe']} values; mla-verify's sparse problems have {D_V} + {SPARSE_ROPE}")
    return FibDefinition(str(name), str(op_type), kind, const["num_qo_heads"], const["head_dim_ckv"],
                         const["head_dim_kpe"], const["page_size"], const.get("topk"), inputs, outputs)


def dense_inputs(definition: FibDefinition, problem: DecodeProblem) -> dict[str, torch.Tensor | float]:
    """``problem`` (one query token per request) as the definition's named inputs, each a tensor of its own:
    the caches split into ckv and kpe, the block table as CSR page lists, ``kv_last_page_len`` where the
    definition has it, ``sm_scale`` the problem's bmm1 (its bmm2 is not the kernel's: see the module
    docstring). Unused cache slots keep their NaN."""
    L = problem.dims.kv_lora_rank
    q = problem.query[:, 0]
    csr = csr_metadata(problem.seq_lens, 1, problem.page_size, problem.block_table)
    last = problem.seq_lens - (problem.pages_used().to(torch.int32) - 1) * problem.page_size
    named: dict[str, torch.Tensor | float] = {
        "q_nope": q[..., :L].contiguous(), "q_pe": q[..., L:].contiguous(),
        "ckv_cache": problem.kv_cache[..., :L].contiguous(), "kpe_cache": problem.kv_cache[..., L:].contiguous(),
        "kv_indptr": csr.kv_indptr, "kv_indices": csr.kv_indices, "kv_last_page_len": last.to(torch.int32),
        "sm_scale": float(problem.bmm1_scale)}
    return {name: named[name] for name in definition.inputs}


def sparse_inputs(definition: FibDefinition, problem: SparseDecodeProblem) -> dict[str, torch.Tensor | float]:
    """``problem`` as the definition's named inputs: every query token a row of its own (requests and their
    query tokens flattened, as the definition's ``num_tokens`` axis has them), the bf16 cache split into ckv and
    kpe, the top-k slots as ``sparse_indices``."""
    B, Q, H, D = problem.query.shape
    L = definition.kv_lora_rank
    q = problem.query.reshape(B * Q, H, D)
    named: dict[str, torch.Tensor | float] = {
        "q_nope": q[..., :L].contiguous(), "q_pe": q[..., L:].contiguous(),
        "ckv_cache": problem.kv_cache[..., :L].contiguous(), "kpe_cache": problem.kv_cache[..., L:].contiguous(),
        "sparse_indices": problem.indices.reshape(B * Q, -1).contiguous(), "sm_scale": float(problem.softmax_scale)}
    return {name: named[name] for name in definition.inputs}


def output_buffers(definition: FibDefinition, rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The definition's outputs for ``rows`` requests (dense) or query tokens (sparse), allocated; the caller
    poisons them."""
    shapes = {"output": ((rows, definition.heads, definition.kv_lora_rank), torch.bfloat16),
              "lse": ((rows, definition.heads), torch.float32)}
    return {name: torch.empty(shapes[name][0], dtype=shapes[name][1], device=device) for name in definition.outputs}

