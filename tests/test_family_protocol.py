"""Every model family provides the :class:`~flexgen_infinigen.models.Family` interface: each
function with the protocol's parameters, each flag of its type; the package asks a family
for nothing else; the compiled decode call is offered to the family whose math it computes."""
from __future__ import annotations

import inspect
import re
import typing
from pathlib import Path

import pytest

from flexgen_infinigen.models import FAMILIES, Family, family_of

PACKAGE = Path(__file__).resolve().parents[1] / "flexgen_infinigen"


def _functions() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(f) for name, f in vars(Family).items()
            if inspect.isfunction(f) and not name.startswith("_")}


def _flags() -> dict[str, object]:
    return typing.get_type_hints(Family)


def _parameters(sig: inspect.Signature, drop_self: bool) -> list[tuple[str, object]]:
    params = list(sig.parameters.values())[1 if drop_self else 0:]
    return [(p.name, p.default) for p in params]


def test_the_protocol_names_what_a_family_must_provide():
    assert set(_functions()) == {"weight_shapes", "stage_weights", "encode_positions",
                                 "embed", "attn_input", "query", "attn_qkv", "attn_out",
                                 "mlp", "head", "attention_sinks",
                                 "recurrent_state_shapes", "recurrent_mix"}
    assert set(_flags()) == {"QUERY_WEIGHTS", "SKEW_FOLDS_INTO_WEIGHTS", "FUSED_DECODE"}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_provides_every_member(name):
    """Every function, with the protocol's parameter names (and defaults) in its order;
    every flag, of the protocol's type."""
    module = FAMILIES[name]
    assert isinstance(module, Family)
    for member, sig in _functions().items():
        f = getattr(module, member, None)
        assert callable(f), f"{name} has no {member}"
        assert _parameters(inspect.signature(f), False) == _parameters(sig, True), \
            f"{name}.{member}{inspect.signature(f)} is not Family.{member}{sig}"
    for member, kind in _flags().items():
        assert hasattr(module, member), f"{name} has no {member}"
        value = getattr(module, member)
        if kind is bool:
            assert isinstance(value, bool), f"{name}.{member} = {value!r}"
        else:  # tuple[str, ...]
            assert isinstance(value, tuple) and all(isinstance(v, str) for v in value)


def test_family_of_gives_the_registered_module():
    for name, module in FAMILIES.items():
        assert family_of(type("Cfg", (), {"family": name})()) is module


def test_the_compiled_decode_call_is_the_llama_familys():
    """``kernels/c/decode_layer.c`` computes a Llama layer (RMSNorm, RoPE, SwiGLU): only that
    family may take it."""
    assert {name for name, module in FAMILIES.items() if module.FUSED_DECODE} == {"llama"}


def test_the_package_asks_a_family_only_for_protocol_members():
    """Every ``family.X`` / ``fam.X`` / ``family_of(...).X`` in the package names a member of
    the protocol (what the engine and the KV policies may ask of any family)."""
    members = set(_functions()) | set(_flags())
    use = re.compile(r"(?<![@\w])(?:family|fam|family_of\([^()]*\))\.([A-Za-z_]\w*)")
    asked = {}
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "models" and path.parent.parent == PACKAGE:
            continue  # the families themselves
        for m in use.finditer(path.read_text(encoding="utf-8")):
            asked.setdefault(m.group(1), path.relative_to(PACKAGE))
    assert asked, "the search found no use at all: the pattern is stale"
    assert {n: p for n, p in asked.items() if n not in members} == {}
