"""objective=drafter: a drafter (r2lm.drafter) trained for a frozen target on text it reads.

Start: the target's top layers (drafter.init target), random weights, or a trained drafter's folder, whose weights,
draft vocabulary and shape the run goes on from (`trained_config`): the shipped drafter adapted to a user's own data.

Data: jsonl records of token ids and the spans the drafter learns to continue: teacher records (train/teacher_data.py
with --chat: ShareGPT prompts continued by the target, its own greedy replies: `prompt_tokens` marks where the reply
starts) or fixed-text records (train/fixed_text.py: ShareGPT's conversations as they are, every assistant turn a
`spans` entry). Blocks are drawn at random anchors inside the replies. A record of a held-out ShareGPT conversation
(its `id`, r2lm.workloads) is refused: the benchmark's chat prompts never reach training. A record longer than seq_len
is cut into consecutive windows of seq_len tokens (those holding a reply token are kept).

The target's features (its outputs at the drafter's feature_layers) are what one training step costs most on a
CPU: a target forward over every token. Without `drafter.features_cache` they are computed for each batch (in
`drafter.features_dtype`, one record per forward): the cost of a single pass over a large corpus. With it they are
kept on disk (bfloat16, one file per record, named by a hash of its tokens, in a folder named by the target's
weights, the layers and the dtype), so every epoch after the first reads them instead; a file that does not hold
its record's length and layers is computed again. Records are batched by a seeded permutation per epoch: (seed,
step, micro-batch, rank) decide a batch, so a resumed run reads what the uninterrupted one would have.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass
class Record:
    ids: list[int]
    spans: list[tuple[int, int]]  # [start, end) of the tokens to draft (replies), in order
    name: str  # where it comes from: "FILE, line N"

    @property
    def reply_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)


def spans_of(record: dict, where: str) -> list[tuple[int, int]]:
    """The reply spans of a record: its `spans`, or (a teacher record) everything after its `prompt_tokens`."""
    ids, prompt, spans = record.get("ids"), record.get("prompt_tokens"), record.get("spans")
    if (not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids)
            or not isinstance(prompt, int) or not 0 < prompt <= len(ids)):
        raise ValueError(f"{where} has no token `ids` with their `prompt_tokens`: a drafter trains on records as "
                         "train/teacher_data.py and train/fixed_text.py write them")
    if spans is None:
        return [(prompt, len(ids))] if prompt < len(ids) else []
    ok = isinstance(spans, list) and all(isinstance(x, list) and len(x) == 2 and all(isinstance(i, int) for i in x)
                                         for x in spans)
    if ok:
        ends = [i for span in spans for i in span]
        ok = ends == sorted(ends) and all(a < b for a, b in spans) and (not ends or (ends[0] > 0 and ends[-1] <= len(ids)))
    if not ok:
        raise ValueError(f"{where}: `spans` must be ordered, disjoint [start, end) pairs inside its ids (after the "
                         f"first token), got {str(spans)[:80]}")
    return [tuple(x) for x in spans]


def windows(ids: list[int], spans: list[tuple[int, int]], seq_len: int):
    """(ids, spans) of consecutive seq_len windows of a record that hold a reply token; spans relative to each."""
    for at in range(0, max(len(ids) - 1, 1), seq_len):
        inside = [(max(a, at + 1) - at, min(b, at + seq_len) - at) for a, b in spans if a < at + seq_len and b > at + 1]
        if inside:
            yield ids[at : at + seq_len], inside


def check_complete(file: str, what: str) -> None:
    """A teacher file (train/teacher_data.py writes FILE.settings beside it) is read only once its run wrote every
    record it was asked for (FILE.complete, with the count): not while a run writes it, nor a killed run's."""
    from train.teacher_records import COMPLETE_SUFFIX, SETTINGS_SUFFIX

    path = Path(file)
    if not path.with_name(path.name + SETTINGS_SUFFIX).is_file():
        return  # not a teacher run's file
    done = path.with_name(path.name + COMPLETE_SUFFIX)
    count = sum(1 for _ in path.open(encoding="utf-8"))
    wanted = json.loads(done.read_text()).get("records") if done.is_file() else None
    if wanted != count:
        raise ValueError(f"{what} {file} holds {count} records of a teacher run that has not finished ("
                         + ("no " + done.name if wanted is None else f"{done.name} says {wanted}") + "): rerun "
                         "train/teacher_data.py with the same arguments to finish it")


def read_records(files: list[str], seq_len: int, what: str, max_tokens: int = 0,
                 target: str | None = None) -> list[Record]:
    """The records of jsonl `files`, cut to seq_len windows; with `max_tokens`, the leading records up to that many
    tokens. A record that is no teacher or fixed-text record, that holds a held-out ShareGPT prompt, or (with
    `target`, its target_digest) that holds another model's replies is refused naming its file and line; so is a
    teacher file whose run has not finished."""
    from r2lm.workloads import is_heldout_prompt

    records, tokens = [], 0
    for file in files:
        check_complete(file, what)
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                where = f"{what} {file}, line {number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{where} is not JSON ({err.msg}): a drafter trains on train/teacher_data.py "
                                     "or train/fixed_text.py records") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{where} is not a record (a JSON object)")
                spans = spans_of(record, where)
                if target is not None and record.get("teacher", target) != target:
                    raise ValueError(f"{where} holds the replies of another model (teacher {record['teacher']}, "
                                     f"the target {target}): a drafter learns its own target's text")
                if isinstance(record.get("id"), str) and is_heldout_prompt(record["id"]):
                    raise ValueError(f"{where} continues {record['id']}, a held-out ShareGPT conversation (the "
                                     "benchmark's chat prompts): write training records from the training split "
                                     "(python -m r2lm.workloads chat-train, train/fixed_text.py)")
                for ids, inside in windows(record["ids"], spans, seq_len):
                    records.append(Record(ids, inside, where))
                    tokens += len(ids)
                if max_tokens and tokens >= max_tokens:
                    return records
    if not records:
        raise ValueError(f"{what} holds no record with a reply token")
    return records


class Batches:
    """Records as right-padded batches of token ids (a dict: ids, valid, reply: which tokens are drafted, and each
    record's cache key)."""

    def __init__(self, records: list[Record], micro_batch: int, pad_id: int):
        self.records, self.micro_batch, self.pad_id = records, micro_batch, pad_id

    def batch(self, indices: list[int]) -> dict:
        rows = [self.records[i] for i in indices]
        width = max(len(r.ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.long)
        reply = torch.zeros(len(rows), width, dtype=torch.bool)
        for row, record in enumerate(rows):
            ids[row, : len(record.ids)] = torch.tensor(record.ids)
            valid[row, : len(record.ids)] = 1
            for start, end in record.spans:
                reply[row, start:end] = True
        return {"ids": ids, "valid": valid, "reply": reply, "keys": [_key(r.ids) for r in rows]}


class TrainBatches(Batches):
    """Training: a seeded permutation of the records per epoch; (step, micro-batch, rank) decide a batch."""

    def __init__(self, records, micro_batch: int, grad_accum: int, rank: int, world: int, seed: int, pad_id: int):
        super().__init__(records, micro_batch, pad_id)
        self.grad_accum, self.rank, self.world, self.seed = grad_accum, rank, world, seed
        self._order: tuple[int, list[int]] | None = None

    def order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.records)))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def __call__(self, step: int, micro: int) -> dict:
        first = ((step * self.grad_accum + micro) * self.world + self.rank) * self.micro_batch
        picked = []
        for i in range(first, first + self.micro_batch):
            epoch, at = divmod(i, len(self.records))
            picked.append(self.order(epoch)[at])
        return self.batch(picked)


class EvalBatches(Batches):
    """Held out: the same batches in the same order every evaluation, as train/data.py's EvalSet plans them."""

    def __init__(self, records, micro_batch: int, world: int, max_batches: int, pad_id: int):
        super().__init__(records, micro_batch, pad_id)
        self.world = world
        self.num_batches = min(max_batches, math.ceil(len(records) / (world * micro_batch)))

    def plan(self, rank: int):
        """[(k, indices, weight)]: batch k of `rank`; weight 0 marks a filler batch of a rank that ran out."""
        out = []
        for k in range(self.num_batches):
            start = (k * self.world + rank) * self.micro_batch
            idx = [i for i in range(start, start + self.micro_batch) if i < len(self.records)]
            out.append((k, idx, 1.0) if idx else (k, [0], 0.0))
        return out


def _key(ids: list[int]) -> str:
    return hashlib.blake2b(json.dumps(ids).encode(), digest_size=16).hexdigest()


class FeatureCache:
    """The target's outputs at the feature layers for each record, computed in `dtype` and rounded to bfloat16
    (the module docstring); without a folder, computed for every batch (the same values: the cache only saves
    time)."""

    def __init__(self, folder: str | None, target, layers: tuple[int, ...], dtype: torch.dtype = torch.float32):
        from r2lm.prefix.identity import ModelIdentity

        # (a copy in another dtype: the drafter reads the float32 target's embeddings and LM head)
        self.target = target if target.dtype == dtype else copy.deepcopy(target).to(dtype)
        self.layers, self.dtype = layers, dtype
        self.folder, self.hits, self.misses = None, 0, 0
        if folder is not None:  # one folder per target (every config field and weight), feature layers and dtype
            identity = ModelIdentity.of(target)
            key = json.dumps([identity.config, identity.tensors, list(layers), str(dtype)], sort_keys=True)
            key = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
            self.folder = Path(folder) / key
            self.folder.mkdir(parents=True, exist_ok=True)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[rows, T, layers, hidden] bfloat16: the target's outputs at the feature layers over right-padded rows."""
        captured = self.target.model(ids.to(self.target.device), capture=self.layers).captured
        return torch.stack(captured, 2).to(torch.bfloat16).cpu()

    @torch.no_grad()
    def __call__(self, batch: dict) -> list[torch.Tensor]:
        ids, lengths = batch["ids"], batch["valid"].sum(1).tolist()
        out = torch.zeros(*ids.shape, len(self.layers), self.target.config.hidden_size)
        for row, key in enumerate(batch["keys"]):
            length = lengths[row]
            path = None if self.folder is None else self.folder / f"{key}.pt"
            stored = torch.load(path, weights_only=True) if path is not None and path.is_file() else None
            if stored is not None and stored.shape != (length, len(self.layers), out.shape[-1]):
                logger.warning("%s holds features of shape %s, not its record's (%d, %d, %d): computed again", path,
                               tuple(stored.shape), length, len(self.layers), out.shape[-1])
                stored = None
            if stored is None:  # one record per forward: the features depend on the record alone, cached or not
                stored = self._forward(ids[row : row + 1, :length])[0]
                if path is not None:
                    self.misses += 1
                    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                    torch.save(stored.clone(), tmp)
                    os.replace(tmp, path)  # whole or absent: a reader never sees half a file
            else:
                self.hits += 1
            out[row, :length] = stored.float()
        return list(out.unbind(2))


def load_target(model_dir: Path):
    """The frozen target: eval mode, no gradients, float32."""
    from r2lm import R2LMForDiffusionLM

    target = R2LMForDiffusionLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    return target


def trained_config(folder: Path, section, target_config):
    """The DrafterConfig of the trained drafter in `folder` (drafter.init), checked before anything loads: it must be
    made for a target of this one's shape, and the drafter.* keys that set a shape must agree with it (a run goes on
    from its weights, so it keeps its shape; feature_layers left unset take the folder's)."""
    from r2lm.drafter import DrafterConfig

    config = DrafterConfig.from_pretrained(folder)
    config.check_target(target_config)
    keys = {"num_hidden_layers": "layers"}  # the one drafter.* key not named as its DrafterConfig field
    differ = [f"drafter.{keys.get(name, name)} {value!r} (the folder's: {getattr(config, name)!r})"
              for name, value in section.choices().items() if value != getattr(config, name)]
    if differ:
        raise ValueError(f"drafter.init {folder} is a drafter of another shape than the drafter.* keys set: "
                         f"{'; '.join(differ)}. Set them to the folder's (training goes on from its weights)")
    return config
