"""Python API: load a model under a placement, generate from a list of prompts.

    from flexgen_infinigen import OffloadedLM, Placement
    lm = OffloadedLM.load(policy=Placement(w_gpu_percent=50, w_cpu_percent=50))
    out = lm.generate(["The capital of France is"], gen_len=16)
    print(out.texts[0])
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import closing

import torch

from .config import ConfigError, ModelConfig
from .kv import KVPolicy, make_kv_policy
from .kv.base import PolicyContext, PromptRecorder
from .placement import Placement
from .engine import memory_plan
from .engine.schedule import Engine
from .guards import raise_if_interrupted
from .engine.loading import (
    find_weights,
    place_weights,
    resolve_device,
    resolve_dtype,
    weight_layouts,
)
from .engine.prefill_cache import PrefillCache, Prefilled
from .engine.routing_profile import expert_order
from .engine.stages import LayerSlice
from .generation import BlockResult, BlockRun, Generation, check_lengths, link_totals
from .memory.tiers import TIERS, Tiers
from .sampling import ForcedTokens, RepetitionPenalty, Sampler, SamplingConfig


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
             policy: Placement | None = None, device: str = "auto", dtype: str | None = None,
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
        ``expert_profile``: a routing profile (:mod:`.engine.routing_profile`) whose
        most-read experts take the fastest tiers of the policy's expert split.
        """
        start = time.perf_counter()
        policy = (policy or Placement()).validate()
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
        kv.check_model(cfg)
        if policy.cpu_expert_compute and not cfg.num_experts:
            raise ConfigError(f"--cpu-expert-compute needs a mixture-of-experts model; "
                              f"{cfg.name} has no routed experts (drop the flag)")
        if max_len_hint is not None:
            check_lengths(cfg, *max_len_hint)
        order = expert_order(expert_profile, cfg) if expert_profile else None
        layouts = weight_layouts(source, cfg, native=dev.type != "cuda")
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
                                    expert_order=order, layouts=layouts)
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
        kv.check_model(self.cfg)
        kv.prepare(self.policy_context())
        self.engine.kv_policy = kv
        self.tiers.reset_counters()

    def policy_context(self) -> PolicyContext:
        """What a KV policy may take from this model when it prepares: never the model or its
        engine, but what they hold, and a prompt pass that records instead of caching."""
        engine = self.engine

        def run_prompt(ids: torch.Tensor, valid: torch.Tensor, record: PromptRecorder) -> None:
            for _ in engine.generate_block([(ids, valid)], 1, Sampler(SamplingConfig()),
                                           record=record):
                pass
        return PolicyContext(
            cfg=self.cfg, placement=self.policy, tiers=self.tiers, dtype=engine.dtype,
            family=engine.family, weights=engine.weights, layers=engine.part.layers,
            store_path=self.store_path, tokenizer=self.tokenizer, run_prompt=run_prompt,
            any_rank=engine.any_rank)

    @property
    def stop_token_ids(self) -> set[int]:
        """What ends a sequence: the model's EOS and, with a tokenizer, the end of a chat turn
        (``<|im_end|>``, ``<|eot_id|>``, the GGUF's end-of-turn id)."""
        if self.tokenizer is None:
            return {self.cfg.eos_token_id}
        return {self.cfg.eos_token_id, *self.tokenizer.stop_token_ids} - \
            self.tokenizer.never_stop

    @property
    def dtype(self) -> torch.dtype:
        """The runtime dtype (what a kept prefill's key holds)."""
        return self.engine.dtype

    @property
    def policy(self) -> Placement:
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
        :mod:`flexgen_infinigen.engine.prefill_cache`).
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
        steps = min(gen_len, cut_gen_len) if cut_gen_len else gen_len
        sampler = Sampler(sampling)
        self.engine.kv_policy.reset_stats()
        self.engine.reset_counters()
        self.tiers.reset_peak()  # the run's peaks, not loading's or calibration's
        from tqdm.auto import tqdm
        bar = tqdm(total=len(ids) * steps, desc="generating", unit="tok", disable=not progress)
        run = BlockRun(steps, sampler, self._stops(stop_token_id), keep_logits, forced,
                   prefill_cache, on_tokens, bar)
        block = self.policy.block_size
        blocks = [self._block(run, start, ids[start:start + block])
                  for start in range(0, len(ids), block)]
        bar.close()
        prefill = decode = 0.0
        links: dict[str, int] = {}
        for b in blocks:
            prefill += b.times[0]
            decode += sum(b.times[1:])
            for link, n in b.link_bytes.items():
                links[link] = links.get(link, 0) + n
        projected = bool(cut_gen_len and cut_gen_len < gen_len)
        if projected and steps > 1:
            decode = decode / (steps - 1) * (gen_len - 1)
        outputs = [row for b in blocks for row in b.rows]
        ran = max(len(b.times) for b in blocks)  # a block stops early when every row ended
        decode_tokens = sum(len(b.rows) * (len(b.times) - 1) for b in blocks)
        text = self.tokenizer.decode if self.tokenizer else (lambda _: "")
        return Generation(
            token_ids=outputs, texts=[text(o) for o in outputs], prefill_latency_s=prefill,
            decode_latency_s=decode, num_prompts=len(ids), prompt_tokens=max(map(len, ids)),
            generated_tokens=gen_len if projected else ran, projected=projected,
            logits=[x for b in blocks for x in b.logits],
            step_times=[t for b in blocks for t in b.times],
            prompt_texts=[text(p) for p in ids],
            decode_tokens=None if projected else decode_tokens, prefill_link_bytes=links,
            prefills_reused=sum(b.reused for b in blocks))

    def _block(self, run: BlockRun, start: int, chunk: list[list[int]]) -> BlockResult:
        """Generate for one block of prompts, ``chunk``, the first being prompt ``start``."""
        real = len(chunk)
        size, count = self._block_shape(real)
        chunk = chunk + [chunk[0]] * (size * count - real)  # equal GPU batches: dummy rows
        batches = self._pad_batches(chunk, size)
        rows: list[list[int]] = [[] for _ in chunk]
        done = [False] * len(chunk)
        moved_before = link_totals(self.tiers)
        chooser, penalty = run.sampler, run.sampler.config.repetition_penalty
        if penalty != 1.0:
            chooser = RepetitionPenalty(run.sampler, chunk, size, penalty)
        if run.forced is not None:
            rows_forced = [list(run.forced[start + r]) for r in range(real)]
            rows_forced += [rows_forced[0]] * (len(chunk) - real)
            if any(len(f) < run.steps for f in rows_forced):
                raise ConfigError(f"forced tokens must have at least {run.steps} per prompt")
            chooser = ForcedTokens(torch.tensor([f[:run.steps] for f in rows_forced]), size)
        logits, times, links = [], [], {}
        prefilled, capture, key = self._kept_prefill(run.prefill_cache, batches)
        with closing(self.engine.generate_block(batches, run.steps, chooser, run.keep_logits,
                                                prefilled=prefilled,
                                                capture=capture)) as block_steps:
            for step in block_steps:
                times.append(step.seconds)
                if step.index == 0:
                    if capture is not None:
                        run.prefill_cache.put(key, capture)
                    links = {link: n - moved_before[link]
                             for link, n in link_totals(self.tiers).items()}
                if run.keep_logits:
                    logits.append(torch.cat(step.logits))
                new = torch.cat(step.tokens).tolist()[:real]
                if run.on_tokens is not None:
                    run.on_tokens(start, [None if d else t for d, t in zip(done, new)])
                for r, t in enumerate(new):
                    if not done[r]:
                        rows[r].append(t)
                        done[r] = t in run.stops
                run.bar.update(real)
                raise_if_interrupted()
                if all(done[:real]) and self.engine.stops_early:
                    break  # every real row has ended: the block stops here
        kept = list(torch.stack(logits, dim=1)[:real]) if run.keep_logits else []
        return BlockResult(rows[:real], kept, times, links, prefilled is not None)

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
        stops = self._stops(stop_token_id)
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

    def _stops(self, stop_token_id: int | None) -> set[int]:
        """What ends a row: -1 the model's stop tokens, None nothing, else that token."""
        return self.stop_token_ids if stop_token_id == -1 else \
            set() if stop_token_id is None else {stop_token_id}

    def _kept_prefill(self, cache: PrefillCache | None, batches):
        """(prefill to start from, or None; where to keep this one's, or None; its key)."""
        if cache is None or self.cfg.linear_layers:  # a recurrent state is not K/V columns
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

    def _pad_batches(self, chunk: list[list[int]], size: int | None = None,
                     length: int | None = None):
        """Left-pad a block's prompts to one length (``length``, default the longest's) and
        cut it into GPU batches of ``size`` rows (default: the policy's)."""
        length = length or max(map(len, chunk))
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
