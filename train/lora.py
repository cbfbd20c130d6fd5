"""Stage 2 of block-hybrid conversion: LoRA adapters (peft) under the diffusion loss (docs/design.md 7; LoLCATs, LLaDA-Hybrid).

    deepspeed --num_gpus 8 train/pretrain.py --config configs/train/tiny_hybrid_stage2.yaml   (lora.enabled: true)

The model is wrapped with peft's LoRA before deepspeed.initialize: adapters on `lora.target_modules` (q/k/v/o
projections by default) of every layer, as LLaDA-Hybrid does; everything else is frozen, the feature maps and gates
of the hybrid layers included. DeepSpeed checkpoints hold the wrapped model plus its adapter_config.json, so a run
resumes exactly (adapter dropout draws from a generator reseeded every micro-step, see train/trainer.py). The
export (OUTPUT_DIR/final) is the adapter alone, written with peft's save_pretrained from the last checkpoint; merge
it into the run's starting checkpoint with `python -m convert merge-lora BASE OUTPUT_DIR/final DST`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"


def lora_config(section):
    """The peft LoraConfig of a `lora:` config section (train/config.py LoraSection)."""
    from peft import LoraConfig

    return LoraConfig(r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout,
                      target_modules=list(section.target_modules), bias="none")


def check_lora(cfg, model_config) -> None:
    """Reject a LoRA run that cannot work, before any work starts (ValueError)."""
    from r2lm import R2LMForDiffusionLM

    if cfg.freeze_backbone:
        raise ValueError("lora.enabled and freeze_backbone exclude each other: with LoRA only the adapters train")
    try:
        import peft  # noqa: F401
    except ImportError as err:
        raise ValueError(f"lora.enabled needs peft (pip install peft): {err}") from None
    with torch.device("meta"):  # module names only, no memory
        model = R2LMForDiffusionLM(model_config)
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)})
    unknown = [name for name in cfg.lora.target_modules if name not in linear]
    if unknown:
        raise ValueError(f"lora.target_modules {unknown} name no linear layer of the model (it has: {', '.join(linear)})")
    model_config.check_lora_targets(cfg.lora.target_modules, "lora.target_modules")


def wrap(model, section):
    """The peft LoRA model around `model`; only the adapters are trainable."""
    from peft import get_peft_model

    wrapped = get_peft_model(model, lora_config(section))
    trainable = [name for name, p in wrapped.named_parameters() if p.requires_grad]
    wrong = [name for name in trainable if ".lora_" not in name]
    if wrong:  # peft freezes everything else; a change of that would silently train the backbone
        raise ValueError(f"LoRA left non-adapter parameters trainable: {wrong[:5]}")
    logger.info("LoRA r=%d alpha=%g dropout=%g on %s of every layer: %d adapter tensors", section.r, section.alpha,
                section.dropout, ",".join(section.target_modules), len(trainable))
    return wrapped


def base_model(module):
    """The R2LMForDiffusionLM inside a peft wrapper (or `module` itself)."""
    get = getattr(module, "get_base_model", None)
    return get() if callable(get) else module


def save_adapter_config(module, folder: Path) -> None:
    """adapter_config.json of a wrapped model into a checkpoint folder (what export_adapter needs beside the shards)."""
    module.peft_config["default"].save_pretrained(str(folder))


def export_adapter(ckpt, dst, base_dir, dtype: torch.dtype = torch.float32, overwrite: bool = False) -> Path:
    """The adapter of a LoRA training checkpoint (DeepSpeed, any ZeRO stage) -> peft folder `dst`, atomically.

    The frozen weights the checkpoint holds (in the dtype the run held them: a bf16 run's are bf16; ZeRO-1 saves
    none) must equal `base_dir`'s (the run's starting checkpoint): merging the adapter into that base then gives
    the trained model."""
    from peft import LoraConfig, get_peft_model

    from r2lm import R2LMForDiffusionLM
    from r2lm.checkpoints import atomic_output_dir, load_fp32_state_dict, resolve_checkpoint, verify_checkpoint

    root, tag = resolve_checkpoint(ckpt)
    folder = root / tag
    if not (folder / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{folder} is not a LoRA training checkpoint (no {ADAPTER_CONFIG})")
    verify_checkpoint(folder)
    state = load_fp32_state_dict(root, tag)
    base = R2LMForDiffusionLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig.from_pretrained(str(folder)))
    expected = model.state_dict()
    missing = sorted(k for k in set(expected) - set(state) if ".lora_" in k)
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {folder} does not match a LoRA model of {base_dir}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    moved = [k for k in state if ".lora_" not in k
             and not torch.equal(state[k], expected[k].to(state[k].dtype))]
    if moved:
        raise ValueError(f"the frozen weights of {folder} differ from {base_dir} ({moved[:3]}...): export the adapter "
                         "against the checkpoint the run started from")
    model.load_state_dict({k: v for k, v in state.items() if ".lora_" in k}, strict=False)
    model.to(dtype)
    with atomic_output_dir(dst, overwrite) as tmp:  # sealed: the umask's permissions (peft writes 0600), manifest
        model.save_pretrained(str(tmp))
    logger.info("exported the LoRA adapter of %s -> %s (merge: python -m convert merge-lora %s %s DST)", folder, dst, base_dir, dst)
    return Path(dst)
