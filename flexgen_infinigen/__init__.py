"""flexgen_infinigen: offloaded LLM inference with InfiniGen-style dynamic KV cache management."""
# MKL's float GEMM (torch's F.linear on a CPU, the prefill's matrix products) may split the
# inner dimension between threads on some CPUs (AVX-512 ones), so that one product's sums,
# and from them a run's logits, change with the thread count; InfiniGen's top-k choice of
# tokens then turns such last-bit differences into different attention. Strict conditional
# numerical reproducibility (the best code path the CPU has, "AUTO") makes each product
# independent of the thread count: pipeline ranks (one thread each) compute what one process
# computes. MKL reads this at its first call, so it is set on import, before any model runs;
# a value the user set is kept.
from .switches import MKL_CBWR

MKL_CBWR.set_default("AUTO,STRICT")

from .api import Generation, OffloadedLM  # noqa: E402 (after MKL_CBWR)
from .config import KNOWN_MODELS, ConfigError, ModelConfig, get_config  # noqa: E402 (after MKL_CBWR)
from .placement import Placement, Policy  # noqa: E402 (after MKL_CBWR)
from .sampling import SamplingConfig  # noqa: E402 (after MKL_CBWR)

__all__ = ["OffloadedLM", "Generation", "Placement", "Policy", "SamplingConfig", "ModelConfig",
           "KNOWN_MODELS", "ConfigError", "get_config"]
__version__ = "0.1.0"
