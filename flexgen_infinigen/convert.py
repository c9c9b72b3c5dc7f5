"""Command line: convert a Hugging Face folder or a GGUF file into a weight store.

    python -m flexgen_infinigen.convert --checkpoint /models/opt-1.3b --out stores/opt-1.3b
    python -m flexgen_infinigen.convert --gguf model.gguf --out stores/my-llama
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import ConfigError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexgen_infinigen.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a local Hugging Face model folder (config.json + "
                                          "safetensors or .bin weights)")
    src.add_argument("--gguf", help="a GGUF file with a llama-architecture model")
    p.add_argument("--out", required=True, help="the weight store folder to write")
    p.add_argument("--name", default=None, help="model name recorded in the store")
    a = p.parse_args(argv)
    try:
        if a.checkpoint:
            from .weights.hf_convert import convert_hf
            if not Path(a.checkpoint).is_dir():
                raise ConfigError(f"--checkpoint {a.checkpoint} is not a folder")
            out = convert_hf(a.checkpoint, a.out, a.name)
        else:
            from .weights.gguf_convert import convert_gguf
            out = convert_gguf(a.gguf, a.out, a.name)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"weight store written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
