"""Command line: calibrate InfiniGen for a model (its skewing matrices) and store the result with
the model (``python -m flexgen_infinigen.skew`` is the old name, kept for one release).

    python -m flexgen_infinigen.calibrate                       # the default model, built-in text
    python -m flexgen_infinigen.calibrate --path stores/opt-1.3b --calibration wiki.txt

The matrices go to ``<store>/infinigen/``; ``--kv-policy infinigen`` uses them from then on.
Without them a run calibrates on the built-in text (or ``--calibration``) and keeps the result
in ``<store>/infinigen-calibrations/``, where later runs with the same text, weights,
placement, dtype and thread count find it instead of calibrating again.
"""
from __future__ import annotations

import argparse
import sys

from .cli.args import add_offline_arg
from .config import ConfigError, read_text
from .guards import run_command


def main(argv=None, prog: str = "python -m flexgen_infinigen.calibrate") -> int:
    return run_command(lambda args: _main(args, prog), argv)


def _main(argv=None, prog: str = "python -m flexgen_infinigen.calibrate") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a Hub name (org/name, org/name:QUANT), a .gguf file, a checkpoint "
                        "folder or a registry name (default: the embedded default)")
    add_offline_arg(p)
    p.add_argument("--path", default=None, help="the weight store to skew")
    p.add_argument("--calibration", default=None,
                   help="calibration text file (default: built-in English prose)")
    p.add_argument("--max-tokens", type=int, default=4096, help="calibration tokens used")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    a = p.parse_args(argv)
    if a.max_tokens < 8:
        raise ConfigError(f"--max-tokens must be at least 8 (got {a.max_tokens})")
    text = read_text(a.calibration, "--calibration") if a.calibration else None
    from .api import OffloadedLM
    from .kv.infinigen.skew import calibrate
    from .placement import Placement
    lm = OffloadedLM.load(model=a.model, path=a.path, device=a.device,
                          policy=Placement(w_gpu_percent=0, w_cpu_percent=100))
    with lm:
        if lm.store_path is None:
            raise ConfigError("skewing is stored with a weight store; pass --path")
        skew = calibrate(lm.policy_context(), text, a.max_tokens)
        dest = skew.save(lm.store_path)
    print(f"skew statistics ({skew.meta['tokens']} calibration tokens, {skew.meta['source']}) "
          f"written to {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
