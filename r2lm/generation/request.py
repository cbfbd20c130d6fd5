"""The checked arguments of one `generate()` call, and when each row stops (EOS, stop strings, streaming)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from r2lm.generation.sampling import CONFIDENCES


class Stopper:
    """Per-row stopping. `stop_at[row]` is the number of generated tokens the row keeps (-1 while running)."""

    def __init__(self, batch, device, eos_ids, pad_id, stop_strings=None, tokenizer=None, streamer=None):
        self.eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
        self.pad_id = pad_id
        self.stop_strings, self.tokenizer, self.streamer = stop_strings or [], tokenizer, streamer
        self.stop_at = torch.full((batch,), -1, dtype=torch.long, device=device)
        self.streamed = 0

    @property
    def finished(self) -> torch.Tensor:
        return self.stop_at >= 0

    def check_eos(self, out: torch.Tensor, start: int, end: int, mask_id: int) -> torch.Tensor:
        """Rows whose block out[:, start:end] holds an EOS with no [MASK] before it stop after that EOS."""
        if self.eos.numel():
            block = out[:, start:end]
            is_eos = torch.isin(block, self.eos)
            cols = torch.arange(block.shape[1], device=block.device)
            first = torch.where(is_eos, cols, block.shape[1]).min(dim=1).values
            clear = ~((block == mask_id) & (cols < first[:, None])).any(dim=1)
            stop = is_eos.any(dim=1) & clear & ~self.finished
            self.stop_at = torch.where(stop, start + first + 1, self.stop_at)
        return self.finished

    def check_strings(self, out: torch.Tensor, end: int) -> torch.Tensor:
        """Rows whose decoded text so far contains a stop string stop at the token that completes it."""
        for row in torch.nonzero(~self.finished).flatten().tolist():
            tokens = out[row, :end].tolist()
            if any(s in self.tokenizer.decode(tokens) for s in self.stop_strings):
                k = next(k for k in range(1, end + 1) if any(s in self.tokenizer.decode(tokens[:k]) for s in self.stop_strings))
                self.stop_at[row] = k
        return self.finished

    def trim(self, new: torch.Tensor) -> torch.Tensor:
        """Generated tokens with everything after each row's stop replaced by padding."""
        cols = torch.arange(new.shape[1], device=new.device)
        after = self.finished[:, None] & (cols >= self.stop_at[:, None])
        return new.masked_fill(after, self.pad_id)

    def count(self, new: torch.Tensor) -> int:
        return int(torch.where(self.finished, self.stop_at, new.shape[1]).sum())

    def stream(self, tokens: torch.Tensor, start: int | None = None) -> None:
        """Send committed tokens to the streamer: the prompt first (as transformers' generate does), then each
        block; for a single row, only the tokens before its stop."""
        if self.streamer is None:
            return
        if start is not None:
            tokens = self.trim_block(tokens, start)
        if tokens.numel():
            self.streamer.put(tokens.cpu())

    def trim_block(self, block: torch.Tensor, start: int) -> torch.Tensor:
        if block.shape[0] == 1 and self.finished[0]:
            return block[:, : max(0, int(self.stop_at[0]) - start)]
        cols = start + torch.arange(block.shape[1], device=block.device)
        return block.masked_fill(self.finished[:, None] & (cols >= self.stop_at[:, None]), self.pad_id)

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()


@dataclass
class Request:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_new_tokens: int
    block_size: int
    threshold: float | None
    factor: float | None
    tokens_per_step: int | None
    confidence: str
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None
    mask_id: int
    pad_id: int
    use_cache: bool
    approximate_cache: str | None
    prefix_cache: object | None
    stopper: Stopper
    bicache: object | None = None


def _as_list(ids):
    if ids is None:
        return []
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def make_request(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 128,
    block_size: int | None = None,
    threshold: float | None = 0.9,
    factor: float | None = None,
    tokens_per_step: int | None = None,
    confidence: str = "max_prob",
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    stop_strings: str | list[str] | None = None,
    tokenizer=None,
    streamer=None,
    use_cache: bool = True,
    approximate_cache: str | None = None,
    prefix_cache=None,
    bicache=None,
) -> Request:
    """Check every argument (ValueError naming the problem) and fill defaults from the model's config."""
    config = model.config
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [batch, length] tensor of token ids")
    if input_ids.numel() == 0:
        raise ValueError(f"empty prompt: input_ids has shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
    attention_mask = attention_mask.long()
    lengths = attention_mask.sum(1)
    if (lengths == 0).any():
        raise ValueError(f"row {int(torch.nonzero(lengths == 0)[0])} of the batch is all padding")
    if (attention_mask[:, 1:] < attention_mask[:, :-1]).any():
        raise ValueError("prompts must be left-padded (padding before the tokens, none after)")
    mask_id = config.mask_token_id
    if mask_id is None:
        raise ValueError("the model has no mask_token_id; set config.mask_token_id")
    real = attention_mask.bool()
    if (input_ids[real] == mask_id).any():
        row = int(torch.nonzero((input_ids == mask_id) & real)[0, 0])
        raise ValueError(f"the prompt of row {row} contains the mask token id {mask_id}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    longest = int(lengths.max())
    if longest + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's maximum length "
            f"{config.max_position_embeddings}"
        )
    block_size = config.block_size if block_size is None else block_size
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if factor is not None and tokens_per_step is not None:
        raise ValueError("give at most one of factor and tokens_per_step")
    if factor is not None or tokens_per_step is not None:
        threshold = None
    if threshold is not None and not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    if threshold is None and factor is None and tokens_per_step is None:
        raise ValueError("choose an unmasking rule: threshold, factor or tokens_per_step")
    if factor is not None and factor <= 0:
        raise ValueError(f"factor must be positive, got {factor}")
    if tokens_per_step is not None and tokens_per_step <= 0:
        raise ValueError(f"tokens_per_step must be positive, got {tokens_per_step}")
    if confidence not in CONFIDENCES:
        raise ValueError(f"unknown confidence {confidence!r}; expected one of {CONFIDENCES}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be positive, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer (pass tokenizer=...)")
    if approximate_cache not in (None, "prefix", "dual"):
        raise ValueError(f"approximate_cache must be None, 'prefix' or 'dual', got {approximate_cache!r}")
    if approximate_cache and config.attention != "bidirectional":
        raise ValueError("approximate_cache is for bidirectional models; causal and block_causal models have an exact cache")

    if prefix_cache is not None and (not use_cache or config.attention == "bidirectional"):
        raise ValueError("prefix_cache reuses exact keys: it needs use_cache=True and a causal or block_causal model")
    if bicache is not None:
        _check_bicache(bicache, config, approximate_cache)

    eos = _as_list(config.eos_token_id if eos_token_id is None else eos_token_id)
    pad_id = pad_token_id if pad_token_id is not None else config.pad_token_id
    if pad_id is None:
        pad_id = eos[0] if eos else 0
    stopper = Stopper(input_ids.shape[0], input_ids.device, eos, pad_id, stop_strings, tokenizer, streamer)
    return Request(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, block_size=block_size,
        threshold=threshold, factor=factor, tokens_per_step=tokens_per_step, confidence=confidence,
        temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, mask_id=mask_id, pad_id=pad_id,
        use_cache=use_cache, approximate_cache=approximate_cache, prefix_cache=prefix_cache, stopper=stopper,
        bicache=bicache,
    )


def _check_bicache(bicache, config, approximate_cache) -> None:
    from r2lm.prefix.bicache import BiCache

    if not isinstance(bicache, BiCache):
        raise ValueError(f"bicache must be an r2lm.prefix.BiCache, got {type(bicache).__name__}")
    if config.attention != "bidirectional":
        raise ValueError("bicache is the approximate shallow-layer prefix reuse of bidirectional models; causal and "
                         "block_causal models reuse exact keys with prefix_cache")
    if approximate_cache is not None:
        raise ValueError("bicache runs in the no-cache bidirectional decoder; it does not combine with approximate_cache")
