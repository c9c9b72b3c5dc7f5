"""flexgen_infinigen: offloaded LLM inference with InfiniGen-style dynamic KV cache management."""
from .api import Generation, OffloadedLM
from .config import KNOWN_MODELS, ConfigError, ModelConfig, get_config
from .policy import Policy
from .sampling import SamplingConfig

__all__ = ["OffloadedLM", "Generation", "Policy", "SamplingConfig", "ModelConfig",
           "KNOWN_MODELS", "ConfigError", "get_config"]
__version__ = "0.1.0"
