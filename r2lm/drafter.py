"""A drafter for lossless verified decoding of a frozen pretrained target (docs/design.md 4, drafters; docs/notes/drafting.md).

The direction DFlash and EAGLE-3 took: a light model that reads the target's own context features and drafts a
block in one pass, at a fraction of a target forward's cost, so that the target's verification forward commits
several of its own greedy tokens at once. Whatever it drafts, the committed text is the target's.

    context   the target's residual stream after `feature_layers` (low, middle and high layers), at every
              committed token but the last: each layer's output normalised, concatenated, fused by one linear map
              and an RMSNorm, then projected by each drafter layer's own key / value projections into its cache
              ("KV injection": the drafter never runs its layers over the context, it reads what the target
              computed, appended a verification at a time); and the last such token's fused features, projected
              into every block column's input (EAGLE's direct path: the target's state just before the block)
    block     [last committed token, [MASK] * (b - 1)] at the next b positions: the token through the target's
              (frozen, shared) embeddings, [MASK] as a learnt vector; `num_hidden_layers` decoder layers of the
              target's width read the context cache and the block (in-block attention bidirectional or causal,
              optionally the reverse Mamba sidecar over the block: R2LM's layers, r2lm.layers)
    output    the target's final-norm-free LM head rows of a draft vocabulary (the `draft_vocab_size` tokens most
              frequent in the training data, EOS among them; all of them when 0): block column j proposes the
              token after the one j positions past the block's first

Layout "dflash" (DrafterConfig.layout) is vLLM's DFlash drafter instead, exactly: the raw captured layers fused and
normed into the context's K/V (no per-layer norms, no layer input norm before them), no direct path, q/k norm in every
layer; `r2lm-convert drafter-to-dflash` writes it as the folder vLLM's `dflash` speculative method loads.

A drafter is saved on its own (`save_pretrained`: its layers, fusion, mask vector and draft vocabulary, not the
target's weights) and bound to its target at use (`bind`), which refuses a target of another hidden size,
vocabulary or layer count. Training: `objective: drafter` of train/pretrain.py (the target frozen), whose loss is
r2lm.drafter_loss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers import initialization as init

from r2lm.cache import KVCache
from r2lm.checkpoints.hf import check_weights
from r2lm.checkpoints.manifest import verify_checkpoint, verify_files
from r2lm.checkpoints.zero import load_fp32_state_dict
from r2lm.configuration_r2lm import R2LMConfig
from r2lm.drafter_loss import DraftLoss, drafting_loss
from r2lm.layers import RMSNorm, RotaryEmbedding
from r2lm.layout import Layout
from r2lm.modeling_r2lm import R2LMDecoderLayer, refuse_partial_load
from r2lm.plan import plan_of
from r2lm.prefix.identity import ModelIdentity

IN_BLOCK = ("bidirectional", "causal")
# "r2lm": each captured layer normalised before fusing, each drafter layer's input norm before its context K/V, the
# last context token's features added to every block column (the direct path). "dflash": vLLM's DFlash computation
# (vllm/model_executor/models/qwen3_dflash.py), so that `r2lm-convert drafter-to-dflash` exports it exactly: the raw
# captured layers fused, the fusion's norm the context K/V's only input norm, no direct path, q/k norm in every layer.
LAYOUTS = ("r2lm", "dflash")


class DrafterConfig(PretrainedConfig):
    """The drafter's shape and the target it was made for.

    target_hidden_size, target_vocab_size, target_num_hidden_layers: the target's (checked by `bind`).
    feature_layers: target layer indices whose outputs are the context features.
    num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size, hidden_act,
    rms_norm_eps, rope_parameters, max_position_embeddings, qk_norm: the drafter's decoder layers (the target's
    attention geometry and RoPE by default: `for_target`).
    block_size: the draft length b. in_block: "bidirectional" or "causal" attention inside the block.
    layout: "r2lm" or "dflash" (LAYOUTS: which computation reads the context; "dflash" is vLLM's DFlash drafter).
    sidecar: a reverse Mamba sidecar over the block on every drafter layer (sidecar_d_state, sidecar_headdim,
    sidecar_expand: its shape). draft_vocab_size: the rows of the LM head it drafts from (0: every token)."""

    model_type = "r2lm_drafter"

    def __init__(self, target_hidden_size: int = 576, target_vocab_size: int = 49153, target_num_hidden_layers: int = 30,
                 feature_layers=(2, 8, 15, 22, 29), num_hidden_layers: int = 1, num_attention_heads: int = 9,
                 num_key_value_heads: int = 3, head_dim: int = 64, intermediate_size: int = 1536,
                 hidden_act: str = "silu", rms_norm_eps: float = 1e-5, rope_parameters: dict | None = None,
                 max_position_embeddings: int = 8192, qk_norm: bool = False, block_size: int = 8,
                 in_block: str = "bidirectional", sidecar: bool = False, sidecar_d_state: int = 32,
                 sidecar_headdim: int = 64, sidecar_expand: int = 1, draft_vocab_size: int = 0,
                 initializer_range: float = 0.02, target_digest: str | None = None, layout: str = "r2lm",
                 **kwargs):
        self.target_hidden_size, self.target_vocab_size = target_hidden_size, target_vocab_size
        self.target_num_hidden_layers = target_num_hidden_layers
        self.feature_layers = list(feature_layers)
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads, self.head_dim, self.intermediate_size = num_key_value_heads, head_dim, intermediate_size
        self.hidden_act, self.rms_norm_eps = hidden_act, rms_norm_eps
        self.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
        self.max_position_embeddings, self.qk_norm, self.block_size = max_position_embeddings, qk_norm, block_size
        self.in_block, self.sidecar, self.layout = in_block, sidecar, layout
        self.sidecar_d_state, self.sidecar_headdim, self.sidecar_expand = sidecar_d_state, sidecar_headdim, sidecar_expand
        self.draft_vocab_size, self.initializer_range = draft_vocab_size, initializer_range
        self.target_digest = target_digest  # which target it was trained for (`target_digest`): bind() warns on another
        super().__init__(**kwargs)
        self._check()

    def _check(self) -> None:
        for name in ("target_hidden_size", "target_vocab_size", "target_num_hidden_layers", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "block_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.feature_layers or any(not isinstance(i, int) or not 0 <= i < self.target_num_hidden_layers
                                          for i in self.feature_layers):
            raise ValueError(f"feature_layers must be target layer indices in [0, {self.target_num_hidden_layers}), "
                             f"got {self.feature_layers!r}")
        if len(set(self.feature_layers)) != len(self.feature_layers):
            raise ValueError(f"feature_layers lists a layer twice: {self.feature_layers}")
        if self.in_block not in IN_BLOCK:
            raise ValueError(f"in_block must be one of {IN_BLOCK}, got {self.in_block!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "dflash" and self.block_size < 2:
            raise ValueError("layout 'dflash' drafts block_size - 1 tokens (its first column is the last committed "
                             "token's): block_size must be at least 2")
        if self.layout == "dflash" and (self.sidecar or not self.qk_norm):
            raise ValueError("layout 'dflash' is vLLM's DFlash drafter, whose layers are Qwen3's: qk_norm=True and no "
                             f"sidecar (got qk_norm={self.qk_norm}, sidecar={self.sidecar})")
        if not isinstance(self.draft_vocab_size, int) or not 0 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft_vocab_size must be in [0, {self.target_vocab_size}], got {self.draft_vocab_size!r}")
        if isinstance(self.initializer_range, bool) or not isinstance(self.initializer_range, int | float) \
                or not self.initializer_range >= 0:
            raise ValueError(f"initializer_range must be a non-negative number, got {self.initializer_range!r}")
        if self.max_position_embeddings < self.block_size:
            raise ValueError(f"max_position_embeddings {self.max_position_embeddings} is below the block size "
                             f"{self.block_size}: a block would not fit")
        if self.target_digest is not None and not isinstance(self.target_digest, str):
            raise ValueError(f"target_digest must be a string (target_digest(target)), got {self.target_digest!r}")
        self.stack_config()  # the layers' own checks (heads, RoPE, sidecar shape)

    def check_target(self, target_config) -> None:
        """Refuse a target of another hidden size, vocabulary or layer count than the one this drafter is made for."""
        tc = target_config
        differ = [f"{what} {ours} (the drafter's target) vs {theirs}" for what, ours, theirs in (
            ("hidden size", self.target_hidden_size, tc.hidden_size),
            ("vocabulary", self.target_vocab_size, tc.vocab_size),
            ("layer count", self.target_num_hidden_layers, tc.num_hidden_layers)) if ours != theirs]
        if differ:
            raise ValueError(f"this drafter was made for another target: {'; '.join(differ)}")

    @property
    def draft_length(self) -> int:
        """Tokens one block drafts: r2lm's layout reads a guess off every column (column j: the token j + 1 past the
        opener); DFlash's off the [MASK] columns only (column j: the token j past it), as vLLM samples them."""
        return self.block_size if self.layout == "r2lm" else self.block_size - 1

    @classmethod
    def for_target(cls, target_config, **choices) -> DrafterConfig:
        """A drafter config with the target's width, attention geometry and RoPE; `choices` override the rest."""
        fields = dict(target_hidden_size=target_config.hidden_size, target_vocab_size=target_config.vocab_size,
                      target_num_hidden_layers=target_config.num_hidden_layers,
                      num_attention_heads=target_config.num_attention_heads,
                      num_key_value_heads=target_config.num_key_value_heads, head_dim=target_config.head_dim,
                      intermediate_size=target_config.intermediate_size, hidden_act=target_config.hidden_act,
                      rms_norm_eps=target_config.rms_norm_eps, rope_parameters=target_config.rope_parameters,
                      max_position_embeddings=target_config.max_position_embeddings,
                      qk_norm=target_config.qk_norm or choices.get("layout") == "dflash")
        layers, mine = target_config.num_hidden_layers, choices.get("num_hidden_layers", 1)
        # low to high, evenly; with the output of the layer under the drafter's copy of the top layers (`start_from`:
        # its keys and values are then the target's own) and the last layer's
        below = max(layers - 1 - mine, 0)
        fields["feature_layers"] = sorted({round(x * below / 4) for x in range(5)} | {below, layers - 1})
        fields.update(choices)
        return cls(**fields)

    def stack_config(self) -> R2LMConfig:
        """The R2LMConfig of the drafter's decoder layers (no embedding of their own: they read hidden states)."""
        return R2LMConfig(vocab_size=1, hidden_size=self.target_hidden_size, intermediate_size=self.intermediate_size,
                          num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                          num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                          hidden_act=self.hidden_act, rms_norm_eps=self.rms_norm_eps,
                          rope_parameters=self.rope_parameters, max_position_embeddings=self.max_position_embeddings,
                          qk_norm=self.qk_norm, attention="block_causal" if self.in_block == "bidirectional" else "causal",
                          block_size=self.block_size,
                          sidecar_layers=list(range(self.num_hidden_layers)) if self.sidecar else [],
                          sidecar_d_state=self.sidecar_d_state, sidecar_headdim=self.sidecar_headdim,
                          sidecar_expand=self.sidecar_expand, sidecar_chunk_size=max(self.block_size, 1))


SHIPPED = Path(__file__).parent / "drafters"  # the drafters r2lm ships, one folder per target (Drafter.shipped)


def target_digest(target) -> str:
    """Which model a drafter drafts for: the forward its verification runs (the target's config fields that change
    a forward and every weight, the sidecars' left out: verification runs without them, so a converted model and
    the same model with trained sidecars share one digest)."""
    identity = ModelIdentity.of(target)
    config = {k: v for k, v in identity.config.items() if not k.startswith("sidecar_") and k != "block_size"}
    tensors = {k: v for k, v in identity.tensors.items() if ".sidecar." not in k}
    return hashlib.blake2b(json.dumps([config, tensors], sort_keys=True).encode(), digest_size=8).hexdigest()


class Drafter(PreTrainedModel):
    config_class = DrafterConfig
    base_model_prefix = "drafter"
    _no_split_modules = ["R2LMDecoderLayer"]

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        self.stack = config.stack_config()
        self.stack._attn_implementation = "sdpa"
        width = config.target_hidden_size
        self.fuse = nn.Linear(len(config.feature_layers) * width, width, bias=False)
        self.fuse_norm = RMSNorm(width, eps=config.rms_norm_eps)
        # the last context token's features, into every block column (layout "r2lm"; DFlash has no such path)
        self.direct = nn.Linear(width, width, bias=False) if config.layout == "r2lm" else None
        self.layers = nn.ModuleList(R2LMDecoderLayer(self.stack, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(width, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(self.stack)
        self.mask_embedding = nn.Parameter(torch.zeros(width))
        size = config.draft_vocab_size or config.target_vocab_size
        self.register_buffer("draft_ids", torch.arange(size), persistent=True)  # target ids of the draft vocabulary
        self.target = None  # what it reads of its target (Bound): set by bind()
        self._bound_to = None  # which target (and which version of its head) `target` was read from
        # the head's product over the target's rows: F.linear, or the tuner of r2lm.ops.linear.install(drafter)
        self.product = F.linear
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' `from_pretrained`, made strict as R2LMForDiffusionLM's: a folder's weights are checked against
        its checksums.sha256, and a missing or unexpected weight is refused, naming it."""
        folder = Path(pretrained_model_name_or_path)
        if folder.is_dir():
            if not (folder / "config.json").is_file():
                raise ValueError(f"{folder} is not a drafter folder (no config.json): train one with train/pretrain.py "
                                 "objective=drafter (its final/)")
            check_weights(folder)
            verify_files(folder, [folder / "config.json"])  # an edited config is a different drafter
        kwargs.setdefault("use_kernels", False)  # no Hub kernels (R2LMForDiffusionLM.from_pretrained says why)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        refuse_partial_load(info, pretrained_model_name_or_path)
        model.check_draft_ids(pretrained_model_name_or_path)
        return model

    def check_draft_ids(self, where) -> None:
        """The draft vocabulary must name tokens of the target's vocabulary, each once."""
        ids = self.draft_ids
        bad = ids[(ids < 0) | (ids >= self.config.target_vocab_size)]
        if bad.numel():
            raise ValueError(f"{where}: the draft vocabulary holds token id {int(bad[0])}, outside the target's "
                             f"vocabulary [0, {self.config.target_vocab_size})")
        if ids.unique().numel() != ids.numel():
            raise ValueError(f"{where}: the draft vocabulary lists a token twice")

    @classmethod
    def shipped(cls, target) -> Drafter | None:
        """The drafter r2lm ships for `target` (r2lm/drafters/: one folder per target, found by its target_digest), in
        eval mode and the target's dtype; None when none is made for it. Its files are checked against their
        checksums (a damaged copy is refused, naming the file)."""
        digest = target_digest(target)
        for folder in sorted(SHIPPED.iterdir()) if SHIPPED.is_dir() else []:
            config = folder / "config.json"
            if config.is_file() and json.loads(config.read_text()).get("target_digest") == digest:
                return cls.from_pretrained(folder).to(target.dtype).eval()
        return None

    @classmethod
    def from_training_checkpoint(cls, folder) -> Drafter:
        """The drafter of a training checkpoint (OUTPUT_DIR/checkpoints/step-N of train/pretrain.py objective=drafter):
        its files checked against their manifest, its fp32 weights reassembled from the ZeRO shards."""
        folder = Path(folder)
        verify_checkpoint(folder)
        drafter = cls(DrafterConfig.from_pretrained(folder))
        drafter.load_state_dict(load_fp32_state_dict(folder.parent, folder.name), strict=True)
        return drafter.eval()

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self:
            init.normal_(self.mask_embedding, std=self.config.initializer_range)
            for layer in self.layers:
                if layer.sidecar is not None:
                    init.constant_(layer.sidecar.gate, 0.5)  # a drafter's sidecar starts open: it learns from step 0

    # ------------------------------------------------------------------ the target

    def check_target(self, target_config) -> None:
        """Refuse a target of another hidden size, vocabulary or layer count than the one the drafter was made for."""
        self.config.check_target(target_config)

    def bind(self, target) -> Drafter:
        """Read the target's embeddings and LM head (shared, not copied into the drafter's weights; the head's draft
        rows are gathered once per target). Refuses a target of another shape; warns, naming both, when the target
        is not the one the drafter was trained for (its outputs stay the target's own: only acceptance suffers)."""
        self.check_target(target.config)
        head = target.lm_head.weight.detach()
        if self.target is not None and self._bound_to == (id(target), head.data_ptr(), head._version):
            return self
        if self.config.target_digest is not None:
            digest = target_digest(target)
            if digest != self.config.target_digest:
                warnings.warn(f"this drafter ({self.config.name_or_path or 'unsaved'}) was trained for another target "
                              f"(digest {self.config.target_digest}), not for {target.config.name_or_path or 'this model'} "
                              f"(digest {digest}): its drafts will rarely be accepted", UserWarning, stacklevel=2)
        self._bound_to = (id(target), head.data_ptr(), head._version)
        self.target = Bound(target.model.embed_tokens, head.index_select(0, self.draft_ids.to(head.device)),
                            target.model.norm, head)
        return self

    def _bound(self):
        if self.target is None:
            raise ValueError("the drafter reads its target's embeddings and LM head: call drafter.bind(target) first")
        like, rows = self.fuse.weight, self.target.rows
        if rows.dtype != like.dtype or rows.device != like.device:  # the drafter moved or was cast since bind()
            self.target = dataclasses.replace(self.target, rows=rows.to(device=like.device, dtype=like.dtype))
        return self.target

    @torch.no_grad()
    def start_from(self, target) -> None:
        """Initialise from the target: the drafter's layers are copies of its top layers (attention and MLP; a
        sidecar stays as it is) and its final norm the target's; where the output of the layer just under them is a
        feature, the fusion starts as that feature alone, so the context's keys and values are at first exactly the
        ones the target's own top layers compute (in the "dflash" layout, whose context K/V have no input norm of
        their own, the fusion's norm starts as the first layer's input norm; its q/k norms, which a Llama target lacks,
        start as ones); the direct path starts as the identity (the block reads the state just before it). Needs the
        target's layer shapes (a drafter made with `DrafterConfig.for_target`)."""
        count = len(target.model.layers)
        top = target.model.layers[count - len(self.layers):]
        for mine, theirs in zip(self.layers, top, strict=True):
            state = {k: v for k, v in theirs.state_dict().items() if not k.startswith("sidecar.")}
            missing = mine.load_state_dict(state, strict=False).missing_keys
            if any(not k.startswith(("sidecar.", "self_attn.q_norm.", "self_attn.k_norm.")) for k in missing):
                raise ValueError(f"the drafter's layers differ from the target's: {missing[:3]}")
        self.norm.weight.copy_(target.model.norm.weight)
        below, width = count - len(self.layers) - 1, self.config.target_hidden_size
        if below in self.config.feature_layers:
            slot = self.config.feature_layers.index(below)
            self.fuse.weight.zero_()[:, slot * width : (slot + 1) * width] = torch.eye(width)
            self.fuse_norm.weight.fill_(1.0)
        if self.direct is None:
            self.fuse_norm.weight.copy_(self.layers[0].input_layernorm.weight)
        else:
            self.direct.weight.copy_(torch.eye(width))

    # ------------------------------------------------------------------ context

    def features(self, captured) -> torch.Tensor:
        """Fused context features [B, T, hidden] from the target's captured layer outputs (each [B, T, hidden])."""
        dtype = self.fuse.weight.dtype
        if self.config.layout == "dflash":
            return self.fuse_norm(self.fuse(torch.cat([h.to(dtype) for h in captured], -1)))
        parts = [(h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) for h in captured]
        return self.fuse_norm(self.fuse(torch.cat(parts, -1)))

    def new_context(self, batch: int, max_length: int) -> DraftContext:
        """An empty context for `batch` rows of up to `max_length` columns (r2lm.generation.drafts keeps one per call)."""
        like = self.fuse.weight
        return DraftContext(KVCache(self.stack, batch, max_length, like.dtype, like.device),
                            torch.zeros(batch, self.config.target_hidden_size, dtype=like.dtype, device=like.device))

    def append(self, context: DraftContext, captured, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Append committed tokens to the context: `captured` the target's outputs at feature_layers for them
        ([B, T, hidden] each), `valid` [B, T] which of the T columns are real (None: all of them). Returns
        their fused features [B, T, hidden]."""
        cache, c = context.kv, self.features(captured)
        mask = torch.ones(c.shape[:2], dtype=torch.long, device=c.device) if valid is None else valid.long()
        layout = Layout.span(mask, start=cache.next_position)
        cos, sin = self.rotary_emb(c, layout.positions)
        columns, keys = cache.scratch(c.shape[1]), cache.keys_read(c.shape[1])
        own_norm = self.config.layout == "r2lm"  # DFlash: the fusion's norm is the context K/V's only input norm
        for i, layer in enumerate(self.layers):
            _, k, v = layer.self_attn.project(layer.input_layernorm(c) if own_norm else c, cos, sin)
            cache.update(i, k, v, columns, keys)
        cache.advance(c.shape[1] if valid is None else valid.bool())
        # each row's last real column: what the block's direct path reads (rows with none keep theirs)
        cols = torch.arange(c.shape[1], device=c.device)
        last = torch.where(mask.bool(), cols, -1).amax(1)
        picked = c.gather(1, last.clamp(min=0)[:, None, None].expand(-1, 1, c.shape[-1]))[:, 0]
        context.last = torch.where((last >= 0)[:, None], picked, context.last)
        return c

    # ------------------------------------------------------------------ drafting

    def block_inputs(self, openers: torch.Tensor, last: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width, hidden]: each opener token's target embedding, then the [MASK] vector; plus, in every column,
        the projected fused features of the last context token (`last` [B, hidden]: the target's state just before
        the opener, the one input that says most about what follows it)."""
        bound = self._bound()
        first = bound.embed(openers.reshape(-1, 1)).detach().to(bound.rows.dtype)  # the target's: frozen
        h = torch.cat([first, self.mask_embedding.to(first.dtype).expand(first.shape[0], width - 1, -1)], 1)
        return h if self.direct is None else h + self.direct(last)[:, None]

    def hidden(self, h: torch.Tensor, plan, cache: KVCache, norm: bool = True) -> torch.Tensor:
        for layer in self.layers:
            h, _ = layer(h, plan, cache)
        return self.norm(h) if norm else h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [..., draft vocab]."""
        return self.product(h, self._bound().rows)

    def draft_logits(self, context: DraftContext, openers: torch.Tensor) -> torch.Tensor:
        """Logits [B, config.draft_length, draft vocab] of the block drafted after the context and the opener token
        [B] (the last committed one): column j's for the token j + 1 positions after it. The context is read, not
        changed."""
        b, cache = self.config.block_size, context.kv
        layout = Layout.span(torch.ones(openers.shape[0], b, dtype=torch.long, device=openers.device),
                             start=cache.next_position, noisy=True, chunk=1)
        plan = plan_of(self.stack, self.rotary_emb, layout, cache, like=self.fuse.weight)
        h = self.hidden(self.block_inputs(openers, context.last, b), plan, cache)
        return self.logits(h[:, b - self.config.draft_length:])

    @torch.no_grad()
    def draft(self, context: DraftContext, openers: torch.Tensor, confidence: bool = False, siblings: int = 0):
        """Target token ids [B, config.draft_length] drafted after the context and the opener token [B] (the last
        committed one): column j is the guess for the token j + 1 positions after it; with `confidence`, (ids, the
        drafter's probability of each guess), and with `siblings` = k also the first column's next k likeliest
        tokens [B, k] and their probabilities (what verification may try beside the first guess). The context is
        read, not changed."""
        logits = self.draft_logits(context, openers)
        if not confidence:
            return self.draft_ids[logits.argmax(-1)]
        probs = logits.float().softmax(-1)
        p, guess = probs.max(-1)
        if not siblings:
            return self.draft_ids[guess], p
        runner_up, index = probs[:, 0].topk(siblings + 1, -1)
        return self.draft_ids[guess], p, self.draft_ids[index[:, 1:]], runner_up[:, 1:]

    # ------------------------------------------------------------------ training

    def forward(self, captured, ids, valid, reply, blocks: int, generator=None, decay: float = 0.8,
                feature_weight: float = 0.0, distill: bool = False, replay: float = 0.0,
                conditional: bool = False) -> DraftLoss:
        """The drafting loss (`loss`): what a DeepSpeed engine around the drafter calls."""
        return self.loss(captured, ids, valid, reply, blocks, generator, decay, feature_weight, distill, replay,
                         conditional)

    def draft_index(self) -> torch.Tensor:
        """[target vocabulary]: each target token's row in the draft vocabulary, -1 for the tokens outside it."""
        index = torch.full((self.config.target_vocab_size,), -1, dtype=torch.long, device=self.draft_ids.device)
        return index.index_copy_(0, self.draft_ids, torch.arange(len(self.draft_ids), device=index.device))

    def loss(self, captured, ids: torch.Tensor, valid: torch.Tensor, reply: torch.Tensor, blocks: int,
             generator: torch.Generator | None = None, decay: float = 0.8, feature_weight: float = 0.0,
             distill: bool = False, replay: float = 0.0, conditional: bool = False) -> DraftLoss:
        """The drafting loss of a batch of text (DFlash's recipe): r2lm.drafter_loss.drafting_loss says what it is."""
        return drafting_loss(self, self._bound(), captured, ids, valid, reply, blocks, generator, decay, feature_weight,
                             distill, replay, conditional)


@dataclass
class Bound:
    """What a drafter reads of its target: embeddings (the block's opener token), the LM head rows of its draft
    vocabulary (its own output layer), and for distillation the target's final norm and whole LM head."""

    embed: nn.Module
    rows: torch.Tensor
    norm: nn.Module
    head: torch.Tensor

    @torch.no_grad()
    def logits(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The target's logits over `weight`'s rows from its last layer's output h (the frozen target: no graph)."""
        return F.linear(self.norm(h.to(self.head.dtype)), weight.to(self.head.dtype)).float()


@dataclass
class DraftContext:
    """What a drafter reads of the committed text: its keys and values per drafter layer (the target's features
    injected), and each row's last committed token's fused features."""

    kv: KVCache
    last: torch.Tensor  # [B, hidden]

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.kv.keep_rows(keep)
        self.last = self.last[keep]

