"""An lm-evaluation-harness model over :class:`~.api.OffloadedLM`: the harness's tasks scored
under any placement and KV policy.

    import flexgen_infinigen.harness  # registers "flexgen_infinigen" with lm-eval
    lm_eval.simple_evaluate(model="flexgen_infinigen",
                            model_args="kv_policy=infinigen,max_kv_fraction=0.1", tasks=[...])

or from the shell, with every lm-eval flag: ``flexgen-infinigen-eval --model flexgen_infinigen
--model_args model=PATH.gguf,kv_policy=infinigen,percent=100 0 0 100 100 0 --tasks ...``.
``model_args`` take every model, placement and KV-policy flag of ``run`` (``percent``,
``gpu_batch_size``, ``compress_weight``, ``kv_policy``, ``max_kv_fraction``, ...; underscores
for dashes, spaces between the six percentages), plus ``max_length`` (tokens a window may
hold; default the model's limit, at most 2,048).

What a number means under a KV policy: every score goes through the real decode path, as
``eval perplexity`` does. ``loglikelihood`` prefills the context, then feeds the continuation
one token at a time through decode steps with the policy active (teacher forcing), each
step's logits scoring the next continuation token: InfiniGen selects, H2O evicts, a 4-bit
cache is read back, exactly as in generation. ``loglikelihood_rolling`` scores a document in
windows of ``max_length`` the same way (each token predicted once, the first from the BOS or
EOS token). ``generate_until`` generates greedily (or samples, if asked) and cuts at the first
stop string. Requests are sorted by length and run in blocks of the policy's block size;
a context prefilled once is reused by the requests that share it (a multiple-choice
question's choices) through an in-memory :class:`~.engine.prefill_cache.PrefillCache`.
"""
from __future__ import annotations

import argparse
import sys

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from .config import DEFAULT_MODEL, ConfigError
from .engine.prefill_cache import PrefillCache

NAME = "flexgen_infinigen"
DEFAULT_MAX_LENGTH = 2048


def _argv(options: dict) -> list[str]:
    """``run``'s command line for lm-eval's ``model_args`` (``key=value`` pairs)."""
    argv = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            truthy = value if isinstance(value, bool) else str(value).lower() == "true"
            if key in ("compress_weight", "compress_cache", "cpu_cache_compute",
                       "cpu_expert_compute", "dummy",
                       "offline"):
                if truthy:
                    argv.append(flag)
                continue
            value = str(truthy).lower()
        argv += [flag, *str(value).split()] if key == "percent" else [flag, str(value)]
    return argv


def _parser() -> argparse.ArgumentParser:
    from .cli.args import add_model_args, add_policy_args

    p = argparse.ArgumentParser(prog=NAME, add_help=False, exit_on_error=False)
    add_model_args(p)
    add_policy_args(p)
    return p


@register_model(NAME, "flexgen-infinigen")
class OffloadedHarnessLM(LM):
    def __init__(self, max_length: int | str | None = None, batch_size=None,
                 max_batch_size=None, device=None, **options):
        super().__init__()
        if batch_size not in (None, "auto") and "gpu_batch_size" not in options:
            options["gpu_batch_size"] = int(batch_size)  # lm-eval's --batch_size
        from .api import OffloadedLM
        from .cli.args import check_policy_args, policy_from_args
        from .kv import kv_policy_from_args

        try:
            a, unknown = _parser().parse_known_args(_argv(options))
        except (argparse.ArgumentError, SystemExit) as e:
            raise ConfigError(f"bad model_args for {NAME}: {e}") from None
        if unknown:
            raise ConfigError(f"unknown model_args for {NAME}: {' '.join(unknown)} (it takes "
                              "run's model, placement and KV-policy flags, and max_length)")
        if device is not None and options.get("device") is None:
            a.device = "cuda" if str(device).startswith("cuda") else "cpu"
        check_policy_args(a)
        policy, _ = policy_from_args(a)
        self.lm = OffloadedLM.load(model=a.model or (None if a.path else DEFAULT_MODEL),
                                   path=a.path, dummy=a.dummy, policy=policy, device=a.device,
                                   dtype=a.dtype, kv_policy=kv_policy_from_args(a),
                                   offload_dir=a.offload_dir, seed=a.seed)
        if self.lm.tokenizer is None:
            raise ConfigError(f"{NAME} needs a tokenizer; give a model with one (not --dummy)")
        limit = self.lm.cfg.max_positions
        self.max_length = min(int(max_length), limit) if max_length else min(
            limit, DEFAULT_MAX_LENGTH)
        self.prefills = PrefillCache(keep=8)
        self.settings = {k: v for k, v in vars(a).items()}

    # ---- tokens -----------------------------------------------------------------------------
    @property
    def prefix_token_id(self) -> int:
        tok = self.lm.tokenizer
        return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    def _encode(self, text: str) -> list[int]:
        return self.lm.tokenizer.tok.encode(text, add_special_tokens=False).ids

    def _context_ids(self, context: str) -> list[int]:
        ids = self._encode(context) if context else []
        if self.lm.tokenizer.add_bos or not ids:
            ids = [self.prefix_token_id, *ids]
        return ids

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids, tokenized together (a word split across the boundary
        is tokenized as it would be in running text); trailing spaces of the context move to
        the continuation, as the harness's own models do."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ctx = self._context_ids(context)
        whole = self._context_ids(context + continuation) if context else \
            [*ctx, *self._encode(continuation)]
        return ctx, whole[len(ctx):]

    @property
    def tokenizer_name(self) -> str:
        return str(self.lm.store_path or self.lm.cfg.name)

    def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
        from .text.chat import chat_template, render

        template = chat_template(self.lm.store_path, self.settings.get("chat_template"))
        if template is None:
            raise ConfigError(f"{self.lm.cfg.name} has no chat template; drop "
                              "--apply_chat_template")
        return render(template, chat_history, add_generation_prompt=add_generation_prompt)

    # ---- scoring ----------------------------------------------------------------------------
    def _score(self, pairs: list[tuple[list[int], list[int]]], desc: str, disable: bool):
        """(sum of log-probabilities, greedy?) of each continuation after its context, through
        the decode path; in blocks of similar lengths, longest first."""
        results = [None] * len(pairs)
        # longest contexts first, a context's requests next to each other (its prefill reused)
        order = sorted(range(len(pairs)), key=lambda i: (-len(pairs[i][0]), pairs[i][0],
                                                         -len(pairs[i][1])))
        block = self.lm.policy.block_size
        with tqdm(total=len(pairs), desc=desc, disable=disable) as bar:
            for start in range(0, len(order), block):
                chunk = order[start:start + block]
                steps = max(len(pairs[i][1]) for i in chunk)
                forced = [pairs[i][1] + [pairs[i][1][-1]] * (steps - len(pairs[i][1]))
                          for i in chunk]
                out = self.lm.generate([pairs[i][0] for i in chunk], steps,
                                       stop_token_id=None, keep_logits=True, forced=forced,
                                       prefill_cache=self.prefills)
                for i, logits in zip(chunk, out.logits):
                    cont = torch.tensor(pairs[i][1])
                    logp = torch.log_softmax(logits[:len(cont)].float(), dim=-1)
                    picked = logp[torch.arange(len(cont)), cont]
                    greedy = bool((logp.argmax(-1) == cont).all())
                    results[i] = (float(picked.sum()), greedy)
                bar.update(len(chunk))
        return results

    def _fit(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        """Cut the context from the left so that context + continuation fit ``max_length``."""
        room = self.max_length - len(cont)
        if room < 1:
            raise ConfigError(f"a continuation of {len(cont)} tokens does not fit max_length "
                              f"{self.max_length}")
        return ctx[-room:], cont

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        pairs = [self._fit(*self._split(*r.args)) for r in requests]
        return self._score(pairs, "loglikelihood", disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        pairs, owner = [], []
        for n, r in enumerate(requests):
            windows = get_rolling_token_windows(self._encode(r.args[0]), self.prefix_token_id,
                                                self.max_length, 1)
            for ctx, cont in map(make_disjoint_window, windows):
                pairs.append((list(ctx), list(cont)))
                owner.append(n)
        scores = self._score(pairs, "loglikelihood_rolling", disable_tqdm)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, scores):
            totals[n] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False):
        from .sampling import SamplingConfig

        out = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        stops = {}
        for i, r in enumerate(requests):
            kw = dict(r.args[1] or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            steps = int(kw.pop("max_gen_toks", 256))
            sample = bool(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 1.0 if sample else 0.0)) if sample else 0.0
            top_p = float(kw.pop("top_p", 1.0)) if sample else 1.0
            groups.setdefault((steps, temperature, top_p), []).append(i)
            stops[i] = until
        block = self.lm.policy.block_size
        with tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm) as bar:
            for (steps, temperature, top_p), members in groups.items():
                sampling = SamplingConfig(temperature, top_p, self.settings["seed"])
                members.sort(key=lambda i: -len(requests[i].args[0]))
                for start in range(0, len(members), block):
                    chunk = members[start:start + block]
                    ids = []
                    for i in chunk:
                        ctx = self._context_ids(requests[i].args[0])
                        ids.append(ctx[-max(1, self.max_length - steps):])
                    gen = self.lm.generate(ids, steps, sampling)
                    for i, text in zip(chunk, gen.texts):
                        cuts = [text.find(s) for s in stops[i] if s and s in text]
                        out[i] = text[:min(cuts)] if cuts else text
                    bar.update(len(chunk))
        return out


def main() -> None:
    """``flexgen-infinigen-eval``: lm-eval's own command line with this model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    sys.exit(main())
