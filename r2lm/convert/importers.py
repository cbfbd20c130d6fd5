"""Importers of pretrained diffusion-LM checkpoints into R2LM checkpoints (docs/design.md section 7).

    r2lm-convert from-llada  SRC DST     LLaDA 1 (OLMo-style layout)      -> bidirectional, inplace
    r2lm-convert from-dream  SRC DST     Dream (Qwen2 layout, q/k/v bias) -> bidirectional, shift
    r2lm-convert from-llada2 SRC DST     LLaDA 2.x, dense layers only     -> block_causal, inplace

Each importer reads config.json and the safetensors weights of SRC (never modifying it), maps every tensor to its
R2LM name (transformers' Qwen3/Llama names), checks every shape against the R2LM config it derived, and writes DST
atomically together with the tokenizer. A checkpoint the mapping cannot describe completely (an unknown tensor, a
missing one, a wrong shape, a config option r2lm does not implement) is refused with a ValueError and no DST.

Layout facts, read from the source models' code:
- LLaDA 1 (`modeling_llada.py`, `LLaDALlamaBlock`): `x, x_up = ff_proj(x), up_proj(x); x = act(x) * x_up`, so
  `ff_proj` is the SiLU-gated projection (gate_proj) and `up_proj` the linear one; `ff_out` is down_proj inside a
  block and the LM head at `model.transformer.ff_out` (absent with weight_tying). `wte` has `embedding_size` rows
  (>= vocab_size, padded) and the logits span all of them, so the R2LM vocabulary is embedding_size.
  RoPE is NeoX-style (rotate_half) over the whole head, head_dim = d_model / n_heads.
- Dream (`modeling_dream.py`): Qwen2 names; q/k/v have a bias, o_proj none; head_dim = hidden / heads. The
  model's logits are unshifted and its sampler shifts them (`cat([logits[:, :1], logits[:, :-1]])`): the hidden
  state at i-1 predicts token i: shift prediction.
- LLaDA 2 (`modeling_llada2_moe.py`): `query_key_value` rows are [q heads | k heads | v heads] (the output is viewed
  as (..., H + 2 Hkv, head_dim) and split on the head axis); query/key_layernorm are RMSNorms over head_dim applied
  before RoPE (r2lm's qk_norm); RoPE rotates the first head_dim * partial_rotary_factor dims (NeoX rotate_half); a
  layer is MoE when `num_experts is not None and layer_idx >= first_k_dense_replace`; `use_qkv_bias` (default
  False) biases the fused projection, `use_bias` (default True) biases `dense`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedConfig

from r2lm.checkpoints import (
    check_destination,
    check_tokenizer,
    has_tokenizer,
    read_config,
    read_state_dict,
    write_checkpoint,
)
from r2lm.configuration_r2lm import R2LMConfig
from r2lm.convert.from_hf import is_sidecar_weight, load_backbone, seeded
from r2lm.kind import SHIFT
from r2lm.modeling_r2lm import R2LMForDiffusionLM

logger = logging.getLogger(__name__)

LLADA_MASK_ID = 126336
DREAM_MASK_ID = 151666
LLADA2_MASK_ID = 156895
DEFAULT_BLOCK_SIZE = 32

# Files a tokenizer may consist of; copied verbatim when the tokenizer cannot be loaded without remote code.


class _Source:
    """The source tensors, taken by name so that a missing one is named and leftovers can be reported."""

    def __init__(self, state: dict[str, torch.Tensor], layout: str):
        self.state = dict(state)
        self.layout = layout

    def take(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise ValueError(f"{self.layout} checkpoint is missing tensor {name}")
        return self.state.pop(name)

    def has(self, name: str) -> bool:
        return name in self.state

    def check_consumed(self) -> None:
        rest = sorted(k for k in self.state if not k.endswith("rotary_emb.inv_freq"))
        if rest:
            more = f" (and {len(rest) - 5} more)" if len(rest) > 5 else ""
            raise ValueError(f"{self.layout} checkpoint has tensors the config does not describe: {rest[:5]}{more}")


@dataclass
class _Tensor:
    dst: str  # R2LM name
    src: str  # source name (for messages)
    value: torch.Tensor


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)} but the config implies {tuple(shape)}")


def _rope_parameters(raw: dict, partial_rotary_factor: float | None = None) -> dict:
    """R2LM rope_parameters from a source config's rope_theta / rope_scaling (R2LMConfig validates the type)."""
    scaling = dict(raw.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    params = {"rope_type": rope_type, "rope_theta": float(raw.get("rope_theta", 10000.0)), **scaling}
    if partial_rotary_factor is not None and partial_rotary_factor != 1.0:
        params["partial_rotary_factor"] = float(partial_rotary_factor)
    return params


def _special_ids(raw: dict) -> dict:
    return {k: raw[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id") if raw.get(k) is not None}


def _unsupported(layout: str, what: str) -> ValueError:
    return ValueError(f"{layout} checkpoint uses {what}, which r2lm does not implement")


# ----------------------------------------------------------------------------------------------- LLaDA 1


def llada_config(raw: dict) -> dict:
    """R2LMConfig fields of a LLaDA 1 (OLMo-style) config."""
    L = "LLaDA"
    if raw.get("model_type") != "llada":
        raise ValueError(f"expected a LLaDA 1 checkpoint (model_type 'llada'), got model_type {raw.get('model_type')!r}")
    if raw.get("block_type", "llama") != "llama":
        raise _unsupported(L, f"block_type {raw['block_type']!r} (only the 'llama' block with q/k/v_proj and ff_proj/up_proj imports)")
    if raw.get("layer_norm_type", "rms") != "rms":
        raise _unsupported(L, f"layer_norm_type {raw['layer_norm_type']!r} (only 'rms')")
    if not raw.get("layer_norm_with_affine", True):
        raise _unsupported(L, "norms without weights (layer_norm_with_affine false)")
    if raw.get("include_bias") or raw.get("bias_for_layer_norm"):
        raise _unsupported(L, "biases on the output projections, MLP, LM head or norms (include_bias / bias_for_layer_norm)")
    if raw.get("attention_layer_norm"):
        raise _unsupported(L, "OLMo's full-width q/k LayerNorm (attention_layer_norm)")
    if not raw.get("rope", True) or raw.get("alibi") or raw.get("yarn"):
        raise _unsupported(L, "a position scheme other than plain RoPE (rope false, alibi or yarn)")
    if raw.get("activation_type", "silu") != "silu":
        raise _unsupported(L, f"activation_type {raw['activation_type']!r} (the llama block imports with 'silu', i.e. SwiGLU)")
    if raw.get("scale_logits") or raw.get("input_emb_norm"):
        raise _unsupported(L, "scaled logits or scaled input embeddings (scale_logits / input_emb_norm)")
    if raw.get("clip_qkv") is not None:
        raise _unsupported(L, f"q/k/v clipping (clip_qkv {raw['clip_qkv']})")
    if raw.get("block_group_size", 1) != 1:
        raise _unsupported(L, f"block groups (block_group_size {raw['block_group_size']})")
    d_model, n_heads = raw["d_model"], raw["n_heads"]
    if d_model % n_heads:
        raise ValueError(f"LLaDA d_model {d_model} is not divisible by n_heads {n_heads}")
    if raw.get("multi_query_attention"):
        n_kv = 1
    else:
        n_kv = raw.get("n_kv_heads") or n_heads
    vocab, embedding = raw["vocab_size"], raw.get("embedding_size") or raw["vocab_size"]
    if embedding < vocab:
        raise ValueError(f"LLaDA embedding_size {embedding} is below vocab_size {vocab}")
    return dict(
        # the logits span every row of wte (embedding_size, padded past vocab_size), so R2LM's vocabulary does too
        vocab_size=embedding,
        hidden_size=d_model,
        intermediate_size=raw.get("mlp_hidden_size") or raw.get("mlp_ratio", 4) * d_model,
        num_hidden_layers=raw["n_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=d_model // n_heads,
        hidden_act="silu",
        max_position_embeddings=raw.get("max_sequence_length", 4096),
        initializer_range=raw.get("init_std", 0.02),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_parameters=_rope_parameters(raw),
        attention_bias=bool(raw.get("include_qkv_bias", False)),
        o_proj_bias=False,
        mlp_bias=False,
        qk_norm=False,
        tie_word_embeddings=bool(raw.get("weight_tying", False)),
        attention="bidirectional",
        prediction="inplace",
        mask_token_id=raw.get("mask_token_id", LLADA_MASK_ID),
        block_size=raw.get("block_size", DEFAULT_BLOCK_SIZE),
        **_special_ids(raw),
    )


def llada_tensors(src: _Source, config) -> list[_Tensor]:
    out = [_Tensor("model.embed_tokens.weight", "model.transformer.wte.weight", src.take("model.transformer.wte.weight"))]
    block_map = {
        "attn_norm.weight": "input_layernorm.weight",
        "q_proj.weight": "self_attn.q_proj.weight",
        "k_proj.weight": "self_attn.k_proj.weight",
        "v_proj.weight": "self_attn.v_proj.weight",
        "attn_out.weight": "self_attn.o_proj.weight",
        "ff_norm.weight": "post_attention_layernorm.weight",
        "ff_proj.weight": "mlp.gate_proj.weight",  # act(ff_proj(x)) * up_proj(x): ff_proj is the gated one
        "up_proj.weight": "mlp.up_proj.weight",
        "ff_out.weight": "mlp.down_proj.weight",
    }
    if config.attention_bias:
        block_map.update({f"{p}_proj.bias": f"self_attn.{p}_proj.bias" for p in "qkv"})
    for i in range(config.num_hidden_layers):
        for s, d in block_map.items():
            name = f"model.transformer.blocks.{i}.{s}"
            out.append(_Tensor(f"model.layers.{i}.{d}", name, src.take(name)))
    out.append(_Tensor("model.norm.weight", "model.transformer.ln_f.weight", src.take("model.transformer.ln_f.weight")))
    if not config.tie_word_embeddings:
        out.append(_Tensor("lm_head.weight", "model.transformer.ff_out.weight", src.take("model.transformer.ff_out.weight")))
    return out


# ----------------------------------------------------------------------------------------------- Dream


def dream_config(raw: dict) -> dict:
    """R2LMConfig fields of a Dream (Qwen2-layout) config."""
    if str(raw.get("model_type", "")).lower() != "dream":
        raise ValueError(f"expected a Dream checkpoint (model_type 'Dream'), got model_type {raw.get('model_type')!r}")
    if raw.get("use_sliding_window"):
        raise _unsupported("Dream", "sliding-window attention (use_sliding_window)")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    if hidden % heads:
        raise ValueError(f"Dream hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    return dict(
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=hidden // heads,  # DreamAttention ignores any head_dim field
        hidden_act=raw.get("hidden_act", "silu"),
        max_position_embeddings=raw.get("max_position_embeddings", 32768),
        initializer_range=raw.get("initializer_range", 0.02),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_parameters=_rope_parameters(raw),
        attention_bias=True,  # q/k/v biased, o_proj not (as Qwen2)
        o_proj_bias=False,
        mlp_bias=False,
        qk_norm=False,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention="bidirectional",
        prediction=SHIFT,
        mask_token_id=raw.get("mask_token_id", DREAM_MASK_ID),
        block_size=raw.get("block_size", DEFAULT_BLOCK_SIZE),
        **_special_ids(raw),
    )


def dream_tensors(src: _Source, config) -> list[_Tensor]:
    """Dream already uses R2LM's (Qwen2's) names."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "self_attn.o_proj.weight"]
        names += [p + f"self_attn.{x}_proj.{w}" for x in "qkv" for w in ("weight", "bias")]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    elif src.has("lm_head.weight"):  # transformers ties a stored head to the embedding on load: the source ignores it
        src.take("lm_head.weight")
        logger.info("tie_word_embeddings: dropping the stored lm_head.weight (the embedding is the head)")
    return [_Tensor(n, n, src.take(n)) for n in names]


# ----------------------------------------------------------------------------------------------- LLaDA 2


def llada2_config(raw: dict) -> dict:
    """R2LMConfig fields of a LLaDA 2.x config (defaults as in LLaDA2MoeConfig); only dense checkpoints import."""
    model_type = str(raw.get("model_type", ""))
    if not model_type.startswith("llada2"):
        raise ValueError(f"expected a LLaDA 2 checkpoint (model_type 'llada2_moe'), got model_type {model_type!r}")
    layers = raw["num_hidden_layers"]
    num_experts = raw.get("num_experts", 16)
    first_dense = raw.get("first_k_dense_replace", 0)
    if num_experts is not None and first_dense < layers:
        raise ValueError(
            f"LLaDA 2 MoE layers {first_dense}..{layers - 1} (num_experts={num_experts}) are not supported by r2lm; "
            f"only dense checkpoints import (num_experts null, or first_k_dense_replace >= num_hidden_layers)"
        )
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or hidden // heads
    factor = raw.get("partial_rotary_factor", 0.5)
    rotary_dim = int(head_dim * factor)
    if raw.get("rotary_dim") not in (None, rotary_dim):
        logger.warning(
            "config rotary_dim %s disagrees with head_dim * partial_rotary_factor = %d; using the latter, as "
            "LLaDA 2's modeling code does", raw["rotary_dim"], rotary_dim,
        )
    if rotary_dim % 2 or rotary_dim <= 0:
        raise ValueError(f"LLaDA 2 rotary dim head_dim * partial_rotary_factor = {head_dim} * {factor} must be even and positive")
    return dict(
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        hidden_act=raw.get("hidden_act", "silu"),
        max_position_embeddings=raw.get("max_position_embeddings", 16384),
        initializer_range=raw.get("initializer_range", 0.02),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_parameters=_rope_parameters(raw, factor),
        attention_bias=bool(raw.get("use_qkv_bias", False)),
        o_proj_bias=bool(raw.get("use_bias", True)),
        mlp_bias=False,
        qk_norm=True,  # query_layernorm / key_layernorm exist in every LLaDA 2 attention, whatever use_qk_norm says
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention="block_causal",
        prediction="inplace",
        mask_token_id=raw.get("mask_token_id", LLADA2_MASK_ID),
        block_size=raw.get("block_size", DEFAULT_BLOCK_SIZE),
        **_special_ids(raw),
    )


def llada2_tensors(src: _Source, config) -> list[_Tensor]:
    H, K, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    split = [H * D, K * D, K * D]  # rows of query_key_value: [q heads | k heads | v heads]
    out = [_Tensor("model.embed_tokens.weight", "model.word_embeddings.weight", src.take("model.word_embeddings.weight"))]
    for i in range(config.num_hidden_layers):
        s, d = f"model.layers.{i}.", f"model.layers.{i}."
        fused = [("weight", (sum(split), config.hidden_size))]
        if config.attention_bias:
            fused.append(("bias", (sum(split),)))
        for kind, shape in fused:
            name = s + f"attention.query_key_value.{kind}"
            qkv = src.take(name)
            _check_shape(name, qkv, shape)
            for part, tensor in zip("qkv", qkv.split(split, dim=0), strict=True):
                out.append(_Tensor(d + f"self_attn.{part}_proj.{kind}", name, tensor.clone()))
        pairs = {
            "input_layernorm.weight": "input_layernorm.weight",
            "post_attention_layernorm.weight": "post_attention_layernorm.weight",
            "attention.query_layernorm.weight": "self_attn.q_norm.weight",
            "attention.key_layernorm.weight": "self_attn.k_norm.weight",
            "attention.dense.weight": "self_attn.o_proj.weight",
            "mlp.gate_proj.weight": "mlp.gate_proj.weight",
            "mlp.up_proj.weight": "mlp.up_proj.weight",
            "mlp.down_proj.weight": "mlp.down_proj.weight",
        }
        if config.o_proj_bias:
            pairs["attention.dense.bias"] = "self_attn.o_proj.bias"
        for a, b in pairs.items():
            out.append(_Tensor(d + b, s + a, src.take(s + a)))
    out.append(_Tensor("model.norm.weight", "model.norm.weight", src.take("model.norm.weight")))
    if not config.tie_word_embeddings:
        out.append(_Tensor("lm_head.weight", "lm_head.weight", src.take("lm_head.weight")))
    return out


@dataclass(frozen=True)
class SourceLayout:
    name: str
    config: Callable[[dict], dict]
    tensors: Callable[[_Source, object], list[_Tensor]]


LAYOUTS = {
    "llada": SourceLayout("LLaDA", llada_config, llada_tensors),
    "dream": SourceLayout("Dream", dream_config, dream_tensors),
    "llada2": SourceLayout("LLaDA 2", llada2_config, llada2_tensors),
}


# ----------------------------------------------------------------------------------------------- driver


def import_checkpoint(
    layout: str,
    src,
    dst,
    *,
    mask_token_id: int | None = None,
    block_size: int | None = None,
    sidecar_layers=(),
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    seed: int = 0,
    **sidecar,
) -> Path:
    """Import the `layout` ("llada", "dream", "llada2") checkpoint folder `src` as an R2LM checkpoint `dst`.

    mask_token_id / block_size override the config's (or the layout's default); sidecar_layers and sidecar
    (sidecar_d_state, sidecar_expand, ...) add zero-gated reverse Mamba sidecars, which only causal and
    block_causal models accept, initialised from `seed`; dtype defaults to the stored weights'. Returns `dst`."""
    spec = LAYOUTS[layout]
    src = Path(src)
    dst = check_destination(dst, [src], overwrite)
    raw = read_config(src)
    try:
        fields = spec.config(raw)
    except KeyError as err:
        raise ValueError(f"{spec.name} config.json in {src} lacks the field {err.args[0]!r}") from None
    if mask_token_id is not None:
        fields["mask_token_id"] = mask_token_id
    if block_size is not None:
        fields["block_size"] = block_size
    config = R2LMConfig(**fields, sidecar_layers=list(sidecar_layers), **sidecar)
    tokenizer = _load_tokenizer(src, config.mask_token_id) if has_tokenizer(src) else None  # before the weights

    source = _Source(read_state_dict(src), spec.name)
    if dtype is None:
        dtype = next((t.dtype for t in source.state.values() if t.is_floating_point()), torch.float32)
    config.dtype = dtype
    tensors = spec.tensors(source, config)
    source.check_consumed()

    logger.info("building R2LM from %s (%d layers, %s, %s) in %s", spec.name, config.num_hidden_layers,
                config.attention, config.prediction, dtype)
    with seeded(seed):
        model = R2LMForDiffusionLM._from_config(config, dtype=dtype)
    expected = model.state_dict()
    for t in tensors:
        _check_shape(t.src, t.value, expected[t.dst].shape)
    load_backbone(model, {t.dst: t.value.to(dtype) for t in tensors}, fresh=is_sidecar_weight)
    model.config._check()

    write_checkpoint(model, dst, src, overwrite, tokenizer)
    logger.info("imported %s: attention=%s prediction=%s mask_token_id=%d", spec.name, config.attention,
                config.prediction, config.mask_token_id)
    return dst


def _load_tokenizer(src: Path, mask_id: int):
    """The source tokenizer with its mask token set, or None when it needs remote code (copied verbatim then). Tokenizer
    files without a vocabulary are refused (check_tokenizer): copied, they would make a tokenizer nothing can load."""
    try:
        auto_map = json.loads((src / "tokenizer_config.json").read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        auto_map = None
    if auto_map:
        logger.warning("the tokenizer of %s needs remote code (auto_map %s), which is never run here; copying its "
                       "tokenizer files verbatim (set its mask token yourself if it has none)", src, auto_map)
        return None
    check_tokenizer(src)
    try:
        # A blank config: the source's config.json names remote model code, which AutoTokenizer would offer to run.
        tok = AutoTokenizer.from_pretrained(src, local_files_only=True, trust_remote_code=False, config=PreTrainedConfig())
    except Exception as err:  # unknown tokenizer classes, broken files, ...
        logger.warning("cannot load the tokenizer of %s (%s); copying its tokenizer files verbatim", src, err)
        return None
    if mask_id < len(tok):
        token = tok.convert_ids_to_tokens(mask_id)
        if tok.mask_token is None and token is not None:
            tok.mask_token = token
        elif tok.mask_token is not None and tok.mask_token_id != mask_id:
            logger.warning("tokenizer mask token %r (id %s) is not the model's mask id %d", tok.mask_token, tok.mask_token_id, mask_id)
    else:
        logger.warning("mask token id %d is outside the tokenizer's %d tokens", mask_id, len(tok))
    return tok
