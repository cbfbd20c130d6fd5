"""A drafter of layout "dflash" as vLLM's DFlash speculative method loads it: `r2lm-convert drafter-to-dflash SRC DST
--target MODEL`.

vLLM (0.32, vllm/model_executor/models/qwen3_dflash.py) reads a Qwen3-config folder whose `architectures` is
`DFlashDraftModel`, with `dflash_config.{target_layer_ids, mask_token_id, causal}`; it computes what r2lm's drafter
computes in its "dflash" layout (r2lm.drafter.LAYOUTS), weight for weight:

    fc, hidden_norm     r2lm's fuse, fuse_norm (vLLM captures layer id + 1's input, the output of r2lm's feature layer id)
    layers.N.*          r2lm's layers.N.* (Qwen3 names: q/k/v/o_proj, q_norm, k_norm, mlp, both layer norms)
    norm                r2lm's norm
    lm_head, d2t        the target's LM head rows of the draft vocabulary, and each row's offset to its target id
    mask_embedding.pt   the learnt [MASK] vector, for the target's mask token id (the block's columns after the first)

The target's embeddings stay the target's (vLLM shares them, as r2lm does). Serve with
`--speculative-config '{"method": "dflash", "model": DST, "num_speculative_tokens": b - 1}'`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from r2lm.checkpoints.writing import atomic_output_dir, check_destination
from r2lm.convert.drafter import load_drafter
from r2lm.drafter import Drafter, target_digest
from r2lm.modeling_r2lm import R2LMForDiffusionLM

logger = logging.getLogger(__name__)

ARCHITECTURE = "DFlashDraftModel"  # vLLM's registry name for DFlashQwen3ForCausalLM


def dflash_config(drafter: Drafter, target) -> dict:
    """The config.json vLLM reads for `drafter` (a Qwen3 config with dflash_config)."""
    c, tc = drafter.config, target.config
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": c.target_hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps, "rope_parameters": dict(c.rope_parameters),
        "max_position_embeddings": c.max_position_embeddings, "attention_bias": False, "tie_word_embeddings": False,
        "vocab_size": c.target_vocab_size, "draft_vocab_size": len(drafter.draft_ids),
        "target_hidden_size": c.target_hidden_size, "block_size": c.block_size,
        "dflash_config": {"target_layer_ids": list(c.feature_layers), "mask_token_id": tc.mask_token_id,
                          "causal": c.in_block == "causal"},
        "dtype": str(drafter.fuse.weight.dtype).removeprefix("torch."),
        "r2lm_target_digest": c.target_digest,
    }


def dflash_weights(drafter: Drafter, target) -> dict[str, torch.Tensor]:
    """vLLM DFlash's weight names and tensors for `drafter` bound to `target`."""
    dtype = drafter.fuse.weight.dtype
    out = {f"layers.{k.removeprefix('layers.')}": v for k, v in drafter.state_dict().items() if k.startswith("layers.")}
    out |= {"fc.weight": drafter.fuse.weight, "hidden_norm.weight": drafter.fuse_norm.weight,
            "norm.weight": drafter.norm.weight}
    ids = drafter.draft_ids.long()
    out["lm_head.weight"] = target.lm_head.weight.detach().index_select(0, ids).to(dtype)
    out["d2t"] = ids - torch.arange(len(ids))  # vLLM: target id = draft id + d2t[draft id]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def check_exportable(drafter: Drafter, target, where) -> None:
    c = drafter.config
    if c.layout != "dflash":
        raise ValueError(f"{where} has layout {c.layout!r}: vLLM's DFlash computes otherwise (r2lm's layout normalises "
                         "each captured layer before fusing, adds an input norm before the context's keys and values "
                         "and a direct path into every block column), so its drafts would not be this drafter's; train "
                         "one with drafter.layout=dflash")
    drafter.check_target(target.config)
    digest = target_digest(target)
    if c.target_digest is not None and c.target_digest != digest:
        raise ValueError(f"{where} was made for another target (digest {c.target_digest}), not for this one (digest "
                         f"{digest}): vLLM would draft with features it was not trained on")
    if target.config.mask_token_id is None:
        raise ValueError("the target has no mask_token_id: vLLM's DFlash feeds the block's masked columns as that id")


def export_dflash(src, dst, target_dir, overwrite: bool = False) -> Path:
    """Write the drafter at `src` (a drafter folder or a training checkpoint of one) for the R2LM checkpoint
    `target_dir` as the folder vLLM's DFlash method loads (config.json, model.safetensors, mask_embedding.pt,
    checksums.sha256); refuses a drafter of another layout or made for another target, naming why."""
    src, target_dir = Path(src), Path(target_dir)
    dst = check_destination(dst, [src, target_dir], overwrite, needed_bytes=0)
    drafter = load_drafter(src)
    target = R2LMForDiffusionLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    check_exportable(drafter, target, src)
    drafter.config.target_digest = target_digest(target)
    with atomic_output_dir(dst, overwrite=overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(dflash_config(drafter, target), indent=2) + "\n")
        save_file(dflash_weights(drafter, target), tmp / "model.safetensors", metadata={"format": "pt"})
        torch.save({"mask_token_id": target.config.mask_token_id, "embedding": drafter.mask_embedding.detach().clone()},
                   tmp / "mask_embedding.pt")
    logger.info("%s: vLLM --speculative-config '{\"method\": \"dflash\", \"model\": \"%s\", "
                "\"num_speculative_tokens\": %d}'", dst, dst, drafter.config.block_size - 1)
    return dst
