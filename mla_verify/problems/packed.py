"""Packed FP8 latent caches of DeepSeek sparse decode, written from each format's definition.

One token's latent row (``d_qk`` values: ``nope`` quantized dims, then ``rope`` bf16 dims) is stored as:

- ``V32`` (V3.2, 656 bytes, d_qk 576): 512 fp8-e4m3 values, 4 fp32 scales (one per 128 values), 64 bf16 rope.
- ``V32_NO_ROPE`` (528 bytes, d_qk 512): the same first 528 bytes, no rope.
- ``V4`` (584 bytes a token, d_qk 512), laid out per page: first the page's token rows of 576 bytes (448 fp8,
  then 64 bf16 rope), then one 8-byte row per token (7 ue8m0 scales, one per 64 values, and a pad byte); the
  page's bytes are padded to a multiple of 576.

A value ``x`` of tile ``t`` is stored as ``fp8(x / s_t)``. Two scale conventions exist: ``pow2`` (DeepSeek's,
``s = 2^ceil(log2(max(amax / 448, 1e-4)))``) and ``amax`` (``s = amax / 448``, SGLang's and FlashMLA's first
quantizer; an all-zero tile gets ``s = 1``, where the definition would divide 0 by 0). ue8m0 holds powers of two
only, so V4 takes ``pow2`` alone.

Dequantizing: ``exact`` is ``fp8 * s`` in fp32; ``sm90`` is what FlashMLA's SM90 kernel computes,
``bf16(bf16(fp8) * bf16(s))`` -- the fp32 scale rounded to bf16 first (exact for powers of two, double-rounded
for others). The reference is held to the ``sm90`` values (docs/reference.md, "Sparse decode").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.errors import ProblemError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
POW2_FLOOR = 1e-4  # the smallest scale / 448 the pow2 convention takes (DeepSeek's FP8_AMAX_MARGIN)
SCALE_CONVENTIONS = ("pow2", "amax")
DEQUANT_MODES = ("sm90", "exact")
V4_ROW_ALIGN = 576  # a V4 page's bytes are padded to a multiple of this


@dataclass(frozen=True)
class PackedFormat:
    name: str
    d_qk: int  # values in a token's row: nope then rope
    nope: int  # the quantized ones
    tile: int  # values per scale
    bytes_per_token: int
    page_level: bool  # V4: data rows, then scale rows, per page

    @property
    def rope(self) -> int:
        return self.d_qk - self.nope

    @property
    def tiles(self) -> int:
        return self.nope // self.tile

    def page_bytes(self, page: int) -> int:
        """The bytes between two pages (V4 pads a page to a multiple of 576; the others are token rows)."""
        raw = page * self.bytes_per_token
        return -(-raw // V4_ROW_ALIGN) * V4_ROW_ALIGN if self.page_level else raw


FORMATS = {f.name: f for f in (
    PackedFormat("V32", 576, 512, 128, 656, False),
    PackedFormat("V32_NO_ROPE", 512, 512, 128, 528, False),
    PackedFormat("V4", 512, 448, 64, 584, True),
)}


def packed_format(name: str) -> PackedFormat:
    if name not in FORMATS:
        raise ProblemError(f"format: {name!r} is not one of {sorted(FORMATS)}")
    return FORMATS[name]


def byte_rows(fmt: PackedFormat, page: int) -> torch.Tensor:
    """[page_bytes(page)] int64: the token (0 .. page - 1) each byte of a packed page belongs to; -1 for padding."""
    owner = torch.full((fmt.page_bytes(page),), -1, dtype=torch.long)
    tokens = torch.arange(page)
    if fmt.page_level:  # the page's data rows, then its 8-byte scale rows
        row = fmt.nope + 2 * fmt.rope
        owner[:page * row] = tokens.repeat_interleave(row)
        owner[page * row:page * fmt.bytes_per_token] = tokens.repeat_interleave(fmt.bytes_per_token - row)
    else:
        owner[:page * fmt.bytes_per_token] = tokens.repeat_interleave(fmt.bytes_per_token)
    return owner


def tile_scales(cache: torch.Tensor, fmt: PackedFormat, convention: str) -> torch.Tensor:
    """[..., tiles] fp32 scales of ``cache`` [..., d_qk] under ``convention``."""
    if convention not in SCALE_CONVENTIONS:
        raise ProblemError(f"scales: {convention!r} is not one of {SCALE_CONVENTIONS}")
    if fmt.page_level and convention != "pow2":
        raise ProblemError(f"scales: {fmt.name} stores ue8m0 scales, powers of two only (got {convention!r})")
    amax = cache[..., :fmt.nope].float().unflatten(-1, (fmt.tiles, fmt.tile)).abs().amax(-1)
    if convention == "pow2":
        return torch.exp2(torch.ceil(torch.log2((amax / FP8_MAX).clamp_min(POW2_FLOOR))))
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize(cache: torch.Tensor, fmt: PackedFormat, convention: str = "pow2") -> torch.Tensor:
    """Pack ``cache`` [P, page, d_qk] (its rope part must be bf16 values): uint8 [P, page_bytes(page)]."""
    P, page, d = cache.shape
    if d != fmt.d_qk:
        raise ProblemError(f"kv_cache: last dim {d}, but {fmt.name} rows hold {fmt.d_qk} values")
    scales = tile_scales(cache, fmt, convention)  # [P, page, tiles]
    values = cache[..., :fmt.nope].float().unflatten(-1, (fmt.tiles, fmt.tile)) / scales[..., None]
    nope = values.flatten(-2).to(FP8).view(torch.uint8)
    rope = cache[..., fmt.nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    out = torch.zeros((P, fmt.page_bytes(page)), dtype=torch.uint8, device=cache.device)
    if fmt.page_level:
        row = fmt.nope + 2 * fmt.rope
        rows = out[:, :page * row].view(P, page, row)
        rows[..., :fmt.nope] = nope
        rows[..., fmt.nope:] = rope
        # ue8m0: the biased exponent alone; 0xFF is its NaN (a NaN-poisoned row stays NaN)
        exponents = torch.where(scales.isnan(), 255.0, torch.log2(scales).round() + 127).to(torch.uint8)
        out[:, page * row:page * fmt.bytes_per_token].view(P, page, 8)[..., :fmt.tiles] = exponents
        return out
    rows = out.view(P, page, fmt.bytes_per_token)
    rows[..., :fmt.nope] = nope
    rows[..., fmt.nope:fmt.nope + 4 * fmt.tiles] = scales.contiguous().view(torch.uint8)
    rows[..., fmt.nope + 4 * fmt.tiles:] = rope
    return out


def unpack(packed: torch.Tensor, fmt: PackedFormat, page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nope fp8 [P, page, nope], scales fp32 [P, page, tiles], rope bf16 [P, page, rope]) of a packed pool."""
    P = packed.shape[0]
    if fmt.page_level:
        row = fmt.nope + 2 * fmt.rope
        rows = packed[:, :page * row].reshape(P, page, row)
        exponents = packed[:, page * row:page * fmt.bytes_per_token].reshape(P, page, 8)[..., :fmt.tiles]
        scales = torch.where(exponents == 255, float("nan"), torch.exp2(exponents.float() - 127))
        return rows[..., :fmt.nope].view(FP8), scales, rows[..., fmt.nope:].contiguous().view(torch.bfloat16)
    rows = packed.reshape(P, page, fmt.bytes_per_token)
    scales = rows[..., fmt.nope:fmt.nope + 4 * fmt.tiles].contiguous().view(torch.float32)
    rope = rows[..., fmt.nope + 4 * fmt.tiles:].contiguous().view(torch.bfloat16)
    return rows[..., :fmt.nope].contiguous().view(FP8), scales, rope


def dequantize(packed: torch.Tensor, fmt: PackedFormat, page: int, mode: str = "sm90",
               misread: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """[P, page, d_qk] values of a packed pool: bf16 for ``sm90`` (the SM90 kernel's), fp32 for ``exact``.
    ``misread`` maps the stored scales [P, page, tiles] to the ones used (a faulty kernel's, or diagnosis's)."""
    if mode not in DEQUANT_MODES:
        raise ValueError(f"mode must be one of {DEQUANT_MODES}, got {mode!r}")
    nope, scales, rope = unpack(packed, fmt, page)
    if misread is not None:
        scales = misread(scales)
    if mode == "sm90":
        scales = scales.to(torch.bfloat16)
    values = nope.float().unflatten(-1, (fmt.tiles, fmt.tile)) * scales.float()[..., None]
    dtype = torch.bfloat16 if mode == "sm90" else torch.float32
    return torch.cat([values.flatten(-2).to(dtype), rope.to(dtype)], dim=-1)


def truncated_to_pow2(scales: torch.Tensor) -> torch.Tensor:
    """A misreading: fp32 scales cut to their power of two (an e8m0 cast that drops the mantissa, SM100's V3.2
    bug; exact for ``pow2`` scales, up to 2x off for others)."""
    return torch.exp2(torch.floor(torch.log2(scales)))


def next_tile(scales: torch.Tensor) -> torch.Tensor:
    """A misreading: each tile read with the next tile's scale."""
    return scales.roll(-1, dims=-1)


def kernel_view(packed: torch.Tensor, fmt: PackedFormat, page: int) -> torch.Tensor:
    """The pool as FlashMLA takes it: [P, page, 1, bytes_per_token] uint8, page stride ``page_bytes(page)``
    (for V4 the per-token view of a page-level layout: only its page stride and base are meaningful)."""
    P = packed.shape[0]
    return packed.as_strided((P, page, 1, fmt.bytes_per_token),
                             (packed.stride(0), fmt.bytes_per_token, fmt.bytes_per_token, 1))
