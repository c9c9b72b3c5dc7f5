"""Where a stage's weights come from, and where its routed experts are multiplied.

:class:`StageReads` gives each schedule stage its weights for compute (``load``): dense
weights read anew from their tier, routed experts as handles read only when a token picks
them (:class:`OnDemand`), or as the stored tensors where the compute device reads them in
place (made once per stage and kept), or counted (:class:`CountedRead`) while a routing
profile records; with ``--cpu-expert-compute``, a decode step's experts held whole in CPU
memory as :class:`OnHost` handles (``on_host``). A MoE stage's weights carry a
:class:`StageExperts` under :data:`~..models.moe.RUNNER`: the expert runner the MoE math
hands the routed tokens to (``models/moe.py`` routes and multiplies; this module decides
where the matrices come from and where they are multiplied).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ..memory import codes
from ..memory.split_tensor import SplitTensor
from ..memory.tiers import DEVICE, DISK, HOST
from ..models import moe
from .expert_homes import expert_of
from .stages import Stage

EXPERT_READERS = 4  # routed experts read from disk at once
# an expert is counted through one of its matrices (the math reads all three when routed to)
COUNTED_MATRIX = "gate_proj.weight"


class OnDemand:
    """A weight read for compute only when the math first asks for it (:meth:`get`), then
    kept: a routed expert, read by a stage only when a token is routed to it. :meth:`start`
    begins a read from disk in the background, so that the reads of every expert a stage's
    tokens chose are in flight together (a disk serves several small requests at once
    faster than one after another)."""

    def __init__(self, tensor: SplitTensor):
        self.tensor, self._value, self._pending = tensor, None, None

    def start(self) -> None:
        if self._value is None and self._pending is None and any(
                seg.tier == DISK for seg in self.tensor.segments):
            self._pending = _readers().submit(self.tensor.read_for_compute)

    def get(self):
        if self._value is None:
            pending, self._pending = self._pending, None
            self._value = pending.result() if pending is not None \
                else self.tensor.read_for_compute()
        return self._value


class CountedRead(OnDemand):
    """An expert matrix's handle that counts the stage in ``counts[key]`` when the math first
    reads it (``counted``: the one matrix of the expert that counts); the read itself is
    :class:`OnDemand`'s (for an expert on the device: in place)."""

    def __init__(self, tensor: SplitTensor, counts: dict, key: tuple[int, int],
                 counted: bool = True):
        super().__init__(tensor)
        self.counts, self.key, self._counted = counts, key, not counted

    def get(self):
        if not self._counted:
            self._counted = True
            self.counts[self.key] = self.counts.get(self.key, 0) + 1
        return super().get()


class OnHost:
    """A routed expert held whole in CPU memory that the CPU multiplies where it is
    (``--cpu-expert-compute``): the tokens' rows go to the host instead of the expert to the
    compute device. ``value`` is the stored tensor as a CPU multiplies it (4-bit codes as a
    float32 :class:`~..memory.codes.PackedWeight`: the CPU kernels' form); nothing is copied
    or counted here, the activations' crossings are (:meth:`to_host`, :meth:`to_compute`)."""

    def __init__(self, tensor: SplitTensor):
        assert len(tensor.segments) == 1 and tensor.segments[0].tier == HOST
        data = tensor.segments[0].data
        self.tiers = tensor.tiers
        self.value = codes.PackedWeight(data, torch.float32) if tensor.compressed else data

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return self.tiers.to_host(t, DEVICE, "activations")

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        return self.tiers.to_compute(t, HOST, "activations")


def fetch(weight):
    """A matrix the math can multiply: an :class:`OnDemand` handle is read (once), an
    :class:`OnHost` one gives the stored tensor (for the host's own math)."""
    if isinstance(weight, OnDemand):
        return weight.get()
    return weight.value if isinstance(weight, OnHost) else weight


class StageExperts:
    """The expert runner (:class:`~..models.moe.ExpertRunner`) of one load of a stage's
    weights ``w``: the experts held :class:`OnHost` take their tokens there; the others are
    brought to the compute device, every disk read of them started before the first is
    needed. ``w`` is read when called, so handles put in it after the load count."""

    def __init__(self, w: dict):
        self.w = w

    def _handle(self, e: int, m: str):
        return self.w[moe.expert_matrix(e, m)]

    def matrices(self, e: int) -> list:
        return [fetch(self.w[n]) for n in moe.expert_parts(e, self.w)]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 used: list[int], expert=None) -> torch.Tensor:
        on_host = [e for e in used if isinstance(self._handle(e, moe.EXPERT_MATRICES[0]),
                                                 OnHost)]
        here = [e for e in used if e not in on_host] if on_host else used
        for e in here:  # reads from disk all in flight before the first is needed
            for n in moe.expert_parts(e, self.w):
                handle = self.w[n]
                if isinstance(handle, OnDemand):
                    handle.start()
        out = moe.apply_experts(x, weights, experts, here, self.matrices,
                                some=bool(on_host), expert=expert) if here else \
            torch.zeros_like(x)
        if on_host:
            out += self._on_host(x, weights, experts, on_host, expert)
        return out

    def _on_host(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 used: list[int], expert=None) -> torch.Tensor:
        """The experts ``used`` (:class:`OnHost`) multiplied in CPU memory: the tokens' rows
        and their routing cross to the host, the sum comes back; the experts do not move. In
        float32 on the host when the experts are codes (the CPU kernels' form)."""
        handle = self._handle(used[0], moe.EXPERT_MATRICES[0])
        rows, wts, exps = (handle.to_host(t) for t in (x, weights, experts))
        if isinstance(handle.value, codes.PackedWeight):
            rows, wts = rows.float(), wts.float()
        out = moe.apply_experts(rows, wts, exps, used, self.matrices, some=True, expert=expert)
        return handle.to_compute(out.to(x.dtype))


class StageReads:
    """Each stage's weights for compute (:meth:`load`), and its experts held in CPU memory
    for ``--cpu-expert-compute`` (:meth:`on_host`). ``routing_counts``: (layer, expert) ->
    stages that read it, while a routing profile is recorded (None: not recording)."""

    def __init__(self, weights: dict[str, SplitTensor], stages: list[Stage]):
        self.weights, self.stages = weights, stages
        self.routing_counts: dict[tuple[int, int], int] | None = None
        # per stage: (what the weights read in place give, built once; the names read anew)
        self._kept: dict[int, tuple[dict, list[tuple[str, str]]]] = {}
        self._host: dict[int, dict] = {}  # stage -> its OnHost handles

    def load(self, stage: int) -> dict:
        """Stage ``stage``'s weights for compute; routed experts off the device as handles
        that the MoE math reads only for the experts its tokens use (once for the whole
        stage: the handles are shared by its GPU batches), through the runner the weights
        carry."""
        counts = self.routing_counts
        kept = self._kept.get(stage) if counts is None else None
        fixed, rest = kept or self._split(stage)
        out = dict(fixed)
        for short, full in rest:
            t = self.weights[full]
            if t.kind == "experts" and counts is not None:
                out[short] = CountedRead(t, counts, expert_of(full),
                                         counted=full.endswith(COUNTED_MATRIX))
            else:
                out[short] = OnDemand(t) if t.kind == "experts" and not t.resident \
                    else t.read_for_compute()
        if moe.ROUTER in out:
            out[moe.RUNNER] = StageExperts(out)
        return out

    def _split(self, stage: int) -> tuple[dict, list[tuple[str, str]]]:
        """The stage's routed experts that the compute device reads where they are stored
        (on the device, or codes in CPU memory a CPU multiplies in place): their reads are
        the stored tensors themselves, move nothing and count nothing, so they are made once
        and reused every step (a MoE stage has thousands, and a step uses a few). The rest
        are read anew each time (a dense stage has a handful of weights, each read in a
        few ops). Nothing is kept while a routing profile counts reads."""
        counting = self.routing_counts is not None
        fixed, rest = {}, []
        for short, full in self.stages[stage].weights.items():
            t = self.weights[full]
            in_place = t.kind == "experts" and (t.resident or t.packed_in_place)
            if in_place and not counting:
                fixed[short] = t.read_for_compute()
            else:
                rest.append((short, full))
        if not counting:
            self._kept[stage] = fixed, rest
        return fixed, rest

    def on_host(self, stage: int, w: dict) -> dict:
        """``w`` (a load of stage ``stage``) with its routed experts held whole in CPU memory
        handed over as :class:`OnHost` (``--cpu-expert-compute``: a decode step's few tokens
        go to them rather than they to the compute device; a prompt still fetches them, its
        many tokens being faster on the device). Experts the compute device already reads
        where they are (codes a CPU multiplies in place) stay as they are."""
        handles = self._host.get(stage)
        if handles is None:
            handles = {}
            for short, full in self.stages[stage].weights.items():
                t = self.weights[full]
                if (t.kind == "experts" and not (t.resident or t.packed_in_place)
                        and len(t.segments) == 1 and t.segments[0].tier == HOST):
                    handles[short] = OnHost(t)
            self._host[stage] = handles
        w.update(handles)  # a fresh dict per stage load (:meth:`load`)
        return w


_READERS = None
_READERS_LOCK = threading.Lock()


def _readers() -> ThreadPoolExecutor:
    """Threads that read routed experts from disk ahead of the math (made on first use)."""
    global _READERS
    with _READERS_LOCK:
        if _READERS is None:
            _READERS = ThreadPoolExecutor(EXPERT_READERS, thread_name_prefix="expert-read")
        return _READERS
