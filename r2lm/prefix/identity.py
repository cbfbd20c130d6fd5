"""What a cache that outlives a request (PrefixCache, BiCache) needs to know of the model it serves: every config
field that can change a forward, and every bit of every weight.

Keys and values cached for one model are wrong for any other, and for the same model once a weight changed, however
it changed: an optimizer step, `load_state_dict`, peft's `merge_and_unload`, an edit of one embedding row, a write
through `tensor.data` (which moves no version counter: only the values themselves show it). So a cache takes the
model's identity when it binds and again at every request, and refuses a request whose model differs, naming the
config fields or weights that differ. Two model objects with the same config and weights are the same model.

The weight digest reads every byte once, at memory speed: each tensor's bytes as 64-bit words, in chunks of
DIGEST_WORDS, each chunk reduced to one word by a product with fixed odd multipliers (mod 2**64: integer arithmetic,
so the result does not depend on the device, kernel or reduction order). Changing any one word changes its chunk's
word for certain (an odd multiplier is invertible mod 2**64); the chunk words are then hashed with blake2b. On
CPU it costs about what one batch-1 forward does (that forward also reads every weight once).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

DIGEST_WORDS = 4096  # 64-bit words per chunk
SLAB_ROWS = 4096  # chunks reduced at once off the CPU (the product is materialised there: 128 MiB per slab)

# Config fields that never change a forward: token ids (no layer reads them), names and versions, output flags, the
# initialisation scale. Every other field counts, fields added later included: a cache refuses rather than guesses.
NOT_FORWARD = frozenset({
    "_name_or_path", "architectures", "transformers_version", "model_type", "bos_token_id", "eos_token_id",
    "pad_token_id", "mask_token_id", "id2label", "label2id", "problem_type", "output_attentions",
    "output_hidden_states", "return_dict", "use_cache", "initializer_range", "dtype", "torch_dtype",
})

_multipliers: dict[torch.device, torch.Tensor] = {}


def forward_config(config) -> dict:
    """The config fields that can change a forward (all but NOT_FORWARD), with the attention implementation."""
    fields = {k: v for k, v in config.to_dict().items() if k not in NOT_FORWARD}
    fields["attn_implementation"] = config._attn_implementation
    return json.loads(json.dumps(fields, sort_keys=True, default=repr))  # plain values, compared by ==


def tensor_digests(model) -> dict[str, str]:
    """name -> digest of every parameter and buffer (its shape, dtype and every byte of its values)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    words = []
    with torch.no_grad():
        for _, t in tensors:
            words.append(_chunk_words(t))
    # one copy to the host for the whole model, not one synchronisation per tensor
    flat = torch.cat([w.to(words[0].device) for w in words]).cpu() if words else torch.empty(0, dtype=torch.long)
    digests, start = {}, 0
    for (name, t), w in zip(tensors, words, strict=True):
        digest = hashlib.blake2b(f"{tuple(t.shape)}:{t.dtype};".encode(), digest_size=16)
        digest.update(flat[start : start + w.numel()].numpy().tobytes())
        digests[name] = digest.hexdigest()
        start += w.numel()
    return digests


def _chunk_words(t: torch.Tensor) -> torch.Tensor:
    """[chunks] int64: each DIGEST_WORDS-word chunk of `t`'s bytes (zero-padded) times the multipliers, summed."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    chunk = 8 * DIGEST_WORDS
    whole = data.numel() // chunk * chunk
    tail = data.new_zeros(chunk)
    tail[: data.numel() - whole] = data[whole:]
    head = data[:whole]
    if head.storage_offset() % 8:  # a view at an odd offset of a larger storage: int64 needs 8-byte alignment
        head = head.clone()
    r = _multiplier(t.device)
    rows = head.view(torch.int64).view(-1, DIGEST_WORDS)
    return torch.cat([_reduce(rows, r), _reduce(tail.view(torch.int64)[None], r)])


def _reduce(rows: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    if rows.device.type == "cpu":
        return rows @ r  # an integer matrix-vector product: one pass, no temporary
    return torch.cat([(rows[i : i + SLAB_ROWS] * r).sum(1) for i in range(0, rows.shape[0], SLAB_ROWS)] or [r[:0]])


def _multiplier(device: torch.device) -> torch.Tensor:
    if device not in _multipliers:
        g = torch.Generator().manual_seed(0x52324C4D)
        odd = torch.randint(-(2**62), 2**62, (DIGEST_WORDS,), generator=g, dtype=torch.int64) * 2 + 1
        _multipliers[device] = odd.to(device)
    return _multipliers[device]


@dataclass(frozen=True)
class ModelIdentity:
    """A model as a cache sees it: its forward config and the digest of each of its tensors."""

    config: dict
    tensors: dict

    @classmethod
    def of(cls, model) -> ModelIdentity:
        return cls(forward_config(model.config), tensor_digests(model))

    def difference(self, other: ModelIdentity) -> str | None:
        """How `other` differs from this one, in words; None when it does not."""
        fields = sorted(k for k in self.config.keys() | other.config.keys()
                        if self.config.get(k) != other.config.get(k))
        if fields:
            shown = ", ".join(f"{k} {self.config.get(k)!r} vs {other.config.get(k)!r}" for k in fields[:3])
            return f"a different configuration ({shown}{' and more' if len(fields) > 3 else ''})"
        names = sorted(k for k in self.tensors.keys() | other.tensors.keys()
                       if self.tensors.get(k) != other.tensors.get(k))
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            return f"other weights ({', '.join(names[:3])}{more} differ)"
        return None


def bind(bound: ModelIdentity | None, model, what: str) -> ModelIdentity:
    """The identity of `model`, for a cache (`what`) to bind to; when it is bound already (`bound`), after checking
    that `model` is still the model it was bound to. Raises a ValueError naming what differs."""
    identity = ModelIdentity.of(model)
    difference = None if bound is None else bound.difference(identity)
    if difference is not None:
        raise ValueError(
            f"this {what} holds keys and values computed by a model with {difference}: the model changed since the "
            f"{what} was bound to it (an optimizer step, merge_and_unload, an edit in place or through .data, "
            f"another config) or this is another model; use one {what} per model, or clear() it after changing the "
            "model"
        )
    return identity
