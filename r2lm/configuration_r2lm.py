"""R2LMConfig: one config for the whole bifocal model family (docs/design.md section 1).

The backbone fields and their names are those of transformers' Qwen3 / Qwen2 / Llama configs, so a
converted config reads like its source. The diffusion fields choose the attention kind, the prediction
convention, the [MASK] id, the block size and which layers carry a reverse Mamba sidecar or block-hybrid
linear attention.
"""

from __future__ import annotations

import dataclasses
import re

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from r2lm.kind import ATTENTION, PREDICTIONS, ModelKind

# RoPE types whose frequencies do not depend on the sequence length: a cached key stays exact. "dynamic" and
# "longrope" rescale with the current length, which would silently invalidate every cached key.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DTYPES = ("float32", "bfloat16", "float16", "float64")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON `true` is no layer count


def _is_positive_int(value) -> bool:
    return _is_int(value) and value > 0


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int_list(value) -> bool:
    return isinstance(value, list | tuple) and all(map(_is_int, value))


# (fields, test, what a valid value is): what each field must be on its own; checks between fields are in _check.
FIELD_RULES = (
    (("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
      "max_position_embeddings", "block_size", "sidecar_d_state", "sidecar_expand", "sidecar_headdim",
      "sidecar_ngroups", "sidecar_chunk_size", "sidecar_d_conv", "hybrid_feature_dim"),
     _is_positive_int, "a positive integer"),
    (("num_key_value_heads", "head_dim"), lambda v: v is None or _is_positive_int(v),
     "a positive integer (or null, to derive it)"),
    (("rms_norm_eps",), lambda v: _is_number(v) and v > 0, "a positive number"),
    (("initializer_range",), lambda v: _is_number(v) and v >= 0, "a non-negative number"),
    (("attention_bias", "o_proj_bias", "mlp_bias", "qk_norm", "tie_word_embeddings", "hybrid_tie_feature_maps"),
     lambda v: isinstance(v, bool), "true or false"),
    (("mask_token_id", "pad_token_id", "bos_token_id"), lambda v: v is None or _is_int(v), "a token id (or null)"),
    (("eos_token_id",), lambda v: v is None or _is_int(v) or _is_int_list(v), "a token id, a list of them (or null)"),
    (("sidecar_layers", "hybrid_layers"), lambda v: v is None or _is_int_list(v), "a list of layer indices"),
    (("attention",), lambda v: v in ATTENTION, f"one of {tuple(ATTENTION)}"),
    (("prediction",), lambda v: v in PREDICTIONS, f"one of {tuple(PREDICTIONS)}"),
    (("hidden_act",), lambda v: isinstance(v, str) and v in ACT2FN, "an activation name of transformers' ACT2FN"),
    (("rope_parameters",), lambda v: v is None or isinstance(v, dict), "a dict (or null)"),
)


class R2LMConfig(PreTrainedConfig):
    r"""Configuration of [`R2LMForDiffusionLM`].

    Backbone (Llama / Qwen2 / Qwen3 family): `vocab_size`, `hidden_size`, `intermediate_size`,
    `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads` (GQA), `head_dim`, `hidden_act`,
    `max_position_embeddings`, `rms_norm_eps`, `rope_parameters`, `attention_bias` (bias on q/k/v),
    `o_proj_bias`, `mlp_bias`, `qk_norm` (Qwen3's RMSNorm over head_dim on q and k), `tie_word_embeddings`.

    Diffusion:
        attention: "causal" (R2LM, AR backbones), "block_causal" (bidirectional inside a chunk, causal across
            chunks) or "bidirectional" (LLaDA 1): a row of r2lm.kind.ATTENTION.
        prediction: "shift" (hidden state at i-1 predicts token i) or "inplace" (the [MASK] at i predicts i).
        What these and the sidecar / hybrid layers imply for decoding, training and scoring: `kind` (r2lm.kind).
        mask_token_id: id of the [MASK] token.
        block_size: diffusion block length used by training and decoding.
        sidecar_layers: indices of layers that carry the reverse Mamba2 sidecar.
        sidecar_d_state, sidecar_expand, sidecar_headdim, sidecar_ngroups, sidecar_chunk_size, sidecar_d_conv:
            shape of each sidecar's Mamba2 mixer.
        hybrid_layers: indices of block-hybrid layers (linear attention over committed blocks).
        hybrid_feature_dim: Hedgehog feature dimension of the hybrid layers.
        hybrid_tie_feature_maps: one feature map per head for queries and keys (LLaDA-Hybrid), or separate
            query and key maps (LoLCATs; twice the parameters, a closer fit to softmax attention).
    """

    model_type = "r2lm"

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    attention: str = "causal"
    prediction: str = "shift"
    mask_token_id: int | None = None
    block_size: int = 32

    sidecar_layers: list[int] | None = None
    sidecar_d_state: int = 64
    sidecar_expand: int = 2
    sidecar_headdim: int = 64
    sidecar_ngroups: int = 1
    sidecar_chunk_size: int = 64
    sidecar_d_conv: int = 4

    hybrid_layers: list[int] | None = None
    hybrid_feature_dim: int = 64
    hybrid_tie_feature_maps: bool = True

    def __post_init__(self, **kwargs):
        self._check_fields(torch_dtype=kwargs.get("torch_dtype"))  # before the defaults below compute with them
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.sidecar_layers = sorted(self.sidecar_layers or [])
        self.hybrid_layers = sorted(self.hybrid_layers or [])
        super().__post_init__(**kwargs)
        self._check()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """transformers sets keyword overrides (`from_pretrained(path, num_hidden_layers=6)`) on the built config, past
        the checks of __post_init__: give them to the constructor instead, so they are checked (and derived from) like
        the file's own values. dtype keeps transformers' handling ("auto" means the file's)."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"dtype"}
        overrides = {key: kwargs.pop(key) for key in list(kwargs) if key in fields}
        return super().from_dict({**config_dict, **overrides}, **kwargs)

    def _check_fields(self, torch_dtype=None) -> None:
        """Each field on its own: its type and range (FIELD_RULES), and the dtype's name."""
        for names, valid, expected in FIELD_RULES:
            for name in names:
                value = getattr(self, name)
                if not valid(value):
                    raise ValueError(f"{name} must be {expected}, got {value!r}")
        for name, value in (("dtype", self.dtype), ("torch_dtype", torch_dtype)):  # a name, or a torch.dtype
            if value is not None and (value if isinstance(value, str) else str(value).removeprefix("torch.")) not in DTYPES:
                raise ValueError(f"{name} must be one of {DTYPES}, got {value!r}")

    def _check(self) -> None:
        """Every bad value raises a ValueError that names it, at construction and at load time."""
        self._check_fields()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        for name in ("mask_token_id", "pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, list | tuple) else [] if value is None else [value]
            if any(not 0 <= i < self.vocab_size for i in ids):
                verb = "has ids" if isinstance(value, list | tuple) else "is"
                raise ValueError(f"{name} {value} {verb} outside the vocabulary [0, {self.vocab_size})")
        eos = self.eos_token_id if isinstance(self.eos_token_id, list | tuple) else [self.eos_token_id]
        if self.mask_token_id is not None and self.mask_token_id in eos:
            raise ValueError(f"mask_token_id {self.mask_token_id} is also the EOS token id ({self.eos_token_id}): "
                             "every [MASK] still to decode would read as the end of the text, and no EOS could be "
                             "generated")
        if self.mask_token_id is not None and self.pad_token_id == self.mask_token_id:
            raise ValueError(f"pad_token_id {self.pad_token_id} is also the mask token id: padding would read as "
                             "[MASK] positions to decode")
        if self.mask_token_id is not None and self.bos_token_id == self.mask_token_id:
            raise ValueError(f"bos_token_id {self.bos_token_id} is also the mask token id: every [MASK] would read as "
                             "the start of a text")
        for name in ("sidecar_layers", "hybrid_layers"):
            layers = getattr(self, name)
            bad = [i for i in layers if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ValueError(f"{name} {bad} out of range for a model with {self.num_hidden_layers} layers")
            if len(set(layers)) != len(layers):
                raise ValueError(f"{name} lists a layer twice: {layers}")
        attention = ATTENTION[self.attention]
        if self.sidecar_layers and not attention.streams:
            raise ValueError("sidecar_layers need a causal or block_causal model: bidirectional attention already sees the right context")
        if self.sidecar_layers:
            d_inner = self.sidecar_expand * self.hidden_size
            if d_inner % self.sidecar_headdim:
                raise ValueError(f"sidecar inner size {d_inner} is not divisible by sidecar_headdim {self.sidecar_headdim}")
            if (d_inner // self.sidecar_headdim) % self.sidecar_ngroups:
                raise ValueError(
                    f"sidecar heads ({d_inner // self.sidecar_headdim}) are not divisible by sidecar_ngroups "
                    f"({self.sidecar_ngroups})"
                )
        if self.hybrid_layers and not attention.streams:
            raise ValueError("hybrid_layers need a causal or block_causal model: a bidirectional one commits no blocks")
        if self.hybrid_layers and attention.window is not None:
            raise ValueError(f"hybrid_layers read every committed block linearly: they do not combine with "
                             f"{self.attention!r} attention's window")
        if self.hybrid_layers and self.hybrid_feature_dim > self.head_dim:
            raise ValueError(f"hybrid_feature_dim {self.hybrid_feature_dim} is above head_dim {self.head_dim}")
        rope_type = (self.rope_parameters or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported: its frequencies change with the sequence length, which "
                f"would make cached keys inexact; supported: {ROPE_TYPES}"
            )
        theta = (self.rope_parameters or {}).get("rope_theta", 10000.0)
        if not _is_number(theta) or theta <= 0:
            raise ValueError(f"rope_parameters.rope_theta must be a positive number, got {theta!r}")

    def check_lora_targets(self, target_modules, what: str) -> None:
        """Refuse a LoRA on lm_head or embed_tokens when the two share one weight (tie_word_embeddings): merging it
        adds B @ A to the shared weight, which changes the other one too, so the merged model is not the adapted
        one. `target_modules` as peft reads it: names matched as suffixes, or one regular expression."""
        if not self.tie_word_embeddings:
            return
        if isinstance(target_modules, str):
            hit = [name for name in ("lm_head", "model.embed_tokens") if re.fullmatch(target_modules, name)]
        else:
            hit = [name for name in target_modules if name.rsplit(".", 1)[-1] in ("lm_head", "embed_tokens")]
        if hit:
            raise ValueError(f"{what} puts a LoRA on {', '.join(hit)} of a model with tied embeddings (lm_head and "
                             "embed_tokens share one weight): merged, it would change both; leave them out")

    @property
    def kind(self) -> ModelKind:
        """What the attention, prediction, sidecar and hybrid fields make of the model (r2lm.kind)."""
        return ModelKind.of(self)

    @property
    def num_sidecar_parameters(self) -> int:
        """Parameters one sidecar adds (norm, mixer, gate), for sizing sidecars against the backbone."""
        d, d_inner = self.hidden_size, self.sidecar_expand * self.hidden_size
        nheads = d_inner // self.sidecar_headdim
        conv_dim = d_inner + 2 * self.sidecar_ngroups * self.sidecar_d_state
        in_proj = d * (d_inner + conv_dim + nheads)
        conv = conv_dim * (self.sidecar_d_conv + 1)
        return d + in_proj + conv + 3 * nheads + d_inner + d_inner * d + 1
