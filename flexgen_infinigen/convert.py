"""Command line: convert a Hugging Face folder or a GGUF file into a weight store.

    python -m flexgen_infinigen.convert --checkpoint /models/Llama-3.1-8B
    python -m flexgen_infinigen.run --path stores/Llama-3.1-8B --dtype bfloat16
    python -m flexgen_infinigen.convert --gguf model.gguf --out stores/my-llama

Families: OPT, Llama 1/2/3/3.1/3.2/3.3 (RoPE scaling linear and llama3), Mistral (sliding
window), Qwen2/2.5 (q/k/v biases), Qwen3 (q/k norms); GGUF: llama and qwen2 architectures.
A config field that would change the math and is not computed here is refused by name.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import ConfigError
from .guards import run_command


def main(argv=None) -> int:
    return run_command(_main, argv)


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexgen_infinigen.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a local Hugging Face model folder (config.json + "
                                          "safetensors or .bin weights)")
    src.add_argument("--gguf", help="a GGUF file with a llama- or qwen2-architecture model")
    p.add_argument("--out", default=None,
                   help="the weight store folder to write (default: stores/<source name>)")
    p.add_argument("--name", default=None, help="model name recorded in the store")
    p.add_argument("--pre-tokenizer", default=None, metavar="TYPE",
                   help="GGUF only: split text with the rule of this tokenizer.ggml.pre type "
                        "instead of the file's (for types this runtime does not know)")
    p.add_argument("--allow-field", action="append", default=[], metavar="FIELD",
                   help="a config.json field to accept although it is not understood (only "
                        "when you know it does not change the math); repeatable")
    a = p.parse_args(argv)
    source = Path(a.checkpoint or a.gguf)
    out = a.out or str(Path("stores") / (source.stem if a.gguf else source.resolve().name))
    if a.checkpoint:
        from .weights.hf_convert import convert_hf
        if not source.is_dir():
            raise ConfigError(f"--checkpoint {a.checkpoint} is not a folder")
        out = convert_hf(source, out, a.name, tuple(a.allow_field))
    else:
        from .weights.gguf_convert import convert_gguf
        out = convert_gguf(source, out, a.name, pre_tokenizer=a.pre_tokenizer)
    print(f"weight store written to {out}; run it with "
          f"`python -m flexgen_infinigen.run --path {out}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
