"""KV cache policies behind one interface (see :mod:`flexgen_infinigen.kv.base`)."""
from ..config import ConfigError
from .base import CacheSpec, KVCache, KVPolicy
from .full import FullPolicy
from .h2o import H2OPolicy
from .infinigen import InfiniGenPolicy
from .options import InfiniGenOptions, SelectionOptions
from .oracle import OraclePolicy

POLICIES = {"full": FullPolicy, "infinigen": InfiniGenPolicy,
            "h2o": H2OPolicy, "oracle": OraclePolicy}


def make_kv_policy(name: str, **options) -> KVPolicy:
    if name not in POLICIES:
        raise ConfigError(f"unknown --kv-policy {name!r}; pick one of: {', '.join(POLICIES)}")
    return POLICIES[name](**options)


__all__ = ["H2OPolicy", "InfiniGenOptions", "SelectionOptions", "CacheSpec", "KVCache",
           "KVPolicy", "OraclePolicy", "make_kv_policy", "POLICIES"]
