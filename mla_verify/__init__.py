"""mla-verify: proves MLA decode kernels compute what they claim."""
from .dims import DEEPSEEK_V3, MLA_256, PRESETS, R1_SOFTMAX_SCALE, MLADims, softmax_scale, yarn_mscale
from .errors import FixtureError, MLAVerifyError, ProblemError, UsageError
from .generate import ProblemSpec, build_problem
from .problem import DecodeProblem
from .reference import ReferenceResult, reference_decode

__version__ = "0.1.0"
__all__ = ["DEEPSEEK_V3", "MLA_256", "PRESETS", "R1_SOFTMAX_SCALE", "MLADims", "softmax_scale", "yarn_mscale",
           "FixtureError", "MLAVerifyError", "ProblemError", "UsageError", "ProblemSpec", "build_problem",
           "DecodeProblem", "ReferenceResult", "reference_decode"]
