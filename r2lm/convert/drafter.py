"""A trained drafter as it ships: `r2lm-convert drafter SRC DST --target MODEL [--dtype bfloat16]`.

SRC is a drafter folder (a train/pretrain.py objective=drafter run's final/, or a checkpoint of it: reassembled from
its DeepSpeed shards); the target is the model it drafts for: it is checked to have the drafter's shapes, and its
digest (r2lm.drafter.target_digest: the verification forward's config and weights) is recorded in DST's config, so
that binding the drafter to another model warns. DST holds the drafter alone (config.json, model.safetensors in
--dtype, checksums.sha256 over both): what r2lm/drafters/ ships, and what `Drafter.from_pretrained` loads, its files
checked against the manifest.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from r2lm.checkpoints.training import STATE_FILE
from r2lm.checkpoints.writing import atomic_output_dir, check_destination
from r2lm.drafter import Drafter, target_digest
from r2lm.modeling_r2lm import R2LMForDiffusionLM

logger = logging.getLogger(__name__)


def load_drafter(src: Path) -> Drafter:
    """The drafter of a drafter folder or of a drafter run's checkpoint (reassembled from its DeepSpeed shards)."""
    if (src / STATE_FILE).is_file():
        return Drafter.from_training_checkpoint(src)
    if (src / "config.json").is_file():
        return Drafter.from_pretrained(src)
    raise ValueError(f"{src} is neither a drafter folder (no config.json) nor a drafter run's checkpoint")


def export_drafter(src, dst, target_dir, dtype: torch.dtype = torch.bfloat16, overwrite: bool = False) -> Path:
    src, target_dir = Path(src), Path(target_dir)
    dst = check_destination(dst, [src, target_dir], overwrite, needed_bytes=0)
    drafter = load_drafter(src)
    target = R2LMForDiffusionLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter.check_target(target.config)
    drafter.config.target_digest = target_digest(target)
    drafter = drafter.to(dtype)
    drafter.config.dtype = str(dtype).removeprefix("torch.")
    with atomic_output_dir(dst, overwrite=overwrite) as tmp:
        drafter.save_pretrained(tmp)
    logger.info("wrote %s (%s, for the target with digest %s)", dst, drafter.config.dtype, drafter.config.target_digest)
    return dst
