"""R2LMForDiffusionLM: a Llama / Qwen2 / Qwen3 decoder with the bifocal additions (DESIGN sections 1-2).

One forward computes logits for a layout (r2lm.layout). Three uses of it:

    model(input_ids, layout=...)          training and full recompute (the test oracle)
    model.prefill / model.commit          clean tokens appended to a KVCache, no sidecar
    model.denoise                         one window read against the cache, sidecar on, cache unchanged

Parameter names are transformers' (`model.layers.N.self_attn.q_proj.weight`, ...), so a Qwen3 / Qwen2 / Llama
state dict loads by name; the sidecar of layer N lives under `model.layers.N.sidecar.*`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutput

from r2lm.cache import KVCache, cache_signature
from r2lm.configuration_r2lm import R2LMConfig
from r2lm.layers import MLP, Attention, BlockHybridAttention, Mamba2Mixer, ReverseSidecar, RMSNorm, RotaryEmbedding
from r2lm.layers.hybrid import HybridParts
from r2lm.layout import Layout
from r2lm.ops.flex import BlockSparse, block_sparse


@dataclass
class AttentionPlan:
    """How the layers of one forward attend, derived once from the layout."""

    mask: torch.Tensor | None  # softmax layers: [B or 1, 1, T, keys] or None with is_causal / no mask / block_mask
    is_causal: bool
    own: torch.Tensor | None = None  # block-hybrid layers over a cache: softmax part [B or 1, 1, T, T]
    earlier: torch.Tensor | None = None  # block-hybrid layers over a cache: linear part [B or 1, 1, T, T]
    block_mask: BlockSparse | None = None  # softmax layers under flex_attention (no cache): the layout's tiles
    hybrid: HybridParts | None = None  # block-hybrid layers without a cache: the chunked (linear-time) form
    valid: torch.Tensor | None = None  # [B, T] real tokens, None when all are
    commit: bool = False  # the input is appended to the cache
    transfer: list | None = None  # attention transfer: hybrid layers append their MSE to the softmax teacher


class R2LMDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: R2LMConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.sidecar = ReverseSidecar(config) if layer_idx in config.sidecar_layers else None

    def forward(self, h, cos, sin, plan, cache=None, windows=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, plan, cache)
        h = h + self.mlp(self.post_attention_layernorm(h))
        if self.sidecar is not None and windows is not None:
            h = self.sidecar(h, windows)
        return h


class R2LMModel(nn.Module):
    def __init__(self, config: R2LMConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=None)
        self.layers = nn.ModuleList(R2LMDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, layout: Layout, cache: KVCache | None = None, commit: bool = False,
                transfer: list | None = None):
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(h, layout.positions)
        if transfer is not None and cache is not None:
            raise ValueError("attention transfer runs on a full layout, without a cache")
        plan = self.plan(layout, cache, commit, transfer)
        windows = layout.windows if self.config.sidecar_layers else None
        for layer in self.layers:
            h = layer(h, cos, sin, plan, cache, windows)
        return self.norm(h)

    def plan(self, layout: Layout, cache: KVCache | None, commit: bool, transfer: list | None = None) -> AttentionPlan:
        kind = self.config.attention
        # A single unpadded clean chunk with no cache needs no mask tensor: SDPA's causal (or unmasked) kernel.
        plain = cache is None and layout.is_plain
        # softmax layers (or, under attention transfer, the softmax teacher of every hybrid layer) need a mask
        softmax = transfer is not None or len(self.config.hybrid_layers) < self.config.num_hidden_layers
        mask = blocks = None
        if softmax and not plain:
            if cache is not None:
                mask = layout.attention_mask(kind, cache.valid[:, : cache.length], cache.stale_suffix(layout.length))
            elif self.config._attn_implementation == "flex_attention":
                blocks = block_sparse(layout, kind)
            else:
                mask = layout.attention_mask(kind)
        plan = AttentionPlan(mask, plain and kind == "causal", valid=layout.valid, commit=commit, block_mask=blocks,
                             transfer=transfer)
        if self.config.hybrid_layers and cache is None:
            plan.hybrid = HybridParts.of(layout, kind, self.config.block_size)
        elif self.config.hybrid_layers:
            own, earlier = layout.mask_parts(kind)
            plan.own, plan.earlier = own[:, None], earlier[:, None]
        return plan


class R2LMPreTrainedModel(PreTrainedModel):
    config_class = R2LMConfig
    config: R2LMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["R2LMDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True  # training and full-recompute forwards attend through the layout's BlockMask

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """`attn_implementation` of from_pretrained / the config: "flex_attention" (block-sparse attention from the
        layout's predicate, for forwards without a cache) or "sdpa" (SDPA over the dense mask: the reference).
        Unset: flex_attention where CUDA is available (torch's flex kernels run forward and backward there), else
        sdpa. Forwards over a cache (prefill, denoise, commit) always use SDPA."""
        if requested_attention is None:
            requested_attention = "flex_attention" if _flex_on_cuda() else "sdpa"
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, Mamba2Mixer):
            module.reset_ssm_parameters()
            init.kaiming_uniform_(module.conv1d.weight, a=5**0.5)
            init.zeros_(module.conv1d.bias)
        elif isinstance(module, ReverseSidecar):
            init.zeros_(module.gate)
        elif isinstance(module, BlockHybridAttention):
            module.reset_parameters()


class R2LMForDiffusionLM(R2LMPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: R2LMConfig):
        super().__init__(config)
        self.model = R2LMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        layout: Layout | None = None,
        cache: KVCache | None = None,
        update_cache: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
        **unused,
    ) -> CausalLMOutput:
        """Logits [B, T, vocab] for `input_ids` [B, T]; `logits_to_keep` (transformers' convention) limits them to
        the last k columns (an int k > 0) or to the given column indices (a tensor).

        Without a layout the input is one clean chunk: causal for a causal model (a plain LM forward, positions
        from the left-padded `attention_mask`), fully visible for block_causal and bidirectional models. With a
        cache, its committed tokens precede the input; `update_cache=True` appends the input to it, which is
        only exact for clean tokens."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, length] with length > 0, got {tuple(input_ids.shape)}")
        if layout is None:
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            start = cache.next_position if cache is not None else 0
            layout = Layout.span(attention_mask, start=start)
        if layout.length != input_ids.shape[1]:
            raise ValueError(f"layout has {layout.length} columns but input_ids has {input_ids.shape[1]}")
        if cache is not None:
            self._check_cache(cache, input_ids)
        if update_cache and (cache is None or bool(layout.noisy.any())):
            raise ValueError("update_cache needs a cache and a layout of clean tokens only (windows are never cached)")
        h = self.model(input_ids, layout, cache, commit=update_cache)
        if update_cache:
            cache.advance(layout.valid_mask(input_ids.shape[0]))
        if isinstance(logits_to_keep, torch.Tensor):
            h = h[:, logits_to_keep]
        elif logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        return CausalLMOutput(logits=logits)

    def _check_cache(self, cache: KVCache, input_ids: torch.Tensor) -> None:
        if cache.batch_size != input_ids.shape[0]:
            raise ValueError(f"cache batch size {cache.batch_size} != input batch size {input_ids.shape[0]}")
        if cache.signature != cache_signature(self.config):
            raise ValueError("cache was built for a different model configuration")
        cache.check_room(input_ids.shape[1])

    # ------------------------------------------------------------------ the cached uses of one forward

    def new_cache(self, batch_size: int, max_length: int, dtype=None, device=None) -> KVCache:
        """A preallocated cache for `batch_size` rows of up to `max_length` tokens (prompt + generation)."""
        if max_length > self.config.max_position_embeddings:
            raise ValueError(
                f"max_length {max_length} exceeds the model's max_position_embeddings {self.config.max_position_embeddings}"
            )
        return KVCache(self.config, batch_size, max_length, dtype or self.dtype, device or self.device)

    def prefill(self, input_ids, cache: KVCache, attention_mask=None, logits_to_keep: int = 1) -> torch.Tensor:
        """Append a left-padded prompt to the cache as clean context, sidecar off. Returns the last logits.

        Where chunks matter (block_causal attention, block-hybrid layers) the prompt goes in block by block on each
        row's position grid (block k opens at k * block_size, one token earlier under `shift`), exactly as
        training chunks its clean stream; for a causal softmax model one chunk computes the same thing."""
        layout = self.prompt_layout(_ones_if_none(attention_mask, input_ids), start=cache.next_position)
        return self(input_ids, layout=layout, cache=cache, update_cache=True, logits_to_keep=logits_to_keep).logits

    def prompt_layout(self, attention_mask, start=0, chunk: int = 0) -> Layout:
        """The layout prefill gives a prompt: one clean chunk, or the block grid where chunks matter."""
        if self.config.attention != "block_causal" and not self.config.hybrid_layers:
            return Layout.span(attention_mask, start=start, chunk=chunk)
        offset = int(self.config.prediction == "shift")
        return Layout.span(attention_mask, start=start, chunk=chunk, grid=self.config.block_size, grid_offset=offset)

    def commit(self, input_ids, cache: KVCache, attention_mask=None, logits_to_keep: int = 1) -> torch.Tensor:
        """Append a finished block to the cache as one chunk of clean tokens, sidecar off."""
        layout = Layout.span(_ones_if_none(attention_mask, input_ids), start=cache.next_position)
        return self(input_ids, layout=layout, cache=cache, update_cache=True, logits_to_keep=logits_to_keep).logits

    def denoise(self, window_ids, cache: KVCache, attention_mask=None) -> torch.Tensor:
        """Logits of one window [B, T] read against the cache, sidecar on. The committed cache is unchanged."""
        layout = Layout.span(_ones_if_none(attention_mask, window_ids), start=cache.next_position, noisy=True)
        return self(window_ids, layout=layout, cache=cache).logits

    def diffusion_generate(self, input_ids, attention_mask=None, **options):
        """`r2lm.generate(self, ...)`: cached parallel decoding; returns a GenerateOutput."""
        from r2lm.generation import generate

        return generate(self, input_ids, attention_mask, **options)

    # ------------------------------------------------------------------ training helpers

    def attention_transfer(self, input_ids, layout: Layout | None = None, attention_mask=None) -> torch.Tensor:
        """Per-hybrid-layer MSE [len(hybrid_layers)] between each hybrid layer's attention output (per head, before
        o_proj) and its own softmax attention over the same keys (stage 1 of LoLCATs / LLaDA-Hybrid). Every
        layer passes the teacher's output on, so the losses are layer-local and errors do not compound."""
        if not self.config.hybrid_layers:
            raise ValueError("attention transfer needs hybrid_layers (python -m convert to-hybrid ...)")
        if layout is None:
            layout = Layout.span(_ones_if_none(attention_mask, input_ids))
        transfer = []
        self.model(input_ids, layout, transfer=transfer)
        return torch.stack(transfer)

    def freeze_backbone(self) -> list[str]:
        """Train only the sidecars and their gates (R2LM's plug-in variant). Returns the trainable names."""
        if not self.config.sidecar_layers:
            raise ValueError("freeze_backbone leaves nothing to train: the model has no sidecar_layers")
        trainable = []
        for name, param in self.named_parameters():
            param.requires_grad_(".sidecar." in name)
            if param.requires_grad:
                trainable.append(name)
        return trainable


def _flex_on_cuda() -> bool:
    from transformers.utils import is_torch_flex_attn_available

    return torch.cuda.is_available() and is_torch_flex_attn_available()


def _ones_if_none(attention_mask, input_ids):
    return torch.ones_like(input_ids) if attention_mask is None else attention_mask
