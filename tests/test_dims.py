"""MLA dimensions, presets and the softmax scale, checked against the published DeepSeek numbers."""
import math

import pytest

from mla_verify.core.dims import (
    DEEPSEEK_V3,
    MLA_256,
    PRESETS,
    R1_SOFTMAX_SCALE,
    R1_YARN_FACTOR,
    MLADims,
    softmax_scale,
    yarn_mscale,
)
from mla_verify.problems.generate import ProblemSpec


def test_deepseek_v3_scale_is_one_over_sqrt_192_not_576() -> None:
    # The score is q_nope.k_nope + q_pe.k_pe: 128 + 64 = 192 dims, though the absorbed row is 576 wide.
    assert softmax_scale(DEEPSEEK_V3) == pytest.approx(1 / math.sqrt(192), rel=1e-15)
    assert not math.isclose(softmax_scale(DEEPSEEK_V3), 1 / math.sqrt(576), rel_tol=1e-3)


def test_r1_yarn_scale_matches_the_published_formula() -> None:
    # DeepSeek-R1 config: rope_scaling factor 40, mscale_all_dim 1.0; scale *= (0.1 ln 40 + 1)^2.
    expected = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192)
    assert R1_YARN_FACTOR == 40.0
    assert R1_SOFTMAX_SCALE == pytest.approx(expected, rel=1e-15)
    assert softmax_scale(DEEPSEEK_V3, 40.0, 1.0) == pytest.approx(expected, rel=1e-15)
    assert abs(R1_SOFTMAX_SCALE - 0.1352) < 5e-5  # the rounded value DeepSeek-R1 deployments quote


# 0.1 * ln(factor) * mscale_all_dim + 1, evaluated independently (ln 40 = 3.6888794541139363,
# ln 4 = 1.3862943611198906); 1e-15: a few float64 ulps of reordering
@pytest.mark.parametrize("factor,mscale_all_dim,expected", [(40.0, 1.0, 1.3688879454113936),
                                                            (40.0, 0.707, 1.2608037774058554),
                                                            (4.0, 1.0, 1.1386294361119891)])
def test_yarn_mscale_values(factor: float, mscale_all_dim: float, expected: float) -> None:
    assert yarn_mscale(factor, mscale_all_dim) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_yarn_factor_at_most_one_leaves_the_scale_alone(factor: float) -> None:
    assert yarn_mscale(factor) == 1.0
    assert softmax_scale(DEEPSEEK_V3, factor) == softmax_scale(DEEPSEEK_V3)


def test_deepseek_v3_dims() -> None:
    assert (DEEPSEEK_V3.kv_lora_rank, DEEPSEEK_V3.qk_rope_head_dim, DEEPSEEK_V3.qk_nope_head_dim,
            DEEPSEEK_V3.v_head_dim, DEEPSEEK_V3.num_heads) == (512, 64, 128, 128, 128)
    assert DEEPSEEK_V3.head_dim_qk == 576
    assert PRESETS["deepseek-v3"] == DEEPSEEK_V3


def test_mla_256_variant() -> None:
    assert (MLA_256.kv_lora_rank, MLA_256.qk_rope_head_dim) == (256, 64)
    assert MLA_256.head_dim_qk == 320
    assert PRESETS["mla-256"] == MLA_256
    # the scale depends on nope + rope only, so the (256, 64) variant keeps 1/sqrt(192)
    assert softmax_scale(MLA_256) == pytest.approx(1 / math.sqrt(192), rel=1e-15)


@pytest.mark.parametrize("tp,heads", [(2, 64), (4, 32), (8, 16), (16, 8)])
def test_tensor_parallel_presets_split_only_the_heads(tp: int, heads: int) -> None:
    preset = PRESETS[f"deepseek-v3-tp{tp}"]
    assert preset.num_heads == heads
    assert preset == MLADims(512, 64, 128, 128, heads)


def test_with_heads_returns_a_new_value() -> None:
    split = DEEPSEEK_V3.with_heads(16)
    assert split.num_heads == 16 and DEEPSEEK_V3.num_heads == 128
    assert softmax_scale(split) == softmax_scale(DEEPSEEK_V3)  # TP does not change the scale


def test_fp8_scales_compose_into_bmm1_and_bmm2() -> None:
    # bmm1 = q_scale * k_scale * softmax scale; bmm2 = k_scale (one latent row is K and V) * any output scale
    spec = ProblemSpec((5,), q_scale=0.5, k_scale=2.0, bmm2_extra=1.5, dtype="fp8")
    assert spec.bmm1_scale == pytest.approx(0.07216878364870323, rel=1e-15)  # 0.5 * 2 / sqrt(192)
    assert spec.bmm2_scale == 3.0  # 2.0 * 1.5, exact in binary
