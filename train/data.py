"""Training data: documents -> tokens -> fixed-length packed sequences -> per-rank micro-batches.

Sources (`data.train`, `data.heldout`): local text / jsonl / json / parquet files (a path, a folder, a glob or a
list of them) or a hub dataset name, read with `datasets` (so `HF_DATASETS_OFFLINE=1` works for local files and
for hub datasets already in the cache). Documents are tokenised with the checkpoint's tokenizer (special-token
text inside documents is split, never turned into [MASK] or EOS), each followed by EOS, concatenated and cut
into `seq_len` pieces.

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

import codecs
import glob
import hashlib
import itertools
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from r2lm.text import encode, pack

logger = logging.getLogger(__name__)

BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
PACK_DOCS = 1000  # documents packed together per map batch; at most seq_len - 1 tokens per batch are dropped
PACK_VERSION = "r2lm-pack-1"  # part of the cache fingerprint: bump when the packing changes
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "name" or "namespace/name"
TEXT_CHECK_BYTES = 1 << 16  # of every local text file, read by resolve_source: a binary file shows at once


# ---------------------------------------------------------------------------------------------- sources


@dataclass
class Source:
    builder: str  # "text" | "json" | "parquet" | "hub"
    files: list[str] | None = None
    name: str | None = None  # hub dataset name

    def describe(self) -> str:
        if self.name:
            return f"hub dataset {self.name}"
        return self.files[0] if len(self.files) == 1 else f"{len(self.files)} {self.builder} files"


def _builder_of(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED:
        suffixes = suffixes[:-1]
    return BUILDERS.get(suffixes[-1]) if suffixes else None


def _looks_like_path(spec: str) -> bool:
    """Whether `spec` means a local file or folder rather than a hub dataset: it starts like a path, has a data
    file's extension, cannot be a hub name (two slashes, spaces ...), or starts with a folder that exists here."""
    if spec.startswith(("/", "./", "../", "~")) or _builder_of(Path(spec)) is not None or not HUB_NAME.match(spec):
        return True
    return "/" in spec and Path(spec.split("/")[0]).is_dir()


def _no_such_file(spec: str, what: str) -> str:
    where = "" if Path(spec).expanduser().is_absolute() else f" (relative to the working directory {Path.cwd()})"
    hub = "; for a hub dataset of that name set data.format=hub" if HUB_NAME.match(spec) else ""
    return f"{what}: no such file: {spec}{where}{hub}"


def first_non_text(path, limit: int | None = None) -> str | None:
    """Where the file stops being UTF-8 text ("byte 0xff at offset 151 is not UTF-8", a NUL byte), within its
    first `limit` bytes (None: all of it); None when it is text."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20 if limit is None else min(1 << 20, limit - offset)):
            nul = chunk.find(b"\0")  # valid UTF-8, but no text file holds one (UTF-16 text holds many)
            pending = len(decoder.getstate()[0])  # bytes of a character begun in the previous chunk
            try:
                decoder.decode(chunk if nul < 0 else chunk[:nul])
            except UnicodeDecodeError as err:
                return f"byte 0x{err.object[err.start]:02x} at offset {offset - pending + err.start} is not UTF-8"
            if nul >= 0:
                return f"a NUL byte at offset {offset + nul}"
            offset += len(chunk)
    if limit is None or offset < limit:  # the whole file was read
        pending = len(decoder.getstate()[0])
        if pending:
            return f"it ends inside a UTF-8 character (offset {offset - pending})"
    return None


def _check_text(path: str, what: str, limit: int | None) -> None:
    problem = first_non_text(path, limit)
    if problem is not None:
        raise ValueError(f"{what}: {path} is not UTF-8 text: {problem} (a binary file?); text files must be UTF-8")


def resolve_source(spec, fmt: str = "auto", what: str = "data.train") -> Source:
    """Turn a config value into files (checked to exist, be non-empty and, for text, to start as UTF-8 text) or a
    hub name. Raises ValueError."""
    specs = spec if isinstance(spec, list) else [spec]
    files: list[str] = []
    hub: list[str] = []
    for s in specs:
        path = Path(s).expanduser()
        if any(ch in s for ch in "*?["):
            matches = sorted(glob.glob(str(path), recursive=True))
            if not matches:
                raise ValueError(f"{what}: the pattern {s} matches no file")
            files += matches
        elif path.is_dir():
            found = sorted(str(p) for p in path.rglob("*") if p.is_file() and _builder_of(p)
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))  # .ipynb_checkpoints/
            if not found:
                raise ValueError(f"{what}: the folder {s} holds no data file ({', '.join(sorted(BUILDERS))})")
            files += found
        elif path.is_file():
            files.append(str(path))
        elif fmt == "hub" or (fmt == "auto" and not _looks_like_path(s)):
            hub.append(s)
        else:
            raise ValueError(_no_such_file(s, what))
    if hub and (files or len(hub) > 1):
        raise ValueError(f"{what}: give one hub dataset, or local files, not a mix: {specs}")
    if hub:
        return Source("hub", name=hub[0])
    for f in files:
        if Path(f).stat().st_size == 0:
            raise ValueError(f"{what}: data file {f} is empty")
    builders = {fmt} if fmt not in ("auto", "hub") else {_builder_of(Path(f)) for f in files}
    if None in builders:
        unknown = [f for f in files if _builder_of(Path(f)) is None]
        raise ValueError(f"{what}: cannot tell the format of {unknown[0]} from its extension; set data.format")
    if len(builders) > 1:
        raise ValueError(f"{what}: files of different formats ({sorted(builders)}); use one format per source")
    builder = builders.pop()
    if builder == "text":
        for f in files:
            if not f.lower().endswith(COMPRESSED):  # datasets decompresses those; their bytes are not text
                _check_text(f, what, TEXT_CHECK_BYTES)
    return Source(builder, files=files)


JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
              type(None): "null"}
JSON_SPACE = re.compile(r"[ \t\r\n]*")


def first_bad_record(files: list[str], field: str | None = None) -> tuple[str, str, str] | None:
    """(file, where, problem) of the first record of json / jsonl `files` that cannot be read ("line 7", "not JSON
    (Expecting ',' delimiter: column 12)"), or whose `field` holds no string (given a field); None when all read.
    datasets names neither the file nor the line of such a record. A file that starts with "[" is one JSON array
    (datasets reads it whole); any other holds JSON lines (datasets accepts blank lines, and several objects on one)."""
    for f in files:
        if f.lower().endswith(COMPRESSED):
            continue
        with open(f, "rb") as fh:
            start = fh.read(64).lstrip(codecs.BOM_UTF8).lstrip()
            fh.seek(0)
            if start.startswith(b"["):
                problem = _bad_array(fh.read().decode("utf-8", errors="replace").lstrip("\ufeff"), field)
                if problem is not None:
                    return (f, *problem)
                continue
            for number, raw in enumerate(fh, 1):
                problem = _bad_line(raw[3:] if number == 1 and raw.startswith(codecs.BOM_UTF8) else raw, field)
                if problem is not None:
                    return f, f"line {number}", problem
    return None


def _bad_line(raw: bytes, field: str | None) -> str | None:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1})"
    line = line.rstrip("\r\n")
    decoder = json.JSONDecoder()
    pos = JSON_SPACE.match(line).end()
    while pos < len(line):
        try:
            value, pos = decoder.raw_decode(line, pos)
        except json.JSONDecodeError as err:
            return f"not JSON ({err.msg}: column {err.colno})"
        problem = _bad_value(value, field, strings=False)
        if problem is not None:
            return problem
        pos = JSON_SPACE.match(line, pos).end()
    return None


def _bad_array(text: str, field: str | None) -> tuple[str, str] | None:
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        return f"line {err.lineno}", f"not JSON ({err.msg}: column {err.colno})"
    for i, value in enumerate(values if isinstance(values, list) else [values]):
        problem = _bad_value(value, field, strings=True)
        if problem is not None:
            return f"item {i} of its array", problem
    return None


def _bad_value(value, field: str | None, strings: bool) -> str | None:
    """Why one JSON value is not a record with a string `field` (an array may also hold plain strings)."""
    if strings and isinstance(value, str):
        return None
    if not isinstance(value, dict):
        return f"holds {JSON_KINDS.get(type(value), 'a value')}, not an object (a record)"
    if field is not None and field not in value:
        return f"has no {field!r} field"
    if field is not None and not isinstance(value[field], str):
        return f"its {field!r} is {JSON_KINDS.get(type(value[field]), 'a value')}, not a string"
    return None


def fingerprint(files: list[str], known: dict | None = None) -> dict[str, dict]:
    """{file: {"size", "mtime_ns", "sha256"}}: what a checkpoint records of its data files, so that a resumed run
    notices one that changed. A file whose size and modification time match `known` (an earlier record) keeps its
    sha256 there instead of being read again."""
    out = {}
    for f in files:
        size, mtime_ns = _stat(f)
        old = (known or {}).get(f)
        out[f] = {"size": size, "mtime_ns": mtime_ns, "sha256": old["sha256"] if old is not None and
                  (old["size"], old["mtime_ns"]) == (size, mtime_ns) else None}
    unread = [f for f, record in out.items() if record["sha256"] is None]
    if unread:
        logger.info("reading %d data file(s), %.1f MB, for their sha256 (a resumed run checks them)", len(unread),
                    sum(out[f]["size"] for f in unread) / 1e6)
    for f in unread:
        out[f]["sha256"] = _sha256(f)
    return out


def data_changes(recorded: dict[str, dict], files: list[str]) -> list[str]:
    """How `files` differ from a checkpoint's `fingerprint` of them: new, gone and changed files. Only a file whose
    size or modification time differ is read; one that was touched or copied without a change is unchanged."""
    changes = []
    for f in files:
        old = recorded.get(f)
        if old is None:
            changes.append(f"{f} is new")
            continue
        size, mtime_ns = _stat(f)
        if size != old["size"]:
            changes.append(f"{f} changed ({old['size']} bytes then, {size} now)")
        elif mtime_ns != old["mtime_ns"] and _sha256(f) != old["sha256"]:
            changes.append(f"{f} changed (the same size, other content)")
    return changes + [f"{f} is gone" for f in recorded if f not in files]


def _stat(path: str) -> tuple[int, int]:
    st = Path(path).stat()
    return st.st_size, st.st_mtime_ns


def _sha256(path: str) -> str:
    from r2lm.checkpoints.manifest import sha256_of  # each version of a file is read once per process

    return sha256_of(Path(path))


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


def eos_id_of(tokenizer, model_config) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = model_config.eos_token_id[0] if isinstance(model_config.eos_token_id, list) else model_config.eos_token_id
    if eos is None:
        raise ValueError("neither the tokenizer nor the model config defines an EOS token, which packing needs as separator")
    return int(eos)


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
