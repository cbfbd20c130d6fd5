"""R2LM checkpoint without extra layers -> a transformers Qwen3 / Qwen2 / Llama checkpoint (docs/design.md section 1:
such an R2LM *is* its backbone, parameter for parameter).

Useful to hand an AR-pretrained backbone to tools that only know transformers, or to start new conversions from
it. Sidecars and block-hybrid layers have no transformers counterpart, and a transformers causal LM cannot run
block_causal or bidirectional attention: those checkpoints are refused.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from r2lm.checkpoints import check_destination, check_finite, check_weights, read_config, write_checkpoint
from r2lm.kind import ATTENTION
from r2lm.modeling_r2lm import R2LMForDiffusionLM

logger = logging.getLogger(__name__)


def architecture_of(config) -> str:
    """Which transformers family reproduces this backbone exactly."""
    if config.qk_norm:
        if config.attention_bias != config.o_proj_bias or config.mlp_bias:
            raise ValueError("a qk_norm backbone with these biases has no transformers counterpart")
        return "qwen3"
    if config.attention_bias and not config.o_proj_bias and not config.mlp_bias:
        return "qwen2"
    if config.attention_bias == config.o_proj_bias:
        return "llama"
    raise ValueError("these attention biases match none of Qwen3, Qwen2 or Llama")


def without_sidecars(model: R2LMForDiffusionLM) -> R2LMForDiffusionLM:
    """`model` without its sidecars: the backbone alone, whose block-size-1 decoding is AR decoding (exact only
    without active sidecars). Its modules are new, its weights and buffers `model`'s own tensors, not copies (training
    it, or moving it to another dtype or device, changes `model`'s too): no second copy of the weights in memory, and a
    benchmark's AR decoding reads the very bytes verified decoding of `model` reads (a copy sits elsewhere in memory
    and reads at another speed: docs/results.md, "AR beside verified decoding, on the same weights")."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    plain = copy.deepcopy(model, memo=shared)
    for layer in plain.model.layers:
        layer.sidecar = None
    plain.config.sidecar_layers = []
    return plain


def transformers_backbone(model: R2LMForDiffusionLM):
    """The transformers Qwen3 / Qwen2 / Llama causal LM with `model`'s weights (in memory; a model without sidecar
    or block-hybrid layers, causal attention). Its greedy generate() is the model's AR decoding."""
    config = model.config
    if config.sidecar_layers or config.hybrid_layers:
        raise ValueError("sidecar and block-hybrid layers have no transformers counterpart; export a backbone without them")
    if config.kind.attention != ATTENTION["causal"]:  # what transformers' causal LMs run
        raise ValueError(f"a transformers causal LM cannot run {config.attention!r} attention")
    if config.rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("this backbone's RoPE rotates part of each head (partial_rotary_factor "
                         f"{config.rope_parameters['partial_rotary_factor']}); transformers' Qwen3 / Qwen2 / Llama "
                         "rotate the whole head")
    arch = architecture_of(config)
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps, rope_parameters=dict(config.rope_parameters),
        tie_word_embeddings=config.tie_word_embeddings, pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
    )
    if arch == "qwen3":
        hf = Qwen3ForCausalLM(Qwen3Config(head_dim=config.head_dim, attention_bias=config.attention_bias, **fields))
    elif arch == "qwen2":
        if config.head_dim * config.num_attention_heads != config.hidden_size:
            raise ValueError("Qwen2 derives head_dim from hidden_size / heads; this backbone's head_dim differs")
        hf = Qwen2ForCausalLM(Qwen2Config(**fields))
    else:
        hf = LlamaForCausalLM(LlamaConfig(head_dim=config.head_dim, attention_bias=config.attention_bias,
                                          mlp_bias=config.mlp_bias, **fields))
    hf = hf.to(model.dtype)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"state dict does not map onto {arch}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        hf.tie_weights()
    return hf


def convert_to_hf(src, dst, overwrite: bool = False, drop_sidecars: bool = False) -> Path:
    """Export SRC's backbone. With `drop_sidecars`, a causal R2LM with (trained) sidecars too: what remains is the
    forward verified decoding and AR decoding run (the sidecars only ever touch a diffusion window), so a serving
    engine that runs the stock architecture (vLLM, llama.cpp, transformers) writes the model's own greedy text; what
    is lost is its window drafts. Hybrid layers and block-causal attention change every forward: refused."""
    src = Path(src)
    dst = check_destination(dst, [src], overwrite)
    if read_config(src).get("model_type") != "r2lm":
        raise ValueError(f"{src} is not an R2LM checkpoint")
    check_weights(src)
    model = R2LMForDiffusionLM.from_pretrained(src)
    check_finite(model.state_dict(), src)
    config = model.config
    if config.hybrid_layers:
        raise ValueError(f"{src} has block-hybrid layers {config.hybrid_layers}: their linear attention over committed "
                         "blocks is part of every forward, and no stock architecture computes it")
    if config.kind.attention != ATTENTION["causal"]:
        raise ValueError(f"{src} has {config.attention!r} attention: a stock causal LM attends token-causally, so it "
                         "would compute another model")
    if config.sidecar_layers:
        if not drop_sidecars:
            raise ValueError(f"{src} has sidecars on layers {config.sidecar_layers}, which transformers has no layer "
                             "for; --drop-sidecars exports the backbone without them (exactly the forward AR and "
                             "verified decoding run: only the window drafts are lost)")
        model = without_sidecars(model)
    hf = transformers_backbone(model)
    write_checkpoint(hf, dst, src, overwrite)
    logger.info("exported the %s backbone of %s (%d parameters)", architecture_of(model.config), src,
                sum(p.numel() for p in hf.parameters()))
    return dst
