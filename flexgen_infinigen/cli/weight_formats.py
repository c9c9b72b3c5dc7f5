"""The report's account of how the weights are held: each tensor class's format
(``Q4_1 (attention, MLP), Q8_0 (embedding), F32 (norms)``)."""
from __future__ import annotations

CLASSES = (  # (class, what a weight's name ends with), the first match wins
    ("embedding", ("embed.weight",)), ("head", ("lm_head.weight",)),
    ("attention", ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "out_proj.weight")),
    ("MLP", ("gate_proj.weight", "up_proj.weight", "down_proj.weight", "fc1.weight",
             "fc2.weight")),
    ("norms", ("norm.weight", "norm.bias", "layer_norm.weight", "layer_norm.bias")),
    ("biases", (".bias",)),
)
RUNTIME_4BIT = "4-bit/64 (--compress-weight)"


def tensor_class(name: str) -> str:
    if ".experts." in name or name.startswith("experts."):  # a MoE layer's routed experts
        return "experts"
    if name.endswith(("router.weight", "shared_expert_gate.weight")):  # routing and gating
        return "router"
    for label, ends in CLASSES:
        if name.endswith(ends):
            return label
    return "other"


def weight_formats(names, formats: dict[str, str], layouts: dict, compress_weight: bool,
                   compressible) -> dict:
    """``{"summary": str, "by_class": {class: [formats]}, "compress_weight": note}`` of the
    weights ``names``: their stored format (``formats``, a store's; F32 when unknown, as
    dummy weights are), or the runtime's 4-bit groups where ``--compress-weight`` packed
    floats (``compressible(name)``). ``--compress-weight`` over codes a file brought
    (``layouts`` not empty) changes nothing, and the note says so."""
    coded = bool(layouts)
    by_format: dict[str, list[str]] = {}
    by_class: dict[str, list[str]] = {}
    for name in names:
        fmt = formats.get(name, "F32")
        if compress_weight and not coded and compressible(name):
            fmt = RUNTIME_4BIT
        cls = tensor_class(name)
        by_format.setdefault(fmt, [])
        if cls not in by_format[fmt]:
            by_format[fmt].append(cls)
        if fmt not in by_class.setdefault(cls, []):
            by_class[cls].append(fmt)
    summary = ", ".join(f"{fmt} ({', '.join(classes)})" for fmt, classes in by_format.items())
    note = None
    if compress_weight and coded:
        note = ("ignored: the weights are already quantized in the file; they are kept as "
                "its codes")
    return {"summary": summary, "by_class": by_class, "compress_weight": note}
