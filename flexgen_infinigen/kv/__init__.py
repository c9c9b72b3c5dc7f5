"""KV cache policies behind one interface (see :mod:`flexgen_infinigen.kv.base`)."""
from ..config import ConfigError
from .base import CacheSpec, KVCache, KVPolicy
from .full import FullPolicy
from .infinigen import InfiniGenOptions, InfiniGenPolicy

POLICIES = {"full": FullPolicy, "infinigen": InfiniGenPolicy}


def make_kv_policy(name: str, **options) -> KVPolicy:
    if name not in POLICIES:
        raise ConfigError(f"unknown --kv-policy {name!r}; pick one of: {', '.join(POLICIES)}")
    return POLICIES[name](**options)


__all__ = ["InfiniGenOptions", "CacheSpec", "KVCache", "KVPolicy", "make_kv_policy", "POLICIES"]
