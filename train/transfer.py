"""Stage 1 of block-hybrid conversion: attention transfer (docs/design.md 1.2 and 7; LoLCATs, LLaDA-Hybrid).

    deepspeed --num_gpus 8 train/pretrain.py --config configs/train/tiny_hybrid_stage1.yaml   (objective: attention_transfer)

Every batch is noised exactly like the `block` objective (one t per block, r2lm.diffusion.block_noise) and laid out
as the dual stream that hybrid layers are trained and decoded on. Each block-hybrid layer's output (per head,
before o_proj) is compared with the layer's own softmax attention over the same keys, the frozen teacher, whose
output is what the next layer receives (`R2LMForDiffusionLM.attention_transfer`): the losses are layer-local.

Loss = the SUM over hybrid layers of their MSE. Layer l's feature map and gate move only MSE_l (every layer
passes the teacher's output on), so the sum gives each layer exactly its own gradient whatever the number of
hybrid layers; a mean would shrink each by that number. Only the feature maps and gates of the hybrid layers
(`linear_attention.*`) train, whatever freeze_backbone says. The run evaluates the held-out per-layer MSE with fixed noise at step 0 and at the
end (metrics.jsonl `eval_mse_layer_N`) and writes both and their ratio to OUTPUT_DIR/attention_transfer.json.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from r2lm import R2LMForDiffusionLM
from r2lm.diffusion import Loss, block_noise, noised_dual_stream

logger = logging.getLogger(__name__)

OBJECTIVE = "attention_transfer"
SUMMARY_FILE = "attention_transfer.json"
TRAINABLE = ".linear_attention."  # the feature maps and alpha of every hybrid layer


def check_attention_transfer(config) -> None:
    """Reject a model attention transfer cannot train, before any work starts (ValueError)."""
    if not config.hybrid_layers:
        raise ValueError(
            f"objective {OBJECTIVE!r} needs a model with block-hybrid layers, and this one has none "
            "(config.hybrid_layers is empty): convert it first with python -m convert to-hybrid SRC DST --layers 0,3,..."
        )
    if config.mask_token_id is None:
        raise ValueError(f"objective {OBJECTIVE!r} noises its batches like the block objective and needs config.mask_token_id")


class AttentionTransferLM(R2LMForDiffusionLM):
    """An R2LMForDiffusionLM whose forward also runs attention transfer (`transfer=True` returns the per-layer MSE
    [n_hybrid]), so a DeepSpeed engine's own forward (which arms its backward hooks) computes it. Its weights,
    checkpoints and exports are exactly R2LMForDiffusionLM's."""

    def forward(self, input_ids, attention_mask=None, layout=None, transfer: bool = False, **kwargs):
        if transfer:
            return self.attention_transfer(input_ids, layout=layout, attention_mask=attention_mask)
        return super().forward(input_ids, attention_mask=attention_mask, layout=layout, **kwargs)


def freeze_for_transfer(model) -> list[str]:
    """Freeze everything but the feature maps and gates of the hybrid layers; returns the trainable names."""
    trainable = []
    for name, param in model.named_parameters():
        param.requires_grad_(TRAINABLE in name)
        if param.requires_grad:
            trainable.append(name)
    if not trainable:
        raise ValueError("attention transfer found no linear_attention parameters to train")
    return trainable


@dataclass
class TransferLoss(Loss):
    per_layer: torch.Tensor | None = None  # [n_hybrid] MSE of each hybrid layer, in config.hybrid_layers order
    layers: tuple[int, ...] = ()  # config.hybrid_layers

    def metrics(self) -> dict[str, torch.Tensor]:
        """Each hybrid layer's MSE, logged as mse_layer_N (eval_mse_layer_N held out)."""
        return {key: mse for key, mse in zip(layer_keys(self), self.per_layer, strict=True)}


def transfer_loss(model, x0, attention_mask=None, separator_id=None, generator=None, config=None, eps=1e-3) -> TransferLoss:
    """Attention transfer on one noised dual-stream batch. `model`: an R2LMForDiffusionLM, or a DeepSpeed engine
    around an AttentionTransferLM (then pass `config`)."""
    config = config or model.config
    _, [(masked, _)] = block_noise(x0, config, attention_mask, separator_id, generator, eps)
    inputs, layout, _ = noised_dual_stream(x0, masked, config)
    core = getattr(model, "module", model)
    if isinstance(core, AttentionTransferLM):
        per_layer = model(inputs, layout=layout, transfer=True)
    elif core is model:
        per_layer = model.attention_transfer(inputs, layout=layout)
    else:
        raise TypeError(f"attention transfer through a {type(model).__name__} needs it to wrap an AttentionTransferLM")
    return TransferLoss(per_layer.sum(), x0.numel(), int(masked.sum()), per_layer=per_layer,
                        layers=tuple(config.hybrid_layers))


def layer_keys(config, prefix: str = "mse_layer_") -> list[str]:
    """The metric names of each hybrid layer's MSE (`config`: anything with hybrid_layers, or a TransferLoss)."""
    return [f"{prefix}{i}" for i in getattr(config, "hybrid_layers", None) or config.layers]


def write_summary(run_dir: Path, eval_records: list[dict], config, steps: int) -> dict | None:
    """Held-out per-layer MSE before (step 0) and after (step `steps`) training -> OUTPUT_DIR/attention_transfer.json."""
    keys = layer_keys(config, "eval_mse_layer_")
    by_step = {r["step"]: r for r in eval_records if all(k in r for k in keys)}
    if 0 not in by_step or steps not in by_step:
        logger.warning("no held-out evaluation at step 0 and step %d: %s not written", steps, SUMMARY_FILE)
        return None
    before, after = by_step[0], by_step[steps]
    layers = {}
    for layer, key in zip(config.hybrid_layers, keys, strict=True):
        ratio = before[key] / after[key] if after[key] > 0 else float("inf")
        layers[str(layer)] = {"before": before[key], "after": after[key], "reduction": ratio}
        logger.info("attention transfer, layer %d: held-out MSE %.4g -> %.4g (%.1fx lower)", layer, before[key], after[key], ratio)
    summary = {"hybrid_layers": list(config.hybrid_layers), "steps": steps, "loss": "sum over hybrid layers of the per-layer MSE",
               "eval_loss_before": before["eval_loss"], "eval_loss_after": after["eval_loss"], "layers": layers}
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(tmp, path)
    return summary
