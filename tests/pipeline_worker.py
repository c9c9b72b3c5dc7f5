"""One rank of a pipeline run by tests/test_pipeline.py (started with torchrun's
environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Loads the model once per case
list entry and writes rank 0's tokens and logits of every (KV policy, micro-batches) run."""
from __future__ import annotations

import json
import sys

import torch


def main(spec_path: str, out_dir: str) -> None:
    from flexgen_infinigen.api import OffloadedLM
    from flexgen_infinigen.kv import make_kv_policy
    from flexgen_infinigen.pipeline import Link, plan_slices
    from flexgen_infinigen.pipeline.engine import rank_engine
    from flexgen_infinigen.planner.hardware import BUILTIN
    from flexgen_infinigen.placement import Placement
    from flexgen_infinigen.sampling import SamplingConfig

    spec = json.load(open(spec_path))
    link = Link(torch.device("cpu"), timeout_s=120)
    for model in spec["models"]:
        policy = Placement.from_percent(model["percent"], gpu_batch_size=model["batch"],
                                     num_gpu_batches=model["gpu_batches"])
        from flexgen_infinigen.engine.loading import find_weights
        cfg = find_weights(model["model"], model["path"], model["dummy"], progress=False)[0]
        part = plan_slices(cfg, link.world, policy, model["prompt_len"], model["gen_len"], 4,
                           BUILTIN["t4-pcie3"])[link.rank]
        lm = OffloadedLM.load(model["model"], model["path"], model["dummy"], policy,
                              device="cpu", offload_dir=model["offload_dir"], progress=False,
                              part=part, make_engine=rank_engine(link))
        with lm:
            for kv in model["kv_policies"]:
                lm.use_kv_policy(make_kv_policy(kv["name"], **kv["options"]))
                for k in model["micro_batches"]:
                    lm.engine.micro_batches = k
                    gen = lm.generate(model["prompts"], model["gen_len"], SamplingConfig(),
                                      stop_token_id=None, keep_logits=True)
                    if link.is_first:
                        name = f"{model['name']}-{kv['name']}-{k}"
                        torch.save({"tokens": gen.token_ids,
                                    "logits": torch.stack(gen.logits),
                                    "part": [part.start, part.stop]},
                                   f"{out_dir}/{name}.pt")
    link.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
