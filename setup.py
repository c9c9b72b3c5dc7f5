from setuptools import find_packages, setup

setup(
    name="flexgen_infinigen",
    version="0.1.0",
    description="Offloaded LLM inference (FlexGen-style) with InfiniGen dynamic KV cache "
                "management",
    packages=find_packages(include=["flexgen_infinigen", "flexgen_infinigen.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.1", "numpy", "tqdm", "pulp", "safetensors", "tokenizers", "gguf"],
    extras_require={"test": ["pytest", "transformers", "ruff"],
                    "bench": ["matplotlib", "transformers"]},
    entry_points={"console_scripts": ["flexgen-infinigen=flexgen_infinigen.run:main"]},
)
