"""InfiniGen as a KV policy: the policy and its flags (:mod:`.policy`, :mod:`.options`), the
cache of one layer and batch (:mod:`.cache`), what speculation scores against
(:mod:`.spec_keys`, :mod:`.spec_pages`), the rehearsal of the next layer's query
(:mod:`.rehearsal`, :mod:`.skew`) and the layer's step inside the fused call
(:mod:`.fused_select`).

The package's modules import :mod:`..base` and their siblings, never :mod:`flexgen_infinigen.kv`
itself (which imports this package for its registry)."""
from __future__ import annotations

from .cache import InfiniGenCache
from .options import InfiniGenOptions
from .policy import InfiniGenPolicy

__all__ = ["InfiniGenCache", "InfiniGenOptions", "InfiniGenPolicy"]
