"""mla-verify: proves MLA decode kernels compute what they claim.

The package's rooms, one way of data (each subpackage's docstring states what it may import):
core -> problems -> {backends, judge, draw} -> kernels, run, records -> shadow, bench -> cli; at the top the
pytest plugin (pytest_plugin, pytest_helpers, pytest_shadow), which may import any room.
"""
from typing import Any

from .core.dims import DEEPSEEK_V3, MLA_256, PRESETS, R1_SOFTMAX_SCALE, MLADims, softmax_scale, yarn_mscale
from .core.errors import FixtureError, MLAVerifyError, ProblemError, UsageError
from .core.platform import VERSION
from .problems.generate import ProblemSpec, build_problem
from .problems.problem import DecodeProblem
from .problems.reference import ReferenceResult, reference_decode

__version__ = VERSION
__all__ = ["DEEPSEEK_V3", "MLA_256", "PRESETS", "R1_SOFTMAX_SCALE", "MLADims", "softmax_scale", "yarn_mscale",
           "FixtureError", "MLAVerifyError", "ProblemError", "UsageError", "ProblemSpec", "build_problem",
           "DecodeProblem", "ReferenceResult", "reference_decode", "verify_kernel"]


def __getattr__(name: str) -> Any:
    """``mla_verify.verify_kernel``, imported on first use: it brings in the search engine and pytest."""
    if name == "verify_kernel":
        from .pytest_helpers import verify_kernel

        return verify_kernel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
