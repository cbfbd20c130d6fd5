"""A DeepSpeed ZeRO training checkpoint (stage 1, 2 or 3) exported as an HF-format R2LM folder (docs/design.md section 7;
`r2lm-convert deepspeed-to-hf`, and the final/ export of train/pretrain.py).

It builds a model, so it sits above the model (r2lm.modeling_r2lm), which reads its own checkpoints through the
rest of this package: the package's __init__ does not import it (`from r2lm.checkpoints.export import ...`).

The checkpoint's files are verified against its manifest first. The fp32 master weights are then reassembled from
the per-rank shards (r2lm.checkpoints.zero), loaded into an `R2LMForDiffusionLM` built from the config saved beside
the shards, checked key by key, cast and saved with `save_pretrained` plus the tokenizer, atomically.

CKPT may be a checkpoint folder (`OUTPUT_DIR/checkpoints/step-00000500`), a checkpoints folder (its newest
complete checkpoint is used, or `tag`), or a training run folder holding `checkpoints/` (resolve_checkpoint).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from r2lm.checkpoints.hf import check_finite, has_tokenizer, read_tensors, weight_files
from r2lm.checkpoints.manifest import verify_checkpoint
from r2lm.checkpoints.training import read_state, resolve_checkpoint
from r2lm.checkpoints.writing import check_destination, write_checkpoint
from r2lm.checkpoints.zero import load_fp32_state_dict
from r2lm.configuration_r2lm import R2LMConfig
from r2lm.modeling_r2lm import R2LMForDiffusionLM

logger = logging.getLogger(__name__)


def build_model(config, state: dict[str, torch.Tensor], dtype: torch.dtype):
    """An R2LMForDiffusionLM holding exactly `state` (only a tied lm_head may be absent), in `dtype`."""
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    state = {k: v for k, v in state.items() if k not in tied}
    model, info = R2LMForDiffusionLM.from_pretrained(
        None, config=config, state_dict=state, dtype=dtype, output_loading_info=True
    )
    missing = sorted(set(info["missing_keys"]) - tied)
    if missing or info["unexpected_keys"] or info["mismatched_keys"]:
        raise ValueError(
            f"the checkpoint does not match its config: missing {missing[:5]}, unexpected {sorted(info['unexpected_keys'])[:5]}, "
            f"mismatched {list(info['mismatched_keys'])[:5]}"
        )
    return model.eval()


def restore_frozen(state: dict[str, torch.Tensor], config, folder: Path) -> None:
    """Frozen parameters (freeze_backbone, attention transfer) have no fp32 master copy: DeepSpeed saves them from
    the training module, in its dtype (a bf16 run of an fp32 model: rounded), and at ZeRO stage 1 not at all. They
    are the weights the run started from, so they are read from that model (the trainer state's model_path),
    checked against the checkpoint's copy where it has one. Checkpoints of other trainers are left as they are."""
    with torch.device("meta"):
        wanted = R2LMForDiffusionLM(config).state_dict().keys() - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    rounded = {k for k, v in state.items() if v.is_floating_point() and v.dtype != torch.float32}
    names = rounded | (wanted - state.keys())
    source = read_state(folder).get("model_path") if (folder / "trainer_state.json").is_file() else None
    if not names or source is None:
        return
    weights = {}
    for path in weight_files(Path(source)):
        weights.update(read_tensors(path, names))
    for name in sorted(names):
        if name not in weights:
            raise ValueError(f"{folder} holds {name} only in {state[name].dtype if name in state else 'no copy'}, and "
                             f"the model the run started from ({source}) has none")
        if name in rounded and not torch.equal(state[name], weights[name].to(state[name].dtype)):
            raise ValueError(f"the frozen {name} of {folder} is not that of the model the run started from ({source}): "
                             "that folder changed since the run")
        state[name] = weights[name]


def parameter_bytes(config, dtype: torch.dtype) -> int:
    """The size of the model's weights in `dtype`, counted on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = R2LMForDiffusionLM._from_config(config, dtype=dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def export_deepspeed_checkpoint(ckpt, dst, tag=None, dtype: torch.dtype | None = None, model_config=None, overwrite=False) -> Path:
    """Write the HF-format R2LM folder `dst` from a DeepSpeed checkpoint; returns `dst`.

    model_config: a folder with config.json (and tokenizer) to use when the checkpoint has none beside it."""
    root, tag = resolve_checkpoint(ckpt, tag)
    folder = root / tag
    if (folder / "adapter_config.json").is_file():
        raise ValueError(
            f"{folder} is a LoRA (stage 2) checkpoint: its weights are an adapter over the base model, not an R2LM; the "
            "run's final/ folder holds the adapter (train/lora.py export_adapter), merge it with r2lm-convert merge-lora"
        )
    meta = Path(model_config) if model_config else folder
    if not (meta / "config.json").is_file():
        raise ValueError(
            f"{meta} has no config.json: train/pretrain.py saves the model config beside every checkpoint; for "
            "checkpoints of other trainers pass --model-config FOLDER"
        )
    config = R2LMConfig.from_pretrained(meta)
    dtype = dtype or config.dtype or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    # the sources are the checkpoint read, not the run folder that may name it: RUN/final is a fine DST
    dst = check_destination(dst, [folder, meta], overwrite, needed_bytes=parameter_bytes(config, dtype))
    verify_checkpoint(folder)  # a damaged shard is named here, not exported as wrong weights
    logger.info("reassembling fp32 weights from %s", folder)
    state = load_fp32_state_dict(root, tag)
    restore_frozen(state, config, folder)
    check_finite(state, folder)
    model = build_model(config, state, dtype)
    model.config.dtype = dtype
    if not has_tokenizer(meta):
        logger.warning("%s has no tokenizer: the export will have none", meta)
    write_checkpoint(model, dst, meta, overwrite)
    logger.info("exported %s (%s) -> %s", folder, str(dtype).removeprefix("torch."), dst)
    return dst
