"""The schedule's stages: what the engine runs in order (embedding, each layer's attention
and MLP, output head) and which weights each reads; for one pipeline rank, its part."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..models import family_of
from ..models.moe import is_moe_layer


@dataclass
class Stage:
    kind: str  # "embed", "attn", "mlp", "layer" (attention + MLP) or "head"
    layer: int | None
    weights: dict[str, str]  # name the family math uses -> name in the weight store
    moe: bool = False  # an MLP of routed experts (a decode step runs it for the whole block)


def build_stages(cfg: ModelConfig, sep_layer: bool, part: "LayerSlice | None" = None
                 ) -> list[Stage]:
    """The schedule's stages of the whole model, or of one pipeline rank's ``part``: its
    layers, with the embedding only on the first rank and the head only on the last."""
    family = family_of(cfg)
    names = family.stage_weights(cfg)
    part = part or LayerSlice.whole(cfg)
    stages = [Stage("embed", None, {n: n for n in names["embed"]})] if part.embed else []
    for i in part.layers:
        layer = family.stage_weights(cfg, i)
        per = {kind: {n: f"layers.{i}.{n}" for n in layer[kind]} for kind in ("attn", "mlp")}
        if sep_layer:
            stages += [Stage("attn", i, per["attn"]),
                       Stage("mlp", i, per["mlp"], is_moe_layer(cfg, i))]
        else:
            stages.append(Stage("layer", i, {**per["attn"], **per["mlp"]}))
    if part.head:
        stages.append(Stage("head", None, {n: n for n in names["head"]}))
    return stages


@dataclass(frozen=True)
class LayerSlice:
    """The part of the model one process runs: layers ``start`` to ``stop`` (exclusive), and
    whether it embeds the tokens (the first pipeline rank) and computes the logits (the
    last). One process alone runs the whole model."""

    start: int
    stop: int
    embed: bool = True
    head: bool = True

    @classmethod
    def whole(cls, cfg: ModelConfig) -> "LayerSlice":
        return cls(0, cfg.num_layers)

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    def weight_names(self, cfg: ModelConfig) -> set[str]:
        """The weight store names this part reads (a tied embedding counts once)."""
        return {full for stage in build_stages(cfg, True, self)
                for full in stage.weights.values()}

    def borrowed_names(self, cfg: ModelConfig) -> set[str]:
        """After the first layer, the previous layer's attention norm (a vector or two),
        loaded beside this part's weights: a selecting cache's renormed query for this part's first
        layer takes it (``Rehearsal._renorm``)."""
        if self.start == 0:
            return set()
        before = LayerSlice(self.start - 1, self.start, embed=False, head=False)
        return {full for stage in build_stages(cfg, True, before)
                for full in stage.weights.values() if ".attn_norm." in full}
