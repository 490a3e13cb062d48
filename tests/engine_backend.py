"""A small MLA decode backend written the way inference engines write theirs, for shadow mode's tests.

It owns what an engine owns: a paged latent cache in vLLM's layout, [num_blocks, block_size, kv_lora_rank +
rope], blocks handed out from a shuffled free list, one block table per batch, and the layer's projections
W_UK [H, nope, L] (absorbed into the query before the kernel) and W_UV [H, L, v] (applied to its output). Each
decode step appends the new tokens' latent rows, absorbs the query and calls a kernel through one of four
routes, each by the name the engine module binds -- which is what shadow mode has to find:

- ``torch``: ``torch_mla_decode``, a Contract-1 PyTorch kernel that takes only a 4-D [pages, 1, page, D] cache
  (FlashInfer 0.6.0's shape, declared in its ``mla_verify_envelope``);
- ``flashinfer``: FlashInfer's ``trtllm_batch_decode_with_kv_cache_mla``, imported as vLLM imports it;
- ``fa2`` / ``fa3``: FlashInfer's ``BatchMLAPagedAttentionWrapper``, planned with CSR page lists every step.

``EngineBugs`` plants the integration bugs shadow mode must catch at the call; its defaults are correct.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla
from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

from mla_verify.backends.cpu_peer import cpu_peer_decode
from mla_verify.core.dims import R1_SOFTMAX_SCALE

L, R, NOPE, V = 512, 64, 128, 128
ROUTES = ("torch", "flashinfer", "fa2", "fa3")
WORKSPACE_BYTES = 128 << 20


def torch_mla_decode(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                     block_tables, seq_lens, max_seq_len, out=None, bmm1_scale=1.0, bmm2_scale=1.0,
                     return_lse=False):
    """The engine's PyTorch MLA decode kernel (Contract 1) over a [pages, 1, page, D] cache: it unpacks that
    shape, as a kernel built for the 4-D layout reads its page size from dimension 2."""
    pages, heads_kv, page, width = kv_cache.shape
    return cpu_peer_decode(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                           block_tables, seq_lens, max_seq_len, out=out, bmm1_scale=bmm1_scale,
                           bmm2_scale=bmm2_scale, return_lse=return_lse)


def torch_mla_decode_into(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                          block_tables, seq_lens, max_seq_len, out=None, bmm1_scale=1.0, bmm2_scale=1.0,
                          return_lse=False):
    """The same kernel in a custom op's style: it writes ``out`` in place and returns nothing."""
    torch_mla_decode(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                     block_tables, seq_lens, max_seq_len, out=out, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale)


FOUR_D_ONLY = {"cache_dims": [4], "devices": ["cpu", "cuda"], "page_sizes": None, "heads": None}
torch_mla_decode.mla_verify_envelope = FOUR_D_ONLY
torch_mla_decode_into.mla_verify_envelope = FOUR_D_ONLY
TORCH_KERNELS = ("engine_backend:torch_mla_decode", "engine_backend:torch_mla_decode_into")


@dataclass(frozen=True)
class EngineBugs:
    """One field per integration bug; every default is the correct integration."""

    cache_3d: bool = False  # hands the 4-D-only kernel the 3-D cache (the torch route)
    inplace_kernel: bool = False  # calls the in-place kernel variant and uses its return value (torch route)
    scale_absorbed: bool = False  # softmax scale 1/sqrt(kv_lora_rank + rope) instead of 1/sqrt(nope + rope)
    table_page_size: int | None = None  # sizes block-table rows for this page size, not the cache's


@dataclass
class Request:
    length: int
    blocks: list[int] = field(default_factory=list)


class MiniEngine:
    """One MLA attention layer's decode path. The same seed gives the same weights, cache and queries."""

    def __init__(self, route: str, *, heads: int = 16, block_size: int = 32, num_blocks: int = 64,
                 device: str | torch.device = "cpu", seed: int = 0, bugs: EngineBugs = EngineBugs()):
        assert route in ROUTES, route
        self.route, self.heads, self.block_size, self.bugs = route, heads, block_size, bugs
        self.device = torch.device(device)
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.cache = self._randn(num_blocks, block_size, L + R).to(torch.bfloat16)  # stale rows: finite garbage
        self.w_uk = self._randn(heads, NOPE, L) / math.sqrt(NOPE)
        self.w_uv = self._randn(heads, L, V) / math.sqrt(L)
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.requests: list[Request] = []
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.softmax_scale = 1 / math.sqrt(L + R) if bugs.scale_absorbed else R1_SOFTMAX_SCALE
        self.wrapper = BatchMLAPagedAttentionWrapper(self.workspace, backend=route) if route in ("fa2", "fa3") else None

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.device)

    def add_request(self, prompt_len: int) -> None:
        request = Request(0)
        self.requests.append(request)
        self._append(request, prompt_len)

    def _append(self, request: Request, tokens: int) -> None:
        """Write ``tokens`` new latent rows (kv_c | k_pe) at the end of ``request``, taking blocks as needed."""
        rows = self._randn(tokens, L + R).to(torch.bfloat16)
        for i in range(tokens):
            position = request.length + i
            if position // self.block_size == len(request.blocks):
                request.blocks.append(self.free.pop())
            self.cache[request.blocks[position // self.block_size], position % self.block_size] = rows[i]
        request.length += tokens

    def step(self, q_len: int = 1) -> torch.Tensor:
        """One decode step of every request: q_len new tokens each; returns the attention output [B, q_len, H, v]."""
        for request in self.requests:
            self._append(request, q_len)
        B, H = len(self.requests), self.heads
        q_nope, q_pe = self._randn(B, q_len, H, NOPE), self._randn(B, q_len, H, R)
        absorbed = torch.einsum("bqhn,hnl->bqhl", q_nope, self.w_uk)  # W_UK folded into the query
        query = torch.cat((absorbed, q_pe), dim=-1).to(torch.bfloat16)
        latent = self._attend(query)  # [B, q_len, H, L]
        return torch.einsum("bqhl,hlv->bqhv", latent.float(), self.w_uv)  # then W_UV

    def _block_table(self) -> torch.Tensor:
        rows_page = self.bugs.table_page_size or self.block_size
        width = max(-(-r.length // rows_page) for r in self.requests)
        table = torch.zeros((len(self.requests), width), dtype=torch.int32)
        for b, r in enumerate(self.requests):
            table[b, :min(width, len(r.blocks))] = torch.tensor(r.blocks[:width], dtype=torch.int32)
        return table.to(self.device)

    def _seq_lens(self) -> torch.Tensor:
        return torch.tensor([r.length for r in self.requests], dtype=torch.int32, device=self.device)

    def _attend(self, query: torch.Tensor) -> torch.Tensor:
        if self.wrapper is not None:
            return self._attend_wrapper(query)
        B, Q, H, _ = query.shape
        lens, table = self._seq_lens(), self._block_table()
        out = torch.empty((B, Q, H, L), dtype=torch.bfloat16, device=self.device)
        if self.route == "flashinfer":
            return trtllm_batch_decode_with_kv_cache_mla(
                query, self.cache.unsqueeze(1), self.workspace, NOPE, L, R, table, lens, int(lens.max()), out=out,
                bmm1_scale=self.softmax_scale, backend="trtllm-gen")
        cache = self.cache if self.bugs.cache_3d else self.cache.unsqueeze(1)
        kernel = torch_mla_decode_into if self.bugs.inplace_kernel else torch_mla_decode
        return kernel(query, cache, self.workspace, NOPE, L, R, table, lens, int(lens.max()), out=out,
                      bmm1_scale=self.softmax_scale)

    def _page_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        counts = [len(r.blocks) for r in self.requests]
        indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
        indices = torch.tensor([blk for r in self.requests for blk in r.blocks], dtype=torch.int32)
        return indptr.to(self.device), indices.to(self.device)

    def _attend_wrapper(self, query: torch.Tensor) -> torch.Tensor:
        B, Q, H, _ = query.shape
        kv_indptr, kv_indices = self._page_lists()
        qo_indptr = torch.arange(0, (B + 1) * Q, Q, dtype=torch.int32, device=self.device)
        self.wrapper.plan(metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, self._seq_lens()),
                          num_heads=H, head_dim_ckv=L, head_dim_kpe=R, page_size=self.block_size, causal=True,
                          sm_scale=self.softmax_scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                          query_layout="split", kv_cache_layout="split", output_dtype=torch.bfloat16)
        flat = query.view(B * Q, H, L + R)
        out = torch.empty((B * Q, H, L), dtype=torch.bfloat16, device=self.device)
        self.wrapper.run(query=(flat[..., :L], flat[..., L:]), kv_cache=(self.cache[..., :L], self.cache[..., L:]),
                         out=out)
        return out.view(B, Q, H, L)
