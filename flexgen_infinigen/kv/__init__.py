"""KV cache policies behind one interface (see :mod:`flexgen_infinigen.kv.base`).

``POLICIES`` is the one registry: the command lines, the optimizer, the planner and the
benchmarks read the policy names, flags, costs and reports from these classes. A new policy
is one module with a :class:`KVPolicy` subclass, plus one line here.
"""
from __future__ import annotations

import argparse

from ..config import ConfigError
from .base import CacheSpec, DecodeWork, KVCache, KVPolicy
from .full import FullPolicy
from .h2o import H2OPolicy
from .infinigen.policy import InfiniGenPolicy
from .kivi import KiviPolicy
from .infinigen.options import InfiniGenOptions
from .options import SelectionOptions
from .oracle import OraclePolicy

POLICIES: dict[str, type[KVPolicy]] = {
    cls.name: cls for cls in (FullPolicy, InfiniGenPolicy, H2OPolicy, OraclePolicy,
                               KiviPolicy)}


def policy_class(name: str, plannable: bool = False) -> type[KVPolicy]:
    """The registered class of ``name`` (one that the optimizer can plan, if asked)."""
    names = plannable_names() if plannable else list(POLICIES)
    if name in POLICIES and name not in names:
        raise ConfigError(f"the optimizer does not plan for --kv-policy {name} "
                          f"({POLICIES[name].summary}); give --percent and --gpu-batch-size "
                          f"yourself, or plan with one of: {', '.join(names)}")
    if name not in names:
        raise ConfigError(f"unknown --kv-policy {name!r}; pick one of: {', '.join(names)}")
    return POLICIES[name]


def plannable_names() -> list[str]:
    return [n for n, cls in POLICIES.items() if cls.plannable]


def make_kv_policy(name: str, **options) -> KVPolicy:
    return policy_class(name)(**options)


def add_kv_args(parser: argparse.ArgumentParser, plannable: bool = False) -> None:
    """``--kv-policy`` and every registered policy's own flags."""
    names = plannable_names() if plannable else list(POLICIES)
    parser.add_argument("--kv-policy", default="full", choices=names,
                        help="KV cache policy: " + "; ".join(
                            f"{n}: {POLICIES[n].summary}" for n in names))
    for name in names:
        POLICIES[name].add_args(parser)


def kv_policy_from_args(args: argparse.Namespace) -> KVPolicy:
    """The policy the parsed flags name, its values checked before any loading."""
    return policy_class(args.kv_policy).from_args(args)


__all__ = ["CacheSpec", "DecodeWork", "FullPolicy", "H2OPolicy", "InfiniGenOptions",
           "InfiniGenPolicy", "KVCache", "KiviPolicy", "KVPolicy", "OraclePolicy", "POLICIES",
           "SelectionOptions", "add_kv_args", "kv_policy_from_args", "make_kv_policy",
           "plannable_names", "policy_class"]
