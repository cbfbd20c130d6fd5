"""objective=drafter: a drafter (r2lm.drafter) trained for a frozen target on the target's own text.

Data: teacher records (train/teacher_data.py with --chat: ShareGPT prompts continued by the target), each the token
ids exactly as read and generated and the prompt's length; blocks are drawn at random anchors inside the reply.
A record of a held-out ShareGPT conversation (its `id`, r2lm.workloads) is refused: the benchmark's chat prompts
never reach training. A record longer than seq_len loses the start of its prompt (the reply is what drafts
continue), then its end.

The target's features (its outputs at the drafter's feature_layers) are what one training step costs most on a
CPU: a target forward over every token. `drafter.features_cache` keeps them on disk (float16, one file per record,
named by a hash of its tokens, in a folder named by the target's weights and the layers), so every epoch after the
first reads them instead. Records are batched by a seeded permutation per epoch: (seed, step, micro-batch, rank)
decide a batch, so a resumed run reads what the uninterrupted one would have.
"""

from __future__ import annotations

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
    start: int  # the first generated token
    name: str  # where it comes from: "FILE, line N"


def read_records(files: list[str], seq_len: int, what: str) -> list[Record]:
    """The teacher records of jsonl `files`, fitted to seq_len; a record that is no teacher record, or that holds a
    held-out ShareGPT prompt, is refused naming its file and line."""
    from r2lm.workloads import is_heldout_prompt

    records = []
    for file in files:
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                where = f"{what} {file}, line {number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{where} is not JSON ({err.msg}): a drafter trains on train/teacher_data.py "
                                     "records") from None
                ids, prompt = record.get("ids") if isinstance(record, dict) else None, None
                if isinstance(record, dict):
                    prompt = record.get("prompt_tokens")
                if (not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids)
                        or not isinstance(prompt, int) or not 0 < prompt <= len(ids)):
                    raise ValueError(f"{where} has no token `ids` with their `prompt_tokens`: a drafter trains on the "
                                     "target's own tokens, as train/teacher_data.py writes them")
                if isinstance(record.get("id"), str) and is_heldout_prompt(record["id"]):
                    raise ValueError(f"{where} continues {record['id']}, a held-out ShareGPT conversation (the "
                                     "benchmark's chat prompts): write training records from the training split "
                                     "(python -m r2lm.workloads chat-train)")
                if prompt == len(ids):  # nothing generated: no block to draft
                    continue
                reply = len(ids) - prompt
                cut = max(0, prompt - (seq_len - min(reply, seq_len // 2)))  # keep at least half a sequence of reply
                records.append(Record(ids[cut : cut + seq_len], prompt - cut, where))
    if not records:
        raise ValueError(f"{what} holds no record with a generated token")
    return records


class Batches:
    """Records as right-padded batches of token ids (a dict: ids, valid, starts and each record's cache key)."""

    def __init__(self, records: list[Record], micro_batch: int, pad_id: int):
        self.records, self.micro_batch, self.pad_id = records, micro_batch, pad_id

    def batch(self, indices: list[int]) -> dict:
        rows = [self.records[i] for i in indices]
        width = max(len(r.ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.long)
        for row, record in enumerate(rows):
            ids[row, : len(record.ids)] = torch.tensor(record.ids)
            valid[row, : len(record.ids)] = 1
        starts = torch.tensor([r.start for r in rows])
        return {"ids": ids, "valid": valid, "starts": starts, "keys": [_key(r.ids) for r in rows]}


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
    """The target's outputs at the feature layers for each record, rounded to float16, computed once (on disk, see
    the module docstring); without a folder, computed every time (the same values: the cache only saves time)."""

    def __init__(self, folder: str | None, target, layers: tuple[int, ...]):
        from r2lm.prefix.identity import ModelIdentity

        self.target, self.layers = target, layers
        self.folder, self.hits, self.misses = None, 0, 0
        if folder is not None:  # one folder per target (every config field and weight) and feature layers
            identity = ModelIdentity.of(target)
            key = json.dumps([identity.config, identity.tensors, list(layers)], sort_keys=True)
            key = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
            self.folder = Path(folder) / key
            self.folder.mkdir(parents=True, exist_ok=True)

    @torch.no_grad()
    def __call__(self, batch: dict) -> list[torch.Tensor]:
        ids, valid = batch["ids"], batch["valid"]
        hidden = self.target.config.hidden_size
        paths = [None] * len(ids) if self.folder is None else [self.folder / f"{k}.pt" for k in batch["keys"]]
        out = torch.zeros(len(self.layers), *ids.shape, hidden)
        missing = []
        for row, path in enumerate(paths):
            if path is not None and path.is_file():
                stored = torch.load(path, weights_only=True)  # [T, layers, hidden] float16
                out[:, row, : stored.shape[0]] = stored.float().permute(1, 0, 2)
                self.hits += 1
            else:
                missing.append(row)
        for row in missing:  # one record per forward: its features depend on it alone, not on its batch
            length = int(valid[row].sum())
            device = self.target.device
            captured = self.target.model(ids[row : row + 1, :length].to(device), capture=self.layers).captured
            # float16 whether stored or not: the cache only saves time
            out[:, row, :length] = torch.cat(captured).half().float().cpu()
            if paths[row] is not None:
                self.misses += 1
                tmp = paths[row].with_name(f"{paths[row].name}.{os.getpid()}.tmp")
                torch.save(out[:, row, :length].permute(1, 0, 2).half().clone(), tmp)
                os.replace(tmp, paths[row])  # whole or absent: a reader never sees half a file
        return list(out.unbind(0))


def load_target(model_dir: Path):
    """The frozen target: eval mode, no gradients, float32."""
    from r2lm import R2LMForDiffusionLM

    target = R2LMForDiffusionLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    return target
