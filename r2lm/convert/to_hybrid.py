"""R2LM / block_causal checkpoint -> the same model with block-hybrid attention on chosen layers (docs/design.md 1.2, 7).

The chosen layers keep their q/k/v/o projections; they gain a Hedgehog feature map (identity plus noise; one per
head, or a query and a key map with `tie_feature_maps=False`) and a softmax gate (alpha = 0, w = 0.5). Until attention transfer trains the feature maps the linear part is only a
rough stand-in for the softmax over earlier blocks; the first block, with nothing earlier, is exact.
"""

from __future__ import annotations

import logging
from pathlib import Path

from r2lm.checkpoints import check_destination, read_config, read_state_dict, write_checkpoint
from r2lm.configuration_r2lm import R2LMConfig
from r2lm.convert.from_hf import load_backbone, seeded
from r2lm.modeling_r2lm import R2LMForDiffusionLM

logger = logging.getLogger(__name__)


def convert_to_hybrid(src, dst, layers, feature_dim: int | None = None, tie_feature_maps: bool = True,
                      overwrite: bool = False, seed: int = 0) -> Path:
    """Write `src` with block-hybrid attention on `layers` to `dst`; returns `dst`. seed: initialises the feature
    maps (the same seed gives the same output, bit for bit)."""
    src = Path(src)
    dst = check_destination(dst, [src], overwrite)
    if read_config(src).get("model_type") != "r2lm":
        raise ValueError(f"{src} is not an R2LM checkpoint; convert it first (r2lm-convert from-hf ...)")
    config = R2LMConfig.from_pretrained(src)
    layers = list(layers)
    if not layers:
        raise ValueError("give the layers to convert, e.g. --layers 0,4,8")
    if len(set(layers)) != len(layers):
        raise ValueError(f"--layers lists a layer twice: {layers}")
    already = sorted(set(layers) & set(config.hybrid_layers))
    if already:
        raise ValueError(f"layers {already} are already block-hybrid in {src}; a layer is converted once")
    if feature_dim is not None and config.hybrid_layers and feature_dim != config.hybrid_feature_dim:
        raise ValueError(
            f"{src} already has hybrid layers with feature dim {config.hybrid_feature_dim}; all hybrid layers share it"
        )
    if config.hybrid_layers and tie_feature_maps != config.hybrid_tie_feature_maps:
        raise ValueError(
            f"{src} already has hybrid layers with {'tied' if config.hybrid_tie_feature_maps else 'untied'} feature "
            "maps; all hybrid layers share that choice"
        )
    fields = config.to_dict()
    fields.update(hybrid_layers=sorted(config.hybrid_layers + layers), hybrid_tie_feature_maps=tie_feature_maps)
    if feature_dim is not None:
        fields["hybrid_feature_dim"] = feature_dim
    elif not config.hybrid_layers:  # the default 64, or the whole head when heads are smaller
        fields["hybrid_feature_dim"] = min(config.hybrid_feature_dim, config.head_dim)
    hybrid = R2LMConfig(**{k: v for k, v in fields.items() if k not in ("model_type", "transformers_version", "architectures")})

    with seeded(seed):
        model = R2LMForDiffusionLM._from_config(hybrid, dtype=config.dtype)
    new = tuple(f"model.layers.{i}.self_attn.linear_attention." for i in layers)
    load_backbone(model, read_state_dict(src), fresh=lambda name: name.startswith(new))
    write_checkpoint(model, dst, src, overwrite)
    logger.info("block-hybrid layers %s (feature dim %d, %s feature maps)", hybrid.hybrid_layers,
                hybrid.hybrid_feature_dim, "tied" if tie_feature_maps else "untied")
    return dst
