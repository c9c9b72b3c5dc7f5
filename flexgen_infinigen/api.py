"""Python API: load a model under a policy, generate from a list of prompts.

    from flexgen_infinigen import OffloadedLM, Policy
    lm = OffloadedLM.load(policy=Policy(w_gpu_percent=50, w_cpu_percent=50))
    out = lm.generate(["The capital of France is"], gen_len=16)
    print(out.texts[0])
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field

import torch

from .config import ConfigError, ModelConfig
from .kv import KVPolicy, make_kv_policy
from .policy import Policy
from .runtime import memory_plan
from .runtime.engine import Engine
from .runtime.guards import raise_if_interrupted
from .runtime.loading import (find_weights, place_weights, resolve_device, resolve_dtype,
                              weight_layouts)
from .runtime.prefill_cache import PrefillCache, Prefilled
from .runtime.routing_profile import expert_order
from .runtime.stages import LayerSlice
from .runtime.tiers import TIERS, Tiers
from .sampling import ForcedTokens, RepetitionPenalty, Sampler, SamplingConfig


@dataclass
class Generation:
    token_ids: list[list[int]]  # generated ids, one list per prompt (stop token included)
    texts: list[str]
    prefill_latency_s: float
    decode_latency_s: float
    num_prompts: int
    prompt_tokens: int
    generated_tokens: int  # per prompt: steps run (the longest block), or projected
    projected: bool = False  # decode latency extrapolated from --cut-gen-len steps
    logits: list[torch.Tensor] = field(default_factory=list)  # per prompt [steps, vocab]
    step_times: list[float] = field(default_factory=list)  # wall time of every iteration
    prompt_texts: list[str] = field(default_factory=list)
    decode_tokens: int | None = None  # tokens the decode steps made (rows x steps actually run)
    prefill_link_bytes: dict[str, int] = field(default_factory=dict)  # per link, prefill steps
    prefills_reused: int = 0  # blocks that started from a kept prefill (``prefill_cache``)


class OffloadedLM:
    def __init__(self, cfg: ModelConfig, engine: Engine, tokenizer, tiers: Tiers):
        self.cfg, self.engine, self.tokenizer, self.tiers = cfg, engine, tokenizer, tiers
        self.load_time_s = 0.0
        self.store_path = None
        # weights kept as a quantized file's codes: a CodeLayout by name; and every
        # stored tensor's format (Q4_1, F32, ...), for the report
        self.weight_layouts: dict = {}
        self.weight_formats: dict[str, str] = {}

    @classmethod
    def load(cls, model: str | None = None, path: str | None = None, dummy: bool = False,
             policy: Policy | None = None, device: str = "auto", dtype: str | None = None,
             kv_policy: str | KVPolicy = "full", kv_options: dict | None = None,
             offload_dir: str | None = None, seed: int = 0, progress: bool = True,
             max_len_hint: tuple[int, int] | None = None, part: LayerSlice | None = None,
             make_engine: Callable[..., Engine] = Engine,
             expert_profile: str | None = None) -> "OffloadedLM":
        """Find the weights, check that the policy fits, and place the weights on the tiers.

        ``kv_policy``: a :class:`~.kv.base.KVPolicy` (``InfiniGenPolicy(max_kv_fraction=0.2)``)
        or a registered name with its ``kv_options``. ``max_len_hint`` = (prompt_len, gen_len)
        lets the memory check include the KV cache. ``part`` and ``make_engine``: one rank
        of a pipeline loads and runs only its layers, with an engine that talks to the other
        ranks (:func:`.pipeline.engine.rank_engine`; this module knows nothing of them).
        ``expert_profile``: a routing profile (:mod:`.runtime.routing_profile`) whose
        most-read experts take the fastest tiers of the policy's expert split.
        """
        start = time.perf_counter()
        policy = (policy or Policy()).validate()
        dev = resolve_device(device)
        if policy.overlap is None:
            policy = dataclasses.replace(policy, overlap=dev.type == "cuda" or policy.uses_disk)
        torch_dtype = resolve_dtype(dtype, dev)
        if isinstance(kv_policy, KVPolicy):
            if kv_options:
                raise ConfigError("kv_options go with a policy name; a policy object carries "
                                  "its own options")
            kv = kv_policy
        else:
            kv = make_kv_policy(kv_policy, **(kv_options or {}))
        kv.check_placement(policy.cpu_cache_compute)
        cfg, source, store = find_weights(model, path, dummy, seed, progress)
        if policy.cpu_expert_compute and not cfg.num_experts:
            raise ConfigError(f"--cpu-expert-compute needs a mixture-of-experts model; "
                              f"{cfg.name} has no routed experts (drop the flag)")
        if max_len_hint is not None:
            check_lengths(cfg, *max_len_hint)
        order = expert_order(expert_profile, cfg) if expert_profile else None
        layouts = weight_layouts(source, cfg)
        if policy.sep_layer is None:
            policy = dataclasses.replace(policy, sep_layer=not memory_plan.one_stage_a_layer(
                cfg, policy, dev, layouts))
        need = memory_plan.plan(cfg, policy, torch_dtype, *(max_len_hint or (1, 1)), kv=kv,
                                part=part, device=dev, layouts=layouts)
        memory_plan.check_fit(need, memory_plan.available(dev, offload_dir), dev)
        tiers = Tiers(dev, offload_dir, direct_io=policy.direct_io,
                      host_in_place=policy.host_in_place)
        try:
            names = (part.weight_names(cfg) | part.borrowed_names(cfg)
                     if part is not None else None)
            weights = place_weights(cfg, source, policy, tiers, torch_dtype, progress, names,
                                    expert_order=order)
        except BaseException:
            tiers.close()
            raise
        engine = make_engine(cfg, weights, policy, tiers, kv, torch_dtype, part)
        tokenizer = None
        if store is not None:
            from .text.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(store.path, cfg)
        lm = cls(cfg, engine, tokenizer, tiers)
        lm.store_path = store.path if store is not None else None
        lm.weight_layouts = layouts
        lm.weight_formats = source.formats() if hasattr(source, "formats") else {}
        try:
            lm.use_kv_policy(kv)
        except BaseException:
            tiers.close()
            raise
        lm.load_time_s = time.perf_counter() - start
        return lm

    def use_kv_policy(self, kv: KVPolicy) -> None:
        """Run with ``kv`` from now on (the weights stay where they are): its placement is
        checked, it takes what it needs from the model (InfiniGen: its skew), and the byte
        ledger restarts, so that it counts generation, not set-up."""
        kv.check_placement(self.policy.cpu_cache_compute)
        kv.prepare(self)
        self.engine.kv_policy = kv
        self.tiers.reset_counters()

    @property
    def stop_token_ids(self) -> set[int]:
        """What ends a sequence: the model's EOS and, with a tokenizer, the end of a chat turn
        (``<|im_end|>``, ``<|eot_id|>``, the GGUF's end-of-turn id)."""
        extra = self.tokenizer.stop_token_ids if self.tokenizer is not None else set()
        return {self.cfg.eos_token_id, *extra}

    @property
    def policy(self) -> Policy:
        return self.engine.policy

    def close(self) -> None:
        self.tiers.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- generation -------------------------------------------------------------------------
    def encode(self, prompts) -> list[list[int]]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ConfigError("this model has no tokenizer (dummy weights); "
                                      "give prompts as token ids or use --prompt-len")
                p = self.tokenizer.encode(p)
            if len(p) == 0:
                raise ConfigError("a prompt is empty; give at least one token")
            out.append(list(p))
        return out

    def generate(self, prompts, gen_len: int = 32, sampling: SamplingConfig | None = None,
                 stop_token_id: int | None = -1, cut_gen_len: int | None = None,
                 keep_logits: bool = False, progress: bool = False,
                 forced=None, prefill_cache: PrefillCache | None = None,
                 on_tokens: Callable[[int, list[int | None]], None] | None = None) -> Generation:
        """Generate ``gen_len`` tokens for each prompt (strings or token id lists).

        ``stop_token_id``: -1 means the model's stop tokens (:attr:`stop_token_ids`); None
        never stops.
        ``cut_gen_len``: run only that many steps and project the decode latency to ``gen_len``.
        ``forced``: teacher forcing; one list of ``gen_len`` tokens per prompt that are fed
        back instead of the sampled ones (the logits still score them).
        ``prefill_cache``: keep each block's prefill there, and start from a kept one when the
        same prompts come again (any KV policy that needs no prompt queries; see
        :mod:`.prefill_cache`).
        ``on_tokens(first, tokens)``: called at every step with the new token of each prompt
        of the block that starts at prompt ``first`` (None for a prompt that has ended):
        streaming (see also :meth:`stream`).
        """
        if prefill_cache is not None and not self.engine.reuses_prefill:
            raise ConfigError("a pipeline rank cannot start from a kept prefill; drop "
                              "prefill_cache")
        sampling = (sampling or SamplingConfig()).validate()
        ids = self.encode(prompts)
        if gen_len < 1:
            raise ConfigError(f"--gen-len must be at least 1 (got {gen_len})")
        if cut_gen_len is not None and cut_gen_len < 1:
            raise ConfigError(f"--cut-gen-len must be at least 1 (got {cut_gen_len})")
        check_lengths(self.cfg, max(map(len, ids)), gen_len)
        stops = self.stop_token_ids if stop_token_id == -1 else \
            set() if stop_token_id is None else {stop_token_id}
        steps = min(gen_len, cut_gen_len) if cut_gen_len else gen_len
        sampler = Sampler(sampling)
        self.engine.kv_policy.reset_stats()
        self.engine.reset_counters()
        self.tiers.reset_peak()  # the run's peaks, not loading's or calibration's
        block = self.policy.block_size
        outputs: list[list[int]] = []
        logits: list[torch.Tensor] = []
        prefill = decode = 0.0
        step_times: list[float] = []
        ran = decode_tokens = 0  # iterations run (a block stops early when every row ended)
        reused = 0  # blocks started from a kept prefill
        prefill_links: dict[str, int] = {}
        from tqdm.auto import tqdm
        bar = tqdm(total=len(ids) * steps, desc="generating", unit="tok", disable=not progress)
        for start in range(0, len(ids), block):
            chunk = ids[start:start + block]
            real = len(chunk)
            size, count = self._block_shape(real)
            chunk = chunk + [chunk[0]] * (size * count - real)  # equal GPU batches: dummy rows
            batches = self._pad_batches(chunk, size)
            rows = [[] for _ in chunk]
            done = [False] * len(chunk)
            ran_before = len(step_times)
            moved_before = _link_totals(self.tiers)

            chooser = sampler
            if sampling.repetition_penalty != 1.0:
                chooser = RepetitionPenalty(sampler, chunk, size, sampling.repetition_penalty)
            if forced is not None:
                rows_forced = [list(forced[start + r]) for r in range(real)]
                rows_forced += [rows_forced[0]] * (len(chunk) - real)
                if any(len(f) < steps for f in rows_forced):
                    raise ConfigError(f"forced tokens must have at least {steps} per prompt")
                chooser = ForcedTokens(torch.tensor([f[:steps] for f in rows_forced]), size)
            block_logits = []
            prefilled, capture, key = self._kept_prefill(prefill_cache, batches)
            reused += prefilled is not None
            with closing(self.engine.generate_block(batches, steps, chooser, keep_logits,
                                                    prefilled=prefilled,
                                                    capture=capture)) as block_steps:
                for step in block_steps:
                    step_times.append(step.seconds)
                    if step.index == 0:
                        if capture is not None:
                            prefill_cache.put(key, capture)
                        for link, n in _link_totals(self.tiers).items():
                            prefill_links[link] = prefill_links.get(link, 0) + n \
                                - moved_before[link]
                    if keep_logits:
                        block_logits.append(torch.cat(step.logits))
                    new = torch.cat(step.tokens).tolist()[:real]
                    if on_tokens is not None:
                        on_tokens(start, [None if d else t for d, t in zip(done, new)])
                    for r, t in enumerate(new):
                        if not done[r]:
                            rows[r].append(t)
                            done[r] = t in stops
                    bar.update(real)
                    raise_if_interrupted()
                    if all(done[:real]) and self.engine.stops_early:
                        break  # every real row has ended: the block stops here
            ran_here = len(step_times) - ran_before
            ran = max(ran, ran_here)
            decode_tokens += real * (ran_here - 1)
            prefill += step_times[ran_before]
            decode += sum(step_times[ran_before + 1:])
            outputs += rows[:real]
            if keep_logits:
                stacked = torch.stack(block_logits, dim=1)  # [block, steps, vocab]
                logits += list(stacked[:real])
        bar.close()
        projected = bool(cut_gen_len and cut_gen_len < gen_len)
        if projected and steps > 1:
            decode = decode / (steps - 1) * (gen_len - 1)
        texts = [self.tokenizer.decode(o) if self.tokenizer else "" for o in outputs]
        prompt_texts = [self.tokenizer.decode(p) if self.tokenizer else "" for p in ids]
        return Generation(outputs, texts, prefill, decode, len(ids), max(map(len, ids)),
                          gen_len if projected else ran, projected, logits, step_times,
                          prompt_texts, None if projected else decode_tokens, prefill_links,
                          reused)

    def stream(self, prompt, gen_len: int = 32, sampling: SamplingConfig | None = None,
               stop_token_id: int | None = -1) -> Iterator[str]:
        """One prompt's generated text, piece by piece as its tokens come (batch 1): the
        pieces join to ``generate([prompt], ...).texts[0]``. A token that holds half of a
        character waits for the rest. Stopping the iteration stops the generation."""
        from .text.incremental import TextStream

        if self.tokenizer is None:
            raise ConfigError("this model has no tokenizer (dummy weights); nothing to stream")
        sampling = (sampling or SamplingConfig()).validate()
        ids = self.encode([prompt])
        if gen_len < 1:
            raise ConfigError(f"--gen-len must be at least 1 (got {gen_len})")
        check_lengths(self.cfg, len(ids[0]), gen_len)
        stops = self.stop_token_ids if stop_token_id == -1 else \
            set() if stop_token_id is None else {stop_token_id}
        chooser = Sampler(sampling)
        if sampling.repetition_penalty != 1.0:
            chooser = RepetitionPenalty(chooser, ids, 1, sampling.repetition_penalty)
        text = TextStream(self.tokenizer)
        self.engine.kv_policy.reset_stats()
        with closing(self.engine.generate_block(self._pad_batches(ids, 1), gen_len,
                                                chooser)) as steps:
            for step in steps:
                token = int(step.tokens[0][0])
                if token in stops:
                    break
                if piece := text.add(token):
                    yield piece
                raise_if_interrupted()
        if piece := text.finish():
            yield piece

    def _kept_prefill(self, cache: PrefillCache | None, batches):
        """(prefill to start from, or None; where to keep this one's, or None; its key)."""
        if cache is None:
            return None, None, None
        key = cache.key(self, batches)
        found = None if self.engine.kv_policy.needs_prompt_queries else cache.get(key)
        return found, (Prefilled() if found is None else None), key

    def _block_shape(self, real: int) -> tuple[int, int]:
        """(rows a GPU batch, GPU batches) for a block of ``real`` prompts: the policy's when
        the block is full; a short block (the last, or a run of fewer prompts than a block)
        takes as few GPU batches as hold its prompts, shrunk to equal sizes, so it computes at
        most ``count - 1`` dummy rows instead of filling the policy's whole block."""
        b, n = self.policy.gpu_batch_size, self.policy.num_gpu_batches
        if real >= b * n:
            return b, n
        count = -(-real // b)
        return -(-real // count), count

    def _pad_batches(self, chunk: list[list[int]], size: int | None = None):
        """Left-pad a block's prompts to one length and cut it into GPU batches of ``size``
        rows (default: the policy's)."""
        length = max(map(len, chunk))
        pad = self.cfg.pad_token_id
        ids = torch.tensor([[pad] * (length - len(p)) + p for p in chunk])
        valid = torch.tensor([[False] * (length - len(p)) + [True] * len(p) for p in chunk])
        b = size or self.policy.gpu_batch_size
        return [(ids[i:i + b], valid[i:i + b]) for i in range(0, len(chunk), b)]

    # ---- sizes for the report ---------------------------------------------------------------
    def weight_bytes_by_tier(self) -> dict[str, int]:
        out = {t: 0 for t in TIERS}
        for tensor in self.engine.weights.values():
            for t, n in tensor.bytes_by_tier().items():
                out[t] += n
        return out


def _link_totals(tiers: Tiers) -> dict[str, int]:
    return {link: sum(kinds.values()) for link, kinds in tiers.bytes_moved.items()}


def check_lengths(cfg: ModelConfig, prompt_len: int, gen_len: int) -> None:
    if prompt_len < 1 or gen_len < 1:
        raise ConfigError(f"prompt length and --gen-len must be at least 1 "
                          f"(got {prompt_len} and {gen_len})")
    if prompt_len + gen_len > cfg.max_positions:
        raise ConfigError(
            f"prompt ({prompt_len} tokens) plus --gen-len ({gen_len}) is {prompt_len + gen_len}, "
            f"over {cfg.name}'s maximum of {cfg.max_positions} positions; shorten one of them")
