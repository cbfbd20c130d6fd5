"""Training data: documents -> tokens -> fixed-length packed sequences -> per-rank micro-batches.

Sources (`data.train`, `data.heldout`; train/sources.py resolves and checks them): local text / jsonl / json /
parquet files (a path, a folder, a glob or a list of them) or a hub dataset name, read with `datasets` (so
`HF_DATASETS_OFFLINE=1` works for local files and for hub datasets already in the cache). Documents are tokenised
with the checkpoint's tokenizer (special-token text inside documents is split, never turned into [MASK] or EOS),
each followed by EOS, concatenated and cut into `seq_len` pieces.

Order. Batches are a pure function of (seed, global step, micro-step, rank), so a resumed run sees exactly the
batches the uninterrupted run would have seen:

- in-memory (default): the packed sequences form one list of N; the global stream of sample positions
  q = 0, 1, 2, ... maps to epoch q // N and index perm_epoch[q % N] (a seeded permutation per epoch); step s,
  micro-step m, rank r reads positions s*G + (m*world + r)*mbs + [0, mbs), with G = mbs * grad_accum * world.
  The ranks of one step read disjoint slices that together cover the step's global batch.
- streaming: documents are shuffled with a seeded buffer, split across ranks (`split_dataset_by_node`: each
  rank reads a disjoint part), tokenised and packed on the fly; rank r's micro-batch (s, m) is batch
  s * grad_accum + m of its own stream, and a resumed run fast-forwards to it.

Held out: a separate source, or a fraction f of the training source's documents (`heldout_fraction`): in memory
every 1/f-th document, chosen by index before shuffling; streaming, the documents whose text hashes below f (a
stream has no stable document order), so the two never share a document.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from r2lm.text import encode, pack
from train.sources import COMPRESSED, Source, first_bad_record, first_non_text, resolve_source

logger = logging.getLogger(__name__)

PACK_DOCS = 1000  # documents packed together per map batch; at most seq_len - 1 tokens per batch are dropped
PACK_VERSION = "r2lm-pack-1"  # part of the cache fingerprint: bump when the packing changes


# ---------------------------------------------------------------------------------------------- documents


def load_documents(source: Source, cfg, streaming: bool):
    """The documents of `source` as a (Iterable)Dataset with the single column "text"."""
    import datasets

    kwargs = dict(streaming=streaming, cache_dir=cfg.cache_dir)
    try:
        if source.builder == "hub":
            ds = datasets.load_dataset(source.name, cfg.hub_config, split=cfg.hub_split, **kwargs)
        elif source.builder == "text":
            ds = datasets.load_dataset("text", data_files=source.files, sample_by=cfg.text_unit, split="train", **kwargs)
        else:
            ds = datasets.load_dataset(source.builder, data_files=source.files, split="train", **kwargs)
    except Exception as err:  # network / not found / parse / decoding errors: one clear message
        if isinstance(err, ValueError) and not isinstance(err, UnicodeDecodeError):
            raise
        raise ValueError(_load_error(source, err)) from err
    field = "text" if source.builder == "text" else cfg.text_field
    columns = ds.column_names
    if columns is None and streaming:  # some streamed sources only know their columns after the first example
        try:
            columns = list(next(iter(ds.take(1)), {}).keys())
        except Exception as err:  # that read parses the first block: a bad record there fails it
            raise ValueError(_load_error(source, err)) from err
    if field not in (columns or []):
        raise ValueError(f"{source.describe()} has no column {field!r} (columns: {columns}); set data.text_field")
    ds = ds.select_columns([field])
    if field != "text":
        ds = ds.rename_column(field, "text")
    return ds


def _load_error(source: Source, err: Exception) -> str:
    """The message of a failed datasets.load_dataset: the file and line of a bad json record, the file and byte
    offset of a decoding error; for a hub dataset the offline hint, and that no local file of that name exists
    either."""
    import datasets

    cause = err
    while cause is not None and not isinstance(cause, UnicodeDecodeError):
        cause = cause.__cause__ or cause.__context__
    bad = _bad_record((source,))  # a record that is not JSON: datasets names no file and no line
    if bad is not None:
        return bad
    if cause is not None and source.files:  # a text file that is not UTF-8 past the part resolve_source checked
        for f in source.files:
            problem = None if f.lower().endswith(COMPRESSED) else first_non_text(f)
            if problem is not None:
                return f"{f} is not UTF-8 text: {problem} (a binary file?); text files must be UTF-8"
        return f"{source.describe()} is not UTF-8 text: {cause}"
    reason = f"{type(err).__name__}: {err}"
    if source.builder != "hub":
        return f"cannot load {source.describe()}: {reason}"
    offline = " (HF_DATASETS_OFFLINE is set: only cached hub datasets load)" if datasets.config.HF_HUB_OFFLINE else ""
    return (f"cannot load hub dataset {source.name}{offline}, and there is no local file or folder of that name in "
            f"{Path.cwd()} either: {reason}")


def is_heldout(index: int, fraction: float) -> bool:
    """Document `index` is held out when it crosses a multiple of 1/fraction: exactly `fraction` of every prefix."""
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


def is_heldout_text(text: str, fraction: float) -> bool:
    """Streaming: a document has no stable position (datasets shuffles the order of the files and splits them
    across ranks beneath any filter, and a filter's index restarts per file), so it is held out by a hash of its
    text: about `fraction` of the documents, the same ones in every order and on every rank."""
    if not isinstance(text, str):  # kept for training, where encode() names the bad record
        return False
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") < fraction * 2**64


def split_heldout(docs, fraction: float, heldout: bool, streaming: bool = False):
    if streaming:
        return docs.filter(lambda doc: is_heldout_text(doc["text"], fraction) == heldout)
    return docs.filter(lambda _, i: is_heldout(i, fraction) == heldout, with_indices=True)


# ---------------------------------------------------------------------------------------------- packing


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pack_dataset(docs, tokenizer, eos_id: int, seq_len: int, num_proc: int = 1):
    """In-memory path: a datasets.Dataset with one column `input_ids` of seq_len ids per row (cached on disk)."""
    fingerprint = hashlib.sha256(
        f"{docs._fingerprint}|{tokenizer_fingerprint(tokenizer)}|{eos_id}|{seq_len}|{num_proc}|{PACK_VERSION}".encode()
    ).hexdigest()[:32]

    def _pack(batch):
        return {"input_ids": pack(encode(tokenizer, batch["text"]), eos_id, seq_len)[0]}

    return docs.map(
        _pack, batched=True, batch_size=PACK_DOCS, remove_columns=docs.column_names, num_proc=num_proc if num_proc > 1 else None,
        new_fingerprint=fingerprint, desc=f"tokenise and pack ({seq_len} tokens)",
    )


def stream_sequences(docs, tokenizer, eos_id: int, seq_len: int, what: str):
    """Streaming path: an endless iterator of packed sequences, cycling epochs (`set_epoch` reshuffles)."""
    carry: list[int] = []
    for epoch in itertools.count():
        if hasattr(docs, "set_epoch"):
            docs.set_epoch(epoch)
        produced = False
        rows = iter(docs)
        while chunk := [row["text"] for row in itertools.islice(rows, 256)]:
            sequences, carry = pack(encode(tokenizer, chunk), eos_id, seq_len, carry)
            for seq in sequences:
                produced = True
                yield seq
        if not produced and epoch == 0:
            raise ValueError(f"{what} yields no complete sequence of {seq_len} tokens on this rank: the data is empty or too small")


# ---------------------------------------------------------------------------------------------- batches


class IndexedBatches:
    """Micro-batches of one rank, indexed by (step, micro-step), over an in-memory packed dataset."""

    def __init__(self, dataset, micro_batch_size: int, grad_accum: int, rank: int, world: int, seed: int):
        self.dataset, self.n = dataset, len(dataset)
        self.mbs, self.gas, self.rank, self.world, self.seed = micro_batch_size, grad_accum, rank, world, seed
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perms[epoch]

    def positions(self, step: int, micro: int, rank: int | None = None) -> range:
        """Positions in the global sample stream read by `rank` at (step, micro)."""
        rank = self.rank if rank is None else rank
        start = step * self.mbs * self.gas * self.world + (micro * self.world + rank) * self.mbs
        return range(start, start + self.mbs)

    def indices(self, step: int, micro: int, rank: int | None = None) -> list[int]:
        return [int(self.permutation(q // self.n)[q % self.n]) for q in self.positions(step, micro, rank)]

    def __call__(self, step: int, micro: int) -> torch.Tensor:
        rows = self.dataset[self.indices(step, micro)]["input_ids"]
        return torch.tensor(rows, dtype=torch.long)


class StreamBatches:
    """Micro-batches of one rank from its own packed stream; batch (step, micro) is number step * gas + micro."""

    def __init__(self, sequences, micro_batch_size: int, grad_accum: int):
        self.sequences, self.mbs, self.gas = sequences, micro_batch_size, grad_accum
        self.next = 0

    def __call__(self, step: int, micro: int) -> torch.Tensor:
        target = step * self.gas + micro
        if target < self.next:
            raise RuntimeError(f"stream batch {target} was already read (next is {self.next}): read batches in order")
        if target > self.next:
            logger.info("fast-forwarding the data stream over %d micro-batches to step %d", target - self.next, step)
            for _ in itertools.islice(self.sequences, (target - self.next) * self.mbs):
                pass
            self.next = target
        rows = list(itertools.islice(self.sequences, self.mbs))
        self.next += 1
        return torch.tensor(rows, dtype=torch.long)


class EvalSet:
    """Held-out sequences and a fixed evaluation plan: the same batches, in the same order, every evaluation."""

    def __init__(self, rows: list[list[int]] | object, micro_batch_size: int, world: int, max_batches: int):
        self.rows, self.n = rows, len(rows)
        self.mbs, self.world = micro_batch_size, world
        # every rank runs the same number of forwards (ZeRO-3 gathers parameters collectively)
        self.num_batches = min(max_batches, math.ceil(self.n / (world * micro_batch_size)))

    def plan(self, rank: int):
        """[(k, indices, weight)]: batch k of `rank`; weight 0 marks a filler batch of a rank that ran out."""
        out = []
        for k in range(self.num_batches):
            start = (k * self.world + rank) * self.mbs
            idx = [i for i in range(start, start + self.mbs) if i < self.n]
            out.append((k, idx, 1.0) if idx else (k, [0], 0.0))
        return out

    def batch(self, indices: list[int]) -> torch.Tensor:
        rows = self.rows[indices]["input_ids"] if hasattr(self.rows, "column_names") else [self.rows[i] for i in indices]
        return torch.tensor(rows, dtype=torch.long)


# ---------------------------------------------------------------------------------------------- assembly


@dataclass
class Data:
    train: IndexedBatches | StreamBatches
    heldout: EvalSet | None
    eos_id: int
    num_train_sequences: int | None  # None when streaming


def build_data(cfg, tokenizer, eos_id: int, rank: int, world: int, first_on_node: bool, barrier) -> Data:
    """Build the training batches and the held-out set of this rank (cfg: the TrainConfig).

    In-memory mode: the first rank of each node tokenises (filling the datasets cache) while the others wait at
    `barrier`, then they load the cached result."""
    d = cfg.data
    train_src = resolve_source(d.train, d.format, "data.train")
    held_src = resolve_source(d.heldout, d.format, "data.heldout") if d.heldout is not None else None
    if d.streaming:
        return streaming_data(cfg, tokenizer, eos_id, rank, world, train_src, held_src)
    return in_memory_data(cfg, tokenizer, eos_id, rank, world, train_src, held_src, first_on_node, barrier)


def streaming_data(cfg, tokenizer, eos_id: int, rank: int, world: int, train_src: Source, held_src: Source | None) -> Data:
    """Data read as training reaches it: this rank's share of the shuffled documents, packed on the fly."""
    from datasets.distributed import split_dataset_by_node

    d, seq_len, mbs = cfg.data, cfg.seq_len, cfg.micro_batch_size
    docs = load_documents(train_src, d, streaming=True)
    held_docs = load_documents(held_src, d, streaming=True) if held_src else None
    if d.heldout_fraction:
        held_docs = split_heldout(docs, d.heldout_fraction, True, streaming=True)
        docs = split_heldout(docs, d.heldout_fraction, False, streaming=True)
    if d.shuffle_buffer:
        docs = docs.shuffle(seed=cfg.seed, buffer_size=d.shuffle_buffer)
    docs = split_dataset_by_node(docs, rank=rank, world_size=world)
    sequences = stream_sequences(docs, tokenizer, eos_id, seq_len, "data.train")
    train = StreamBatches(_naming_records(sequences, (train_src, held_src), d.text_field), mbs, cfg.grad_accum)
    heldout = None
    if held_docs is not None:
        wanted = cfg.eval_batches * world * mbs
        sequences = _naming_records(_finite_sequences(held_docs, tokenizer, eos_id, seq_len), (train_src, held_src),
                                    d.text_field)
        rows = list(itertools.islice(sequences, wanted))
        if not rows:
            raise ValueError(f"the held-out data yields no complete sequence of {seq_len} tokens")
        heldout = EvalSet(rows, mbs, world, cfg.eval_batches)
    return Data(train, heldout, eos_id, None)


def in_memory_data(cfg, tokenizer, eos_id: int, rank: int, world: int, train_src: Source, held_src: Source | None,
                   first_on_node: bool, barrier) -> Data:
    """Data packed once (and cached by `datasets`), indexed by (seed, step, micro-step, rank)."""
    d, seq_len = cfg.data, cfg.seq_len

    def build():
        docs = load_documents(train_src, d, streaming=False)
        held_docs = load_documents(held_src, d, streaming=False) if held_src else None
        if d.heldout_fraction:
            held_docs = split_heldout(docs, d.heldout_fraction, True)
            docs = split_heldout(docs, d.heldout_fraction, False)
        try:
            packed = pack_dataset(docs, tokenizer, eos_id, seq_len, d.num_proc)
            held = pack_dataset(held_docs, tokenizer, eos_id, seq_len, d.num_proc) if held_docs is not None else None
        except ValueError as err:  # a record whose text is no string
            bad = _bad_record((train_src, held_src), d.text_field)
            if bad is None:
                raise
            raise ValueError(bad) from err
        return docs, packed, held

    if first_on_node:
        docs, packed, held = build()
        barrier()
    else:
        barrier()
        docs, packed, held = build()
    if len(packed) == 0:
        raise ValueError(
            f"data.train ({train_src.describe()}) yields no complete sequence of {seq_len} tokens "
            f"({len(docs)} documents): the data is empty or shorter than one sequence"
        )
    if held is not None and len(held) == 0:
        raise ValueError(f"the held-out data yields no complete sequence of {seq_len} tokens")
    logger.info("training data: %d packed sequences of %d tokens (%s)", len(packed), seq_len, train_src.describe())
    train = IndexedBatches(packed.with_format(None), cfg.micro_batch_size, cfg.grad_accum, rank, world, cfg.seed)
    heldout = EvalSet(held, cfg.micro_batch_size, world, cfg.eval_batches) if held is not None else None
    return Data(train, heldout, eos_id, len(packed))


def _bad_record(sources, field: str | None = None) -> str | None:
    """The first bad record of `sources`' json files, as "FILE, line N: PROBLEM" (None when none is bad)."""
    for source in sources:
        if source is not None and source.builder == "json" and source.files:
            bad = first_bad_record(source.files, field)
            if bad is not None:
                return "{}, {}: {}".format(*bad)
    return None


def _naming_records(sequences, sources, field: str):
    """`sequences`, its read and tokenisation errors naming the file and line of a bad json record: a stream reads
    records only as training reaches them (pyarrow's "JSON parse error ... in row 2" counts rows per block)."""
    try:
        yield from sequences
    except ValueError as err:  # pyarrow's ArrowInvalid is one, and encode() raises one
        bad = _bad_record(sources, field)
        if bad is None:
            raise
        raise ValueError(bad) from err


def _finite_sequences(docs, tokenizer, eos_id, seq_len):
    carry: list[int] = []
    rows = iter(docs)
    while chunk := [row["text"] for row in itertools.islice(rows, 256)]:
        sequences, carry = pack(encode(tokenizer, chunk), eos_id, seq_len, carry)
        yield from sequences