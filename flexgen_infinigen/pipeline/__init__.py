"""Pipeline parallelism: the layers split over processes (GPUs, machines), micro-batches
flowing through them, over ``torch.distributed`` (NCCL between GPUs, gloo on CPUs).

Started with torchrun, one process per stage::

    torchrun --nproc-per-node 2 -m flexgen_infinigen.run --pipeline-stages 2 ...

* :mod:`.partition`: which layers each rank runs (balanced by the cost model), and the
  checks of ``--pipeline-stages``;
* :mod:`.link`: the process group, sends and receives with a time limit, bytes counted;
* :mod:`.engine`: a rank's engine (the same schedule over its layers, micro-batch by
  micro-batch);
* :mod:`.launch` and :mod:`.args`: the command line; :mod:`.report`: the ranks' report.

From Python, every rank runs::

    link = Link(torch.device("cpu"))
    part = plan_slices(cfg, link.world, policy, prompt_len, gen_len, 4, hw)[link.rank]
    lm = OffloadedLM.load(..., part=part, make_engine=rank_engine(link))
    gen = lm.generate(prompts, ...)  # the same prompts on every rank; rank 0 has the tokens
"""
from .link import Link, PipelineError
from .partition import plan_slices, split_layers

__all__ = ["Link", "PipelineError", "plan_slices", "split_layers"]
