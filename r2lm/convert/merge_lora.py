"""R2LM checkpoint + peft LoRA adapter -> one merged R2LM checkpoint (docs/design.md 7: "merge on export").

    r2lm-convert merge-lora SRC ADAPTER DST [--dtype bfloat16] [--overwrite]

SRC is the checkpoint the adapter was trained on (for hybrid conversion: stage 1's export), ADAPTER a peft folder
(adapter_config.json + adapter_model.safetensors, e.g. the final/ of a `lora.enabled` run of train/pretrain.py).
The adapter is checked against SRC before anything is merged: its weights, and SRC's, against their folder's
checksums.sha256 where it has one (an adapter written by train/pretrain.py has); its target modules must exist in
SRC, and its weights must be exactly the ones a LoRA of that configuration on SRC has (names, shapes, rank). The merge
(W += scaling * B @ A, peft's merge_and_unload) runs in fp32; the result is cast to SRC's dtype (or --dtype) and
written atomically, with SRC's tokenizer and generation config, as a plain R2LM checkpoint.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from r2lm.checkpoints import check_destination, check_finite, check_weights, read_config, read_tensors, write_checkpoint
from r2lm.configuration_r2lm import R2LMConfig
from r2lm.modeling_r2lm import R2LMForDiffusionLM

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def read_adapter(adapter: Path):
    """(LoraConfig, weights) of a peft adapter folder. Raises ValueError."""
    try:
        from peft import LoraConfig, PeftType
    except ImportError as err:
        raise ValueError(f"merge-lora needs peft (pip install 'r2lm[train]'): {err}") from None

    if not (adapter / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{adapter} is not a peft adapter folder: it has no {ADAPTER_CONFIG}")
    try:
        raw = json.loads((adapter / ADAPTER_CONFIG).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{adapter / ADAPTER_CONFIG} is not valid JSON: {err}") from None
    if raw.get("peft_type") != PeftType.LORA.value:
        raise ValueError(f"{adapter} holds a {raw.get('peft_type')!r} adapter; merge-lora merges LoRA adapters")
    try:
        config = LoraConfig.from_pretrained(str(adapter))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{adapter / ADAPTER_CONFIG} is not a usable LoRA config: {err}") from None
    if not (adapter / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{adapter} has no {ADAPTER_WEIGHTS}")
    weights = read_tensors(adapter / ADAPTER_WEIGHTS)  # verified against the adapter's checksums.sha256
    check_finite(weights, adapter)
    return config, weights


def attach(base, config, weights: dict[str, torch.Tensor], src, adapter):
    """The peft model of `base` with the adapter loaded, after checking the adapter fits `base`. Raises ValueError."""
    from peft import get_peft_model
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    try:
        model = get_peft_model(base, config)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"adapter {adapter} does not fit {src}: {err}") from None
    expected = {k: v.shape for k, v in get_peft_model_state_dict(model).items()}
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"adapter {adapter} does not fit {src}: its weights name other modules than a LoRA on "
            f"{sorted(config.target_modules)} of this model has (missing {len(missing)}: {missing[:3]}; unexpected "
            f"{len(unexpected)}: {unexpected[:3]})"
        )
    wrong = [(k, tuple(weights[k].shape), tuple(expected[k])) for k in expected if weights[k].shape != expected[k]]
    if wrong:
        name, got, want = wrong[0]
        raise ValueError(
            f"adapter {adapter} does not fit {src}: {len(wrong)} weight(s) have the wrong shape, e.g. {name} is {got} but a "
            f"rank-{config.r} LoRA of this model needs {want} (an adapter of another model, or a config whose r does not "
            "match its weights)"
        )
    set_peft_model_state_dict(model, {k: v.float() for k, v in weights.items()})
    return model


def merge_lora(src, adapter, dst, dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Write the merged checkpoint `dst`; returns it. Every check runs before `dst` is touched."""
    src, adapter = Path(src), Path(adapter)
    dst = check_destination(dst, [src, adapter], overwrite)
    if read_config(src).get("model_type") != "r2lm":
        raise ValueError(f"{src} is not an R2LM checkpoint; convert it first (r2lm-convert from-hf ...)")
    check_weights(src)
    config, weights = read_adapter(adapter)
    R2LMConfig.from_pretrained(src).check_lora_targets(config.target_modules, f"adapter {adapter}")
    base = R2LMForDiffusionLM.from_pretrained(src, dtype=torch.float32)
    check_finite(base.state_dict(), src)
    out_dtype = dtype or base.config.dtype or torch.float32
    if isinstance(out_dtype, str):
        out_dtype = getattr(torch, out_dtype)
    recorded = config.base_model_name_or_path
    if recorded and Path(recorded).resolve() != src.resolve():
        logger.warning("the adapter was trained on %s; merging it into %s", recorded, src)
    model = attach(base, config, weights, src, adapter)
    merged = model.merge_and_unload()
    if not isinstance(merged, R2LMForDiffusionLM):
        raise ValueError(f"merging left a {type(merged).__name__}, not an R2LMForDiffusionLM")
    merged = merged.to(out_dtype).eval()
    merged.config.dtype = out_dtype
    write_checkpoint(merged, dst, src, overwrite)
    logger.info("merged %d LoRA layers (r=%d, alpha=%g) of %s into %s -> %s (%s)", len(weights) // 2, config.r,
                config.lora_alpha, adapter, src, dst, str(out_dtype).removeprefix("torch."))
    return dst
