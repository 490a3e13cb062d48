"""Packed FP8 caches: bytes where each format's definition puts them, round trips within fp8's rounding, both
scale conventions, and the SM90 dequant's bf16-rounded scale."""
from __future__ import annotations

import pytest
import torch

from mla_verify.core.errors import ProblemError
from mla_verify.problems.packed import FORMATS, FP8, byte_rows, dequantize, kernel_view, quantize, tile_scales

FP8_HALF_ULP = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: rounding moves a value by at most 2^-4 of itself


def _cache(fmt, pages=3, page=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((pages, page, FORMATS[fmt].d_qk), generator=g) * torch.rand((pages, page, 1), generator=g) * 10
    x[0, 0, :FORMATS[fmt].tile] = 0  # an all-zero tile
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("fmt", ["V32", "V32_NO_ROPE"])
def test_row_formats_put_bytes_where_the_definition_says(fmt):
    f = FORMATS[fmt]
    x = _cache(fmt)
    packed = quantize(x, f, "amax")
    rows = packed.view(3, 5, f.bytes_per_token)
    assert rows.shape[-1] == {"V32": 656, "V32_NO_ROPE": 528}[fmt]
    scales = rows[..., 512:528].contiguous().view(torch.float32)  # 4 fp32, one per 128 values
    amax = x[..., :512].float().unflatten(-1, (4, 128)).abs().amax(-1)
    assert torch.equal(scales, torch.where(amax > 0, amax / 448, 1.0))
    assert torch.equal(rows[..., 528:].contiguous().view(torch.bfloat16), x[..., 512:])  # rope kept bf16
    nope = rows[..., :512].contiguous().view(FP8).float().unflatten(-1, (4, 128))
    assert float(nope.abs().amax()) == 448.0  # each tile's largest value lands on fp8's largest


def test_v4_page_layout():
    f = FORMATS["V4"]
    page = 5
    x = _cache("V4", page=page)
    packed = quantize(x, f, "pow2")
    assert packed.shape == (3, 3456) and 3456 % 576 == 0 and 3456 >= page * 584  # padded to 576
    data = packed[:, :page * 576].reshape(3, page, 576)
    assert torch.equal(data[..., 448:].contiguous().view(torch.bfloat16), x[..., 448:])
    exps = packed[:, page * 576:page * 584].reshape(3, page, 8)
    assert bool((exps[..., 7] == 0).all())  # the pad byte
    want = torch.ceil(torch.log2((x[..., :448].float().unflatten(-1, (7, 64)).abs().amax(-1) / 448)
                                 .clamp_min(1e-4))) + 127
    assert torch.equal(exps[..., :7].float(), want)
    view = kernel_view(packed, f, page)
    assert view.shape == (3, page, 1, 584) and view.stride(0) == 3456


@pytest.mark.parametrize("fmt, convention", [("V32", "pow2"), ("V32", "amax"), ("V32_NO_ROPE", "pow2"),
                                             ("V32_NO_ROPE", "amax"), ("V4", "pow2")])
def test_round_trip_within_fp8_rounding(fmt, convention):
    f = FORMATS[fmt]
    x = _cache(fmt)
    packed = quantize(x, f, convention)
    back = dequantize(packed, f, 5, "exact")
    scales = tile_scales(x, f, convention).repeat_interleave(f.tile, -1)
    err = (back[..., :f.nope] - x[..., :f.nope].float()).abs()
    # fp8 rounds |x|/s (<= 448) to 3 mantissa bits; below 2^-6 (subnormals) the step is 2^-9
    allowed = (x[..., :f.nope].float().abs() * FP8_HALF_ULP).clamp_min(2.0 ** -10 * scales)
    assert bool((err <= allowed * (1 + 1e-6)).all())  # 1e-6: the bound itself computed in fp32
    assert torch.equal(back[..., f.nope:], x[..., f.nope:].float())


def test_sm90_dequant_rounds_the_scale_to_bf16():
    f = FORMATS["V32"]
    x = _cache("V32")
    pow2 = quantize(x, f, "pow2")
    assert torch.equal(dequantize(pow2, f, 5, "sm90").float(), dequantize(pow2, f, 5, "exact").to(torch.bfloat16)
                       .float())  # exact for powers of two
    amax = quantize(x, f, "amax")
    sm90, exact = dequantize(amax, f, 5, "sm90"), dequantize(amax, f, 5, "exact")
    assert not torch.equal(sm90.float(), exact.to(torch.bfloat16).float())  # double rounding shows
    scales = amax.view(3, 5, 656)[..., 512:528].contiguous().view(torch.float32).to(torch.bfloat16).float()
    nope = amax.view(3, 5, 656)[..., :512].contiguous().view(FP8).float().unflatten(-1, (4, 128))
    assert torch.equal(sm90[..., :512].float(), (nope * scales[..., None]).flatten(-2).to(torch.bfloat16).float())


def test_v4_takes_power_of_two_scales_only():
    with pytest.raises(ProblemError, match="ue8m0"):
        quantize(_cache("V4"), FORMATS["V4"], "amax")


@pytest.mark.parametrize("fmt", ["V32", "V32_NO_ROPE", "V4"])
def test_finite_poison_repacks_only_the_unlisted_rows(fmt: str) -> None:
    """The sparse diagnosis re-runs a kernel with finite values where the cache held NaN: the packed bytes of the
    unlisted rows (V4: their data and scale rows) are packed anew, every listed row's bytes are kept."""
    from mla_verify.judge.sparse_catalog import finite_poison
    from mla_verify.problems.sparse import SparseSpec, build_sparse_problem

    p = build_sparse_problem(SparseSpec(batch=1, num_heads=2, topk=64, page_size=64, used_pages=2, extra_pages=1,
                                        fmt=fmt, invalid=0.3, seed=4))
    q = finite_poison(p)
    assert q is not None and not bool(q.kv_cache.isnan().any())
    listed = ~p.kv_cache.isnan().any(-1)  # [P, page]
    assert torch.equal(q.kv_cache[listed], p.kv_cache[listed])
    assert torch.equal(dequantize(q.packed, FORMATS[fmt], 64, "sm90"), q.kv_cache)
    owner = byte_rows(FORMATS[fmt], 64)
    kept = (owner >= 0) & listed[:, owner.clamp_min(0)]
    assert torch.equal(q.packed[kept], p.packed[kept]) and not torch.equal(q.packed, p.packed)
