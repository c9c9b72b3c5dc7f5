from setuptools import find_packages, setup

setup(
    name="flexgen_infinigen",
    version="0.1.0",
    description="Offloaded LLM inference (FlexGen-style) with InfiniGen dynamic KV cache "
                "management",
    packages=find_packages(include=["flexgen_infinigen", "flexgen_infinigen.*"]),
    # the CPU kernels' C sources, compiled on first use
    package_data={"flexgen_infinigen": ["kernels/c/*.c", "kernels/c/*.h"]},
    python_requires=">=3.10",
    # PuLP 4 no longer bundles the CBC solver the optimizer uses
    install_requires=["torch>=2.1", "numpy", "tqdm", "pulp>=2.7,<4", "safetensors", "tokenizers",
                      "gguf", "huggingface_hub"],
    extras_require={"test": ["pytest", "transformers", "ruff", "lm-eval[api]>=0.4.8,<0.5",
                             # tests/test_serve.py: the server, and the official client
                             "fastapi", "uvicorn", "prometheus-client", "llguidance", "httpx",
                             "openai",
                             # tests of the benchmarks' reports, which draw their plots
                             "matplotlib",
                             # the GPU path's Triton kernel, run by Triton's interpreter
                             "triton"],
                    # python -m flexgen_infinigen.serve
                    "serve": ["fastapi", "uvicorn", "prometheus-client", "llguidance"],
                    # the lm-evaluation-harness model (flexgen_infinigen.harness)
                    "eval": ["lm-eval[api]>=0.4.8,<0.5"],
                    # accelerate: transformers loads a GGUF (the long-context reference) with it
                    "bench": ["matplotlib", "transformers", "accelerate", "jsonschema"]},
    entry_points={"console_scripts": ["flexgen-infinigen=flexgen_infinigen.run:main",
                                      "flexgen-infinigen-serve=flexgen_infinigen.serve:main",
                                      "flexgen-infinigen-eval=flexgen_infinigen.harness:main"]},
)
