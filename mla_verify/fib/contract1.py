"""The suite's own kernels as flashinfer-bench python solutions: the CPU peer and the dense mutants of an
``mla_paged`` decode definition, the sparse stand-in and the sparse mutants of a ``dsa_paged`` one -- how the
flashinfer-bench path is proved, and how its evaluator and mla-verify are compared on the same faults
(benchmarks/fib_side_by_side.py, docs/flashinfer-bench.md).

A solution's source is a few generated lines: a destination-passing ``run`` with the definition's inputs and
outputs that hands them, with a Contract-1 callable, to this module's adapter of the definition's kind:

- ``call_contract1`` (``mla_paged``, Contract 1's ``trtllm`` convention) lays the inputs out as Contract 1 has
  them -- one [P, page, ckv + kpe] cache (a copy: the two caches are tensors of their own), the CSR page lists
  as a block table, the lengths from the page counts and ``kv_last_page_len`` -- and calls the kernel with
  ``out=`` the definition's ``output`` and ``bmm1_scale = sm_scale``;
- ``call_contract1_sparse`` (``dsa_paged``, Contract 1's ``trtllm-sparse`` convention: FlashMLA's own sparse
  decode reads packed FP8 caches only, so the sparse kernels are handed the definition's bf16 pool by their
  ``trtllm_sparse`` face, kernels/mutants.py) makes each query token a request of one token over one
  [P, 1, page, ckv + kpe] cache (a copy), ``sparse_indices`` its block tables [T, 1, topk], and maps an empty
  row's LSE from Contract 1's +inf to the definition's -inf (docs/flashinfer-bench.md, "Conventions").

Both copy the kernel's base-2 LSE into ``lse`` and write what the kernel left in its cache copy back into the
two caches (so a kernel that writes its input cache, the ``cache_written`` mutant, does it to the solution's
inputs, as it would in place).

Some mutants cannot differ from the correct kernel on any problem of a definition: ``not_expressible`` says
which, and why.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..problems.layouts import csr_to_block_table
from .definition import SPARSE, FibDefinition

QK_NOPE = 128  # Contract 1's qk_nope_head_dim: DeepSeek's, unused by the kernels here
AUTHOR = "mla-verify"


def call_contract1(kernel: object, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
                   kpe_cache: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                   kv_last_page_len: torch.Tensor | None, sm_scale: float, output: torch.Tensor,
                   lse: torch.Tensor) -> None:
    """Run the Contract-1 callable ``kernel`` on an ``mla_paged`` decode definition's inputs, destination
    passing (module docstring)."""
    assert callable(kernel)
    B, H, L = q_nope.shape
    page = ckv_cache.shape[1]
    cache = torch.cat([ckv_cache, kpe_cache], dim=-1)
    pages = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)
    seq_lens = pages if kv_last_page_len is None else (pages - 1) * page + kv_last_page_len
    table = csr_to_block_table(kv_indptr, kv_indices)
    query = torch.cat([q_nope, q_pe], dim=-1).unsqueeze(1)
    workspace = torch.zeros(1 << 20, dtype=torch.int8, device=q_nope.device)
    _, got = kernel(query, cache, workspace, QK_NOPE, L, q_pe.shape[-1], table, seq_lens.to(torch.int32),
                    int(seq_lens.max()), out=output.unsqueeze(1), bmm1_scale=float(sm_scale), bmm2_scale=1.0,
                    return_lse=True)
    lse.copy_(got.reshape(B, H))
    ckv_cache.copy_(cache[..., :L])  # what the kernel wrote into its cache, if anything, reaches the inputs
    kpe_cache.copy_(cache[..., L:])


def call_contract1_sparse(kernel: object, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
                          kpe_cache: torch.Tensor, sparse_indices: torch.Tensor, sm_scale: float,
                          output: torch.Tensor, lse: torch.Tensor) -> None:
    """Run the ``trtllm-sparse`` Contract-1 callable ``kernel`` on a ``dsa_paged`` definition's inputs,
    destination passing (module docstring)."""
    assert callable(kernel)
    T, H, L = q_nope.shape
    P, page = ckv_cache.shape[:2]
    cache = torch.cat([ckv_cache, kpe_cache], dim=-1).unsqueeze(1)
    query = torch.cat([q_nope, q_pe], dim=-1).unsqueeze(1)
    table = sparse_indices.unsqueeze(1)
    slots = torch.full((T,), P * page, dtype=torch.int32, device=q_nope.device)  # as FlashInfer's sparse paths
    workspace = torch.zeros(1 << 20, dtype=torch.int8, device=q_nope.device)
    _, got = kernel(query, cache, workspace, QK_NOPE, L, q_pe.shape[-1], table, slots, P * page,
                    out=output.unsqueeze(1), bmm1_scale=float(sm_scale), bmm2_scale=1.0, return_lse=True,
                    sparse_mla_top_k=table.shape[-1])
    got = got.reshape(T, H)
    lse.copy_(got.masked_fill(got == float("inf"), float("-inf")))  # an empty row: the definition's -inf
    ckv_cache.copy_(cache[:, 0, :, :L])  # what the kernel wrote into its cache, if anything, reaches the inputs
    kpe_cache.copy_(cache[:, 0, :, L:])


def solution_source(target: str, definition: FibDefinition) -> str:
    """A python solution's ``main.py``: ``run`` with the definition's inputs and outputs, calling the Contract-1
    callable ``target`` (``MODULE:ATTR``, the attribute dotted: a sparse kernel's ``NAME.trtllm_sparse``) with
    the adapter of the definition's kind."""
    module, _, attr = target.partition(":")
    first, _, rest = attr.partition(".")
    params = [*definition.inputs, *definition.outputs]
    adapter = "call_contract1_sparse" if definition.kind == SPARSE else "call_contract1"
    args = list(params)
    if definition.kind != SPARSE and "kv_last_page_len" not in params:  # page size 1: lengths are page counts
        args.insert(args.index("kv_indices") + 1, "None")
    return (f'"""{target} as a flashinfer-bench solution of {definition.name} (mla_verify.fib.contract1)."""\n'
            f"from {module} import {first} as kernel\n"
            f"from mla_verify.fib.contract1 import {adapter}\n"
            + (f"\nkernel = kernel.{rest}\n" if rest else "") + "\n\n"
            f"def run({', '.join(params)}):\n"
            f"    {adapter}(kernel, {', '.join(args)})\n")


def solution_json(name: str, target: str, definition: FibDefinition, description: str = "") -> dict:
    """A flashinfer-bench Solution (its JSON) named ``name``: the Contract-1 callable ``target`` for
    ``definition``, python, destination passing."""
    return {"name": name, "definition": definition.name, "author": AUTHOR,
            "spec": {"language": "python", "target_hardware": ["cpu", "cuda"], "entry_point": "main.py::run",
                     "dependencies": [], "destination_passing_style": True},
            "sources": [{"path": "main.py", "content": solution_source(target, definition)}],
            "description": description or f"{target} (Contract 1) wrapped by mla-verify"}


def write_solution(path: Path, name: str, target: str, definition: FibDefinition, description: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(solution_json(name, target, definition, description), indent=2) + "\n")
    return path


def not_expressible(mutant: str, definition: FibDefinition) -> str | None:
    """Why the mutant, wrapped, is a correct solution of ``definition`` -- it equals the correct kernel on every
    problem of it, or differs only in the order of a sum, which a solution (claiming no bits: fib/definition.py)
    may choose; None when some problem of it tells them apart."""
    if definition.kind == SPARSE:
        return _not_expressible_sparse(mutant, definition)
    reasons = {
        "bmm2_ignored": "the definition has no output scale (bmm2 is always 1)",
        "bmm2_twice": "the definition has no output scale (bmm2 is always 1)",
        "cache_4d_as_3d": "the definition's caches are 3-D [pages, page_size, dim]",
        "causal_ignored": "decode: one query token per request, which sees the whole sequence",
        "empty_split_unguarded": "decode: one query token per request sees a key in every split of its sequence",
    }
    if definition.page_size == 1:
        whole = "pages of one token: a sequence's last page is never partial"
        reasons.update(partial_page_dropped=whole, reads_to_page_end=whole, nan_leak_unmasked_tail=whole,
                       cache_written=whole + " (it writes the unused tail of one)",
                       pages_sorted="pages of one token, one query token: its pages in physical order are the "
                                    "same keys, summed in another order (right within tolerance; a solution "
                                    "claims no bits)")
    if definition.page_size == 64:
        reasons["page_size_assumed_64"] = "the definition's page size is 64"
    return reasons.get(mutant)


def _not_expressible_sparse(mutant: str, definition: FibDefinition) -> str | None:
    """``not_expressible`` of a sparse mutant (kernels/mutants.py's SPARSE_MUTANTS) and a ``dsa_paged`` definition."""
    unscaled = "the definition's cache is bf16: no scales to misread"
    reasons = {"topk_length_ignored": "the definition has no topk_length: every entry of a row is read",
               "sink_in_lse": "the definition has no attention sink",
               "scales_pow2": unscaled, "tile_scale_shifted": unscaled}
    if definition.page_size == 1:
        reasons["indices_as_page_ids"] = "pages of one token: a slot is its page id"
    return reasons.get(mutant)
