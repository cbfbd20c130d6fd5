"""R2LMForDiffusionLM: a Llama / Qwen2 / Qwen3 decoder with the bifocal additions (docs/design.md sections 1-2).

One forward computes logits for a layout (r2lm.layout). Three uses of it:

    model(input_ids, layout=...)          training and full recompute (the test oracle)
    model.prefill / model.commit          clean tokens appended to a KVCache, no sidecar
    model.denoise                         one window read against the cache, sidecar on, cache unchanged

Everything the layers need from a layout (RoPE tables, attention masks, the sidecar's windows, where keys go in
the cache) is derived once per forward into a ForwardPlan; a decoder that runs many forwards of one shape builds
its plans from masks it keeps (r2lm.generation.window) and passes them as `plan=`.

The stack composes: `model.model(hidden_states=h, plan=plan, layers=range(a, b), norm=False)` runs layers a..b-1
only, so a caller can run part of the model, change the hidden states and go on (r2lm.prefix.bicache).

Parameter names are transformers' (`model.layers.N.self_attn.q_proj.weight`, ...), so a Qwen3 / Qwen2 / Llama
state dict loads by name; the sidecar of layer N lives under `model.layers.N.sidecar.*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutput
from transformers.utils import ModelOutput, is_torch_flex_attn_available

from r2lm.cache import KVCache, cache_signature
from r2lm.checkpoints.hf import check_weights, read_generation_config, weight_files
from r2lm.configuration_r2lm import R2LMConfig
from r2lm.generation.mixin import R2LMGenerationMixin
from r2lm.generation_config import decoding_generation_config
from r2lm.layers import MLP, Attention, BlockHybridAttention, Mamba2Mixer, ReverseSidecar, RMSNorm, RotaryEmbedding
from r2lm.layout import Layout
from r2lm.plan import ForwardPlan, plan_of


@dataclass
class R2LMModelOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None = None
    attention_transfer: torch.Tensor | None = None  # [hybrid layers run] MSE to the softmax teacher (transfer plans)
    captured: tuple[torch.Tensor, ...] | None = None  # the residual stream after each layer of `capture`, [B, T, hidden]


class R2LMDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: R2LMConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.sidecar = ReverseSidecar(config) if layer_idx in config.sidecar_layers else None

    def forward(self, h, plan: ForwardPlan, cache=None):
        """(h, attention-transfer MSE or None). The MSE is an output, not a side effect, so gradient checkpointing
        (which runs the forward again in the backward) cannot count it twice."""
        out, mse = self.self_attn(self.input_layernorm(h), plan, cache)
        h = h + out
        h = h + self.mlp(self.post_attention_layernorm(h))
        if self.sidecar is not None and plan.windows is not None:
            h = self.sidecar(h, plan.windows)
        return h, mse


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


class R2LMModel(R2LMPreTrainedModel):
    """The decoder stack without the LM head (what `AutoModel` loads)."""

    def __init__(self, config: R2LMConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=None)
        self.layers = nn.ModuleList(R2LMDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids: torch.Tensor | None = None, plan: ForwardPlan | None = None,
                cache: KVCache | None = None, *, layout: Layout | None = None, hidden_states: torch.Tensor | None = None,
                layers: range | None = None, norm: bool = True, capture: tuple[int, ...] = ()) -> R2LMModelOutput:
        """Hidden states [B, T, hidden] of `input_ids` (or of `hidden_states`, the residual stream entering
        `layers`) under `plan` (or the plan of `layout`, default: one clean span). `layers`: the range of layer
        indices to run (default all); `norm=False` skips the final norm, to continue with another range.
        `capture`: layer indices whose output (the residual stream after the layer) is returned too, in that order
        (a drafter's context features, r2lm.drafter)."""
        if (input_ids is None) == (hidden_states is None):
            raise ValueError("give exactly one of input_ids and hidden_states")
        h = self.embed_tokens(input_ids) if input_ids is not None else hidden_states
        if plan is None:
            plan = self.plan(layout if layout is not None else Layout.span(torch.ones(h.shape[:2], device=h.device)),
                             cache)
        transfer, captured = [], {}
        first = layers.start if layers is not None else 0
        for i, layer in enumerate(self.layers[slice(layers.start, layers.stop) if layers is not None else slice(None)],
                                  start=first):
            h, mse = layer(h, plan, cache)
            if mse is not None:
                transfer.append(mse)
            if i in capture:
                captured[i] = h
        return R2LMModelOutput(self.norm(h) if norm else h, torch.stack(transfer) if transfer else None,
                               tuple(captured[i] for i in capture) if capture else None)

    def plan(self, layout: Layout, cache: KVCache | None = None, commit: int = 0, transfer: bool = False) -> ForwardPlan:
        """The ForwardPlan of `layout` for this stack (r2lm.plan.plan_of)."""
        return plan_of(self.config, self.rotary_emb, layout, cache, commit, transfer, like=self.embed_tokens.weight)


class R2LMForDiffusionLM(R2LMPreTrainedModel, R2LMGenerationMixin):
    """The decoder stack and its LM head; `generate` (cached parallel decoding) comes from R2LMGenerationMixin."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: R2LMConfig):
        super().__init__(config)
        self.model = R2LMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self.generation_config = decoding_generation_config(config, self.generation_config)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, output_loading_info: bool = False, **kwargs):
        """transformers' `from_pretrained`, made strict: a checkpoint whose weights are not exactly the ones its config
        describes is refused with a ValueError naming them (transformers would keep a missing weight at its random
        initialisation and drop an unexpected one, with a warning).

        There is no exception here on purpose: modules a conversion adds (sidecars, block-hybrid feature maps and
        gates, a [MASK] embedding row) are added by the converters (r2lm-convert), which build the model from
        its config and load the backbone themselves, naming the new weights explicitly.

        From a local folder, first: its weight files are opened and checked against its checksums.sha256 (where it
        has one), and its generation_config.json must parse (transformers would use its built-in defaults in
        silence); each is refused with a ValueError naming the file."""
        path = pretrained_model_name_or_path
        folder = None if path is None else Path(path, kwargs.get("subfolder", ""))
        if folder is not None and folder.is_dir():
            if weight_files(folder):  # (a folder of .bin weights is left to transformers)
                check_weights(folder)
            if kwargs.get("generation_config") is None:
                read_generation_config(folder)
        # transformers >= 5.2x swaps its activation layers for Hugging Face Hub kernels on a GPU unless told not to:
        # a download (which fails offline, where HF_HUB_OFFLINE=1) of code r2lm is not tested against; r2lm's CUDA
        # paths are its own (r2lm.ops). use_kernels=True still asks for them.
        kwargs.setdefault("use_kernels", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        refuse_partial_load(info, pretrained_model_name_or_path)
        return (model, info) if output_loading_info else model

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
        logits_to_keep: int | torch.Tensor | slice = 0,
        labels: torch.Tensor | None = None,
        plan: ForwardPlan | None = None,
        return_dict: bool | None = None,
        capture: tuple[int, ...] = (),
        **unsupported,
    ) -> CausalLMOutput:
        """Logits [B, T, vocab] for `input_ids` [B, T]; `logits_to_keep` (transformers' convention) limits them to
        the last k columns (an int k > 0), to the given column indices (a tensor) or to a slice of columns.

        Without a layout the input is one clean chunk: causal for a causal model (a plain LM forward, positions
        from the left-padded `attention_mask`), fully visible for block_causal and bidirectional models. With a
        cache, its committed tokens precede the input; `update_cache=True` appends the input to it, which is
        only exact for clean tokens. `plan`: a prebuilt ForwardPlan instead of a layout (decoders); its `commit`
        leading columns are appended to the cache.

        `labels` [B, T] (-100 = ignored) gives `loss`: the cross-entropy of each labelled token under the model's
        prediction convention (`shift`: logits at t - 1 predict token t, as transformers' causal LMs; `inplace`:
        logits at t predict token t, as a masked LM on [MASK] inputs). Diffusion objectives: r2lm.diffusion.

        `capture`: layer indices whose outputs come back as `hidden_states` (every column; R2LMModel.forward)."""
        if unsupported:
            raise TypeError(
                f"R2LMForDiffusionLM.forward does not take {sorted(unsupported)}: it reads and writes an explicit "
                "cache (cache=model.new_cache(...)), and positions come from attention_mask or layout"
            )
        if return_dict is False:
            raise ValueError("return_dict=False is not supported: the forward returns a CausalLMOutput")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, length] with length > 0, got {tuple(input_ids.shape)}")
        if plan is not None and (layout is not None or attention_mask is not None or update_cache):
            raise ValueError("a prebuilt plan replaces layout, attention_mask and update_cache")
        if labels is not None:
            self._check_labels(labels, input_ids, layout or plan, logits_to_keep)
        if plan is None:
            if layout is None:
                if attention_mask is None:
                    attention_mask = torch.ones_like(input_ids)
                start = cache.next_position if cache is not None else 0
                layout = Layout.span(attention_mask, start=start)
            if layout.length != input_ids.shape[1]:
                raise ValueError(f"layout has {layout.length} columns but input_ids has {input_ids.shape[1]}")
            if update_cache and (cache is None or bool(layout.noisy.any())):
                raise ValueError("update_cache needs a cache and a layout of clean tokens only (windows are never cached)")
        if cache is not None:
            self._check_cache(cache, input_ids)
        if plan is None:
            plan = self.model.plan(layout, cache, commit=layout.length if update_cache else 0)
        out = self.model(input_ids, plan, cache, capture=capture)
        h = out.last_hidden_state
        if plan.commit:
            valid = plan.valid[:, : plan.commit] if plan.valid is not None else plan.commit
            cache.advance(valid)
        if isinstance(logits_to_keep, torch.Tensor | slice):
            h = h[:, logits_to_keep]
        elif logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        loss = None if labels is None else self._loss(logits, labels)
        return CausalLMOutput(loss=loss, logits=logits, hidden_states=out.captured)

    def _check_labels(self, labels, input_ids, layout, logits_to_keep) -> None:
        if layout is not None:
            raise ValueError("labels need a plain sequence (no layout); diffusion losses are in r2lm.diffusion")
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must match input_ids {tuple(input_ids.shape)}")
        if not isinstance(logits_to_keep, int) or logits_to_keep:
            raise ValueError("labels score every column: they do not combine with logits_to_keep")

    def _loss(self, logits, labels) -> torch.Tensor:
        if self.config.kind.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)

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
        """The layout prefill gives a prompt: one clean chunk, or the block grid where chunks matter (Layout.prompt)."""
        return Layout.prompt(attention_mask, self.config.kind, start=start, chunk=chunk)

    def commit(self, input_ids, cache: KVCache, attention_mask=None, logits_to_keep: int = 1) -> torch.Tensor:
        """Append a finished block to the cache as one chunk of clean tokens, sidecar off."""
        layout = Layout.span(_ones_if_none(attention_mask, input_ids), start=cache.next_position)
        return self(input_ids, layout=layout, cache=cache, update_cache=True, logits_to_keep=logits_to_keep).logits

    def denoise(self, window_ids, cache: KVCache, attention_mask=None) -> torch.Tensor:
        """Logits of one window [B, T] read against the cache, sidecar on. The committed cache is unchanged."""
        layout = Layout.span(_ones_if_none(attention_mask, window_ids), start=cache.next_position, noisy=True)
        return self(window_ids, layout=layout, cache=cache).logits

    # ------------------------------------------------------------------ training helpers

    def attention_transfer(self, input_ids, layout: Layout | None = None, attention_mask=None) -> torch.Tensor:
        """Per-hybrid-layer MSE [len(hybrid_layers)] between each hybrid layer's attention output (per head, before
        o_proj) and its own softmax attention over the same keys (stage 1 of LoLCATs / LLaDA-Hybrid). Every
        layer passes the teacher's output on, so the losses are layer-local and errors do not compound."""
        if not self.config.hybrid_layers:
            raise ValueError("attention transfer needs hybrid_layers (r2lm-convert to-hybrid ...)")
        if layout is None:
            layout = Layout.span(_ones_if_none(attention_mask, input_ids))
        return self.model(input_ids, self.model.plan(layout, transfer=True)).attention_transfer

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


def refuse_partial_load(info: dict, source, shown: int = 5) -> None:
    """Raise if a checkpoint lacked weights the model has, or held weights it has no place for (`info`: what
    from_pretrained's output_loading_info gives)."""
    problems = []
    for keys, what in ((info["missing_keys"], "missing from the checkpoint (they would stay randomly initialised)"),
                       (info["unexpected_keys"], "in the checkpoint but not in the model its config describes")):
        if keys:
            keys = sorted(keys)
            more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
            problems.append(f"{len(keys)} weight{'s' * (len(keys) > 1)} {what}: {', '.join(keys[:shown])}{more}")
    if problems:
        origin = "the state_dict given" if source is None else f"checkpoint {source}"
        raise ValueError(
            f"{origin} does not match its config: {'; '.join(problems)}. Check the config values that "
            "shape the model (num_hidden_layers, tie_word_embeddings, sidecar_layers, hybrid_layers, ...) against the "
            "checkpoint; new sidecar or block-hybrid layers are added by conversion (r2lm-convert from-hf / "
            "to-hybrid)"
        )


def _flex_on_cuda() -> bool:
    return torch.cuda.is_available() and is_torch_flex_attn_available()


def _ones_if_none(attention_mask, input_ids):
    return torch.ones_like(input_ids) if attention_mask is None else attention_mask
