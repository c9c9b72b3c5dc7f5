"""Everything measured on this machine for the cost model, through the runtime's own code.

Copies go through :class:`~flexgen_infinigen.tiers.Tiers` exactly as the engine makes them,
attention through :func:`~flexgen_infinigen.attention.attend`, and the per-layer overhead is
the decode step time of a tiny model run by the real engine, so the profile measures what the
runtime will see rather than what a microbenchmark could reach. By what is measured:

* :mod:`.transfers`: host<->device links, the disk, page-cache reads;
* :mod:`.compute`: matmuls, attention, dequantization, in-memory copies and gathers;
* :mod:`.overheads`: the engine's fixed cost per layer, and what offloading or a KV policy adds;
* :mod:`.machine`: all of them in turn, into a :class:`~..hardware.HardwareProfile`;
* :mod:`.cache`: the profile saved for this machine (``python -m flexgen_infinigen.profile``
  is the command line).
"""
from .cache import cache_path, cached_profile, save_to_cache, saved_profile
from .machine import measure_hardware
from .overheads import engine_overheads

__all__ = ["cache_path", "cached_profile", "engine_overheads", "measure_hardware",
           "save_to_cache", "saved_profile"]
