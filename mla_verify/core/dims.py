"""MLA dimensions, named presets and the softmax scale (with DeepSeek's YaRN mscale)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MLADims:
    """Head dimensions of one MLA attention layer.

    The decode kernels only see ``kv_lora_rank`` (latent, the V width) and ``qk_rope_head_dim``;
    ``qk_nope_head_dim`` and ``v_head_dim`` matter for the softmax scale and the unabsorbed form.
    """

    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    num_heads: int = 128

    @property
    def head_dim_qk(self) -> int:
        """Width of one absorbed query / cache row: latent then rope (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def with_heads(self, num_heads: int) -> MLADims:
        """The same layer with its heads split by tensor parallelism."""
        return replace(self, num_heads=num_heads)


def yarn_mscale(factor: float, mscale_all_dim: float = 1.0) -> float:
    """DeepSeek's YaRN attention-magnitude correction: 0.1 * ln(factor) * mscale_all_dim + 1."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * math.log(factor) * mscale_all_dim + 1.0


def softmax_scale(dims: MLADims, yarn_factor: float | None = None, mscale_all_dim: float = 1.0) -> float:
    """1/sqrt(qk_nope + qk_rope) -- 1/sqrt(192), not 1/sqrt(576) -- times mscale² under YaRN."""
    scale = 1.0 / math.sqrt(dims.qk_nope_head_dim + dims.qk_rope_head_dim)
    if yarn_factor is not None:
        scale *= yarn_mscale(yarn_factor, mscale_all_dim) ** 2
    return scale


DEEPSEEK_V3 = MLADims(512, 64, 128, 128, 128)
"""DeepSeek-V3 / R1 attention (R1 adds YaRN factor 40, mscale_all_dim 1.0)."""
MLA_256 = MLADims(256, 64, 128, 128, 128)
"""The (kv_lora_rank 256, rope 64) shape that FlashInfer's trtllm-gen kernels also support."""

PRESETS: dict[str, MLADims] = {"deepseek-v3": DEEPSEEK_V3, "mla-256": MLA_256}
for _tp in (2, 4, 8, 16):
    PRESETS[f"deepseek-v3-tp{_tp}"] = DEEPSEEK_V3.with_heads(128 // _tp)

R1_YARN_FACTOR = 40.0
R1_SOFTMAX_SCALE = softmax_scale(DEEPSEEK_V3, R1_YARN_FACTOR, 1.0)
"""≈ 0.1352: the scale DeepSeek-R1 actually uses."""
