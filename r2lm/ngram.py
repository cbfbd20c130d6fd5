"""An n-gram table: drafts for verified decoding that cost no forward (`generate(..., verify=True, ngram=table)`).

What a model writes after its last few tokens is often what text of its kind writes there ("I'd be happy to",
"def __init__(self"). An `NGramTable` holds, for every context of 1 .. `order` tokens seen at least `min_count`
times in a corpus, the token that most often followed it and that token's share of the context's occurrences (its
confidence). It drafts a row's next tokens one at a time, each after the longest context of the row's text (and
the tokens drafted before it) that the table holds, and stops where none is held. Prompt lookup
(r2lm.generation.lookup) copies from the row's own text; the table drafts where the text has not repeated yet, and
the policy (r2lm.generation.policy) takes, per row, the draft it expects to commit more and learns each source's
acceptance by its confidence. As with any draft, what is committed is the target's own greedy text.

A table is built from token ids (`NGramTable.build`, or `python -m r2lm.ngram build` from ShareGPT's training
split, the conversations the benchmark's held-out chat prompts are not from), and fits every model of the
tokenizer it was built with. It can count another token than the text's after each context: `--records --greedy`
counts the model's own greedy token after each context of the replies (read inside their conversations), a table
of what the model writes rather than what the corpus wrote, at one forward per token (docs/results.md weighs the
two at equal data). A table records its tokenizer's vocabulary size, and a model of another is refused. r2lm
ships one for SmolLM2-135M-Instruct (r2lm/ngrams/, `NGramTable.shipped`), as it ships its drafter.

The contexts are stored as keys: a context's tokens packed `bits` bits each (the most recent in the highest bits)
with its length above them, one sorted int64 array (at most 63 bits: `order` is capped by the vocabulary's width).
Drafting looks contexts up in a dictionary made from them once, on the host (`draft` says why). On disk: a folder of
table.safetensors (keys, next token, confidence), config.json (vocabulary size, order, min_count, what it was
built from) and checksums.sha256 (r2lm.checkpoints.manifest), written whole or not at all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from r2lm.checkpoints.manifest import verify_checkpoint
from r2lm.checkpoints.writing import atomic_output_dir, check_replaceable
from r2lm.drafter import target_digest
from r2lm.modeling_r2lm import R2LMForDiffusionLM
from r2lm.workloads import sharegpt_split

logger = logging.getLogger(__name__)

MAX_ORDER = 3  # the longest context: longer ones drafted no better on held-out replies (docs/results.md)
MIN_COUNT = 20  # contexts seen fewer times are left out: the table stays small and drafts as well
SHIPPED = Path(__file__).parent / "ngrams"  # the tables r2lm ships, one folder per target (NGramTable.shipped)
TABLE, CONFIG = "table.safetensors", "config.json"


@dataclass(frozen=True)
class TableConfig:
    """What a table is: the vocabulary it drafts in, its longest context, the fewest occurrences a context needs,
    the tokens it was counted over, and where they came from (`corpus`; `tokenizer`: a digest of the tokenizer's
    vocabulary, `tokenizer_digest`); `target_digest`: the model a shipped table is found for
    (r2lm.drafter.target_digest)."""

    vocab_size: int
    order: int
    min_count: int
    tokens: int = 0
    corpus: str = ""
    tokenizer: str = ""
    target_digest: str | None = None

    @property
    def bits(self) -> int:
        return bits_for(self.vocab_size)


def bits_for(vocab_size: int) -> int:
    return max(1, math.ceil(math.log2(vocab_size)))


def longest_order(vocab_size: int) -> int:
    """The longest context whose key fits 63 bits with its length (2 bits) above it."""
    return min(MAX_ORDER, (61 // bits_for(vocab_size)))


def pack(context: np.ndarray, bits: int) -> np.ndarray:
    """Keys [..., order] of the contexts of length 1 .. order that end a row: `context` [..., order] holds its most
    recent tokens, the latest first (negative where there is none). A context missing a token gets key -1 (no table
    key is negative)."""
    order = context.shape[-1]
    key, present, keys = np.zeros(context.shape[:-1], dtype=np.int64), np.ones(context.shape[:-1], dtype=bool), []
    for n in range(order):
        token = context[..., n]
        present &= token >= 0
        key = (key << bits) | np.where(token >= 0, token, 0)
        keys.append(np.where(present, key | ((n + 1) << (bits * order)), -1))  # its length above it: no two collide
    return np.stack(keys, -1)


class NGramTable:
    """The table (the module docstring): `keys` [N] sorted int64, `next` [N] the token that most often followed
    each context, `confidence` [N] its share of the context's occurrences."""

    def __init__(self, config: TableConfig, keys: torch.Tensor, next: torch.Tensor, confidence: torch.Tensor):
        if not 1 <= config.order <= longest_order(config.vocab_size):
            raise ValueError(f"order must be in [1, {longest_order(config.vocab_size)}] for a vocabulary of "
                             f"{config.vocab_size} tokens, got {config.order}")
        if not (keys.dim() == next.dim() == confidence.dim() == 1 and len(keys) == len(next) == len(confidence)):
            raise ValueError("an n-gram table's keys, next tokens and confidences are three 1-D tensors of one length")
        if len(keys) and (bool((keys[1:] <= keys[:-1]).any()) or int(keys[0]) < 0):
            raise ValueError("an n-gram table's keys must be non-negative and strictly increasing")
        if len(next) and not (0 <= int(next.min()) and int(next.max()) < config.vocab_size):
            raise ValueError(f"an n-gram table drafts a token outside its vocabulary [0, {config.vocab_size})")
        self.config = config
        self.keys, self.next, self.confidence = keys.long(), next.long(), confidence.float()
        self._index = None  # `index`: made at the first draft

    def __len__(self) -> int:
        return len(self.keys)

    # ------------------------------------------------------------------ building

    @classmethod
    def build(cls, sequences, vocab_size: int, order: int | None = None, min_count: int = MIN_COUNT,
              corpus: str = "", tokenizer: str = "", labels=None) -> NGramTable:
        """Count every context of 1 .. order tokens inside each of `sequences` (token id lists or arrays) and the
        token after it; keep the contexts seen at least `min_count` times, each with its likeliest next token.

        `labels` (one per sequence, of its length) count another token after each position's context instead of
        the text's own: labels[i][p] after sequences[i][:p], -1 where nothing is counted. The target's greedy
        tokens there make a table of what the target writes after a context rather than what the corpus wrote
        (`python -m r2lm.ngram build --greedy`)."""
        order = longest_order(vocab_size) if order is None else order
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
            raise ValueError(f"min_count must be a positive integer, got {min_count!r}")
        sequences = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
        tokens = np.concatenate([np.append(s, -1) for s in sequences]) if sequences else np.zeros(0, dtype=np.int64)
        real = tokens[tokens >= 0]  # -1 ends each sequence
        if len(real) and (real.max() >= vocab_size or (tokens < -1).any()):
            raise ValueError(f"a sequence holds a token outside the vocabulary [0, {vocab_size})")
        nexts = tokens
        if labels is not None:
            labels = [np.asarray(s, dtype=np.int64).reshape(-1) for s in labels]
            if [len(s) for s in labels] != [len(s) for s in sequences]:
                raise ValueError("labels must be one sequence per text sequence, of its length")
            nexts = np.concatenate([np.append(s, -1) for s in labels]) if labels else tokens
            if ((nexts < -1) | (nexts >= vocab_size)).any():
                raise ValueError(f"a label is outside the vocabulary [0, {vocab_size}) (or -1: not counted)")
        config = TableConfig(vocab_size, order, min_count, int((nexts >= 0).sum()), corpus, tokenizer)
        # column n: the token n + 1 places before each position (-1 before a sequence's start)
        context = np.stack([np.concatenate([np.full(n + 1, -1), tokens])[: len(tokens)] for n in range(order)], 1)
        keys, nexts = pack(context, config.bits).reshape(-1), np.repeat(nexts, order)
        seen = (keys >= 0) & (nexts >= 0)
        keys, nexts = keys[seen], nexts[seen]
        by = np.lexsort((nexts, keys))
        keys, nexts = keys[by], nexts[by]
        # runs of one (context, next token), then of one context
        starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (nexts[1:] != nexts[:-1])]) if len(keys) else \
            np.zeros(0, dtype=np.int64)
        counts = np.diff(np.r_[starts, len(keys)])
        pair_keys, pair_next = keys[starts], nexts[starts]
        first = np.flatnonzero(np.r_[True, pair_keys[1:] != pair_keys[:-1]]) if len(starts) else starts
        if not len(first):
            empty = torch.zeros(0, dtype=torch.long)
            return cls(config, empty, empty, torch.zeros(0))
        total = np.add.reduceat(counts, first)
        most = np.maximum.reduceat(counts, first)
        group = np.cumsum(np.r_[True, pair_keys[1:] != pair_keys[:-1]]) - 1
        # each context's likeliest next token (the lowest id among equals: runs are sorted by token)
        best = np.flatnonzero(counts == most[group])
        best = best[np.r_[True, group[best][1:] != group[best][:-1]]]
        kept = total >= min_count
        return cls(config, torch.from_numpy(pair_keys[first][kept]), torch.from_numpy(pair_next[best][kept]),
                   torch.from_numpy(most[kept] / total[kept]).float())

    # ------------------------------------------------------------------ drafting

    def check_model(self, model_config) -> None:
        """Refuse a model whose vocabulary is not the one this table was built in."""
        if model_config.vocab_size != self.config.vocab_size:
            raise ValueError(f"this n-gram table was built for a vocabulary of {self.config.vocab_size} tokens "
                             f"({self.config.tokenizer or 'its tokenizer'}); the model has {model_config.vocab_size}: "
                             "build one with its tokenizer (python -m r2lm.ngram build --model ...)")

    def draft(self, texts: list[list[int]], size: int, fill: int) -> tuple[np.ndarray, np.ndarray]:
        """([R, size] drafts, [R, size] confidence): each row's next tokens, each the likeliest after the longest
        context the table holds of the row's text texts[r] (its tokens, on the host: r2lm.generation.lookup.RowTexts)
        and the tokens drafted before it; `fill` (confidence 0) from where the table holds none on.

        A row at a time in dictionary reads: a few rows' take microseconds, where each of a vectorised chain's many
        small tensor operations costs a dispatch."""
        index, nexts, shares = self.index()
        tokens, confidence = np.full((len(texts), size), fill, dtype=np.int64), np.zeros((len(texts), size))
        for row, text in enumerate(texts):
            context = text[: -self.config.order - 1 : -1]  # the last first
            for j in range(size):
                held = None
                for n in range(1, len(context) + 1):  # a context is held only if its shorter ones are
                    found = index.get(tuple(context[:n]))
                    if found is None:
                        break
                    held = found
                if held is None:
                    break
                tokens[row, j], confidence[row, j] = nexts[held], shares[held]
                context = [nexts[held], *context[:-1]] if len(context) == self.config.order else [nexts[held], *context]
        return tokens, confidence

    def index(self) -> tuple[dict, list[int], list[float]]:
        """({context tokens, the last first: its row}, next tokens, confidences) as Python objects (made once)."""
        if self._index is None:
            bits, order = self.config.bits, self.config.order
            keys = self.keys.numpy()
            lengths = keys >> (bits * order)
            tokens = [(keys >> (bits * (lengths - 1 - n))) & (2**bits - 1) for n in range(order)]
            contexts = [tuple(row[:n]) for row, n in zip(np.stack(tokens, 1).tolist(), lengths.tolist(), strict=True)]
            self._index = (dict(zip(contexts, range(len(contexts)), strict=True)), self.next.tolist(),
                           self.confidence.tolist())
        return self._index

    # ------------------------------------------------------------------ files

    def save(self, folder, overwrite: bool = False) -> None:
        """Write the table to `folder`, whole or not at all (r2lm.checkpoints.writing: `overwrite` replaces only a
        folder r2lm wrote, unchanged since, or an empty one)."""
        with atomic_output_dir(Path(folder), overwrite) as scratch:
            save_file({"keys": self.keys.contiguous(), "next": self.next.to(torch.int32).contiguous(),
                       "confidence": self.confidence.to(torch.float16).contiguous()}, str(scratch / TABLE))
            (scratch / CONFIG).write_text(json.dumps(asdict(self.config), indent=1) + "\n")

    @classmethod
    def load(cls, folder) -> NGramTable:
        """A table saved by `save`, its files checked against their checksums (a damaged copy is refused, naming
        the file)."""
        folder = Path(folder)
        if not (folder / CONFIG).is_file() or not (folder / TABLE).is_file():
            raise ValueError(f"{folder} is not an n-gram table folder (no {CONFIG} and {TABLE}): build one with "
                             "python -m r2lm.ngram build")
        verify_checkpoint(folder)
        try:
            config = TableConfig(**json.loads((folder / CONFIG).read_text()))
            tensors = load_file(str(folder / TABLE))
            return cls(config, tensors["keys"], tensors["next"], tensors["confidence"])
        except (TypeError, KeyError, ValueError) as err:
            raise ValueError(f"{folder} is not a valid n-gram table: {err}") from err

    @classmethod
    def shipped(cls, target) -> NGramTable | None:
        """The table r2lm ships for `target` (r2lm/ngrams/: one folder per model, found by its target_digest, as
        r2lm.drafter.Drafter.shipped finds a drafter); None when none is made for it."""
        digest = target_digest(target)
        for folder in sorted(SHIPPED.iterdir()) if SHIPPED.is_dir() else []:
            config = folder / CONFIG
            if config.is_file() and json.loads(config.read_text()).get("target_digest") == digest:
                return cls.load(folder)
        return None


def tokenizer_digest(tokenizer) -> str:
    """Which tokenizer a table's ids are in, without naming a path: a digest of its vocabulary."""
    vocabulary = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.blake2b(vocabulary.encode(), digest_size=8).hexdigest()


def sharegpt_replies(limit: int | None = None):
    """The assistant turns of ShareGPT's training split (never the held-out one: the benchmark's chat prompts)."""
    for number, conversation in enumerate(sharegpt_split("train")):
        if limit is not None and number >= limit:
            return
        for turn in conversation["conversations"]:
            if turn.get("from") == "gpt" and turn.get("value"):
                yield turn["value"]


def read_records(path: Path, max_tokens: int | None = None):
    """(token ids, reply spans) of each fixed-text record in a jsonl file (python -m train.fixed_text: ShareGPT's
    training conversations through a model's chat template), until the replies hold max_tokens tokens."""
    replies = 0
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                ids, spans = record["ids"], record["spans"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}, line {number}: not a fixed-text record (ids, spans): {err}") from None
            if not all(0 < start <= end <= len(ids) for start, end in spans):
                raise ValueError(f"{path}, line {number}: a reply span lies outside the record's {len(ids)} tokens")
            yield ids, spans
            replies += sum(end - start for start, end in spans)
            if max_tokens is not None and replies >= max_tokens:
                return


def reply_labels(ids: list[int], spans, model=None) -> np.ndarray:
    """The token counted after each position's context: the reply's own inside the spans, or with `model` its
    greedy token after ids[:p] there (one forward over the record: the clean causal read AR decoding commits
    from); -1 outside the spans (what the user and the template wrote is context, not a reply)."""
    labels = np.full(len(ids), -1, dtype=np.int64)
    if model is None:
        for start, end in spans:
            labels[start:end] = ids[start:end]
        return labels
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, :-1, : model.config.vocab_size]
    greedy = logits.argmax(-1).cpu().numpy()
    for start, end in spans:
        labels[start:end] = greedy[start - 1 : end - 1]
    return labels


SHARD = 200  # records a labels cache file holds


def cached_labels(records: list, model, cache: Path, records_file: Path):
    """reply_labels(ids, spans, model) of each record, kept in `cache` a shard of SHARD records at a time (written
    whole or not at all) and read back from there: labelling millions of tokens on a CPU outlives a sitting, and a
    run started again goes on where the last one stopped. A cache made by another model or from other records is
    refused (cache/identity.json: the model's digest and dtype, the records file's digest)."""
    with records_file.open("rb") as f:
        records_digest = hashlib.file_digest(f, "blake2b").hexdigest()[:16]
    identity = {"target_digest": target_digest(model), "dtype": str(model.dtype), "records": records_digest}
    cache.mkdir(parents=True, exist_ok=True)
    known = cache / "identity.json"
    if known.is_file() and json.loads(known.read_text()) != identity:
        raise ValueError(f"--cache {cache} holds labels of another model or records ({known.read_text().strip()}), "
                         f"not {json.dumps(identity)}: give another folder")
    known.write_text(json.dumps(identity))
    for first in range(0, len(records), SHARD):
        part = records[first : first + SHARD]
        path = cache / f"{first // SHARD:06d}.npz"
        lengths = np.array([len(ids) for ids, _ in part])
        if path.is_file():  # a shard a shorter run (--max-tokens) left is made again whole
            with np.load(path) as shard:
                held, stored = shard["lengths"], shard["labels"]
            if not np.array_equal(held[: len(lengths)], lengths[: len(held)]):
                raise ValueError(f"{path} does not hold the labels of records {first} .. {first + len(part) - 1}")
            if len(held) >= len(lengths):
                yield from np.split(stored[: lengths.sum()].astype(np.int64), np.cumsum(lengths)[:-1])
                continue
        labels = [reply_labels(ids, spans, model) for ids, spans in part]
        partial = path.with_name(path.stem + ".partial.npz")
        np.savez(partial, labels=np.concatenate(labels).astype(np.int32), lengths=lengths)
        partial.replace(path)
        yield from labels


def main(argv=None) -> None:
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer

    parser = argparse.ArgumentParser(prog="python -m r2lm.ngram", description=(
        "Build an n-gram table (drafts for generate(verify=True, ngram=...) that cost no forward) from the replies "
        "of ShareGPT's training split, tokenized by a model's tokenizer, or from fixed-text records of its "
        "conversations (--records), counting the model's own greedy tokens (--greedy)."))
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="count a corpus into a table folder")
    build.add_argument("--model", type=Path, required=True,
                       help="the model the table drafts for (an R2LM or transformers folder: its tokenizer and vocabulary)")
    build.add_argument("--out", type=Path, required=True, help="the table folder to write (new, or --overwrite)")
    build.add_argument("--conversations", type=int, default=None, help="read only the first N training conversations")
    build.add_argument("--order", type=int, default=None, help="the longest context (default: the most that fits a key)")
    build.add_argument("--min-count", type=int, default=MIN_COUNT, help="the fewest occurrences a context needs")
    build.add_argument("--records", type=Path, default=None,
                       help="count the replies of fixed-text records instead (a jsonl file from python -m "
                            "train.fixed_text: ShareGPT's training conversations through the model's chat template), "
                            "each context read inside its conversation")
    build.add_argument("--greedy", action="store_true",
                       help="with --records: count the model's own greedy token after each context of a reply, not "
                            "the reply's: a table of what the model writes (one forward of the model per record)")
    build.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                       help="the model's dtype for --greedy (default: bfloat16: near-ties may go either way, and a "
                            "table counts)")
    build.add_argument("--cache", type=Path, default=None,
                       help="with --greedy: keep the labels in this folder as they are made, and read them back from "
                            "there (a run stopped goes on where it stopped; another model's cache is refused)")
    build.add_argument("--max-tokens", type=int, default=None, help="with --records: read records until their "
                       "replies hold this many tokens")
    build.add_argument("--ship", action="store_true",
                       help="record the model's digest, so that NGramTable.shipped(model) finds the table")
    build.add_argument("--overwrite", action="store_true", help="replace an n-gram table folder at --out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_replaceable(args.out, args.overwrite)  # before the counting, not after it
        if args.records is None and (args.greedy or args.max_tokens is not None):
            raise ValueError("--greedy and --max-tokens read --records (python -m train.fixed_text makes them)")
        if args.cache is not None and not args.greedy:
            raise ValueError("--cache keeps --greedy's labels: give --greedy too")
        if args.records is not None and not args.records.is_file():
            raise ValueError(f"--records {args.records}: no such file")
        if args.records is not None and args.conversations is not None:
            raise ValueError("--conversations limits ShareGPT's bare replies; limit --records with --max-tokens")
        if args.max_tokens is not None and args.max_tokens <= 0:
            raise ValueError(f"--max-tokens must be positive, got {args.max_tokens}")
    except ValueError as err:
        parser.error(str(err))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab_size = AutoConfig.from_pretrained(args.model).vocab_size
    labels = None
    if args.records is None:
        replies = list(tqdm(sharegpt_replies(args.conversations), desc="ShareGPT training replies", unit=" replies"))
        end = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        sequences = []
        for start in tqdm(range(0, len(replies), 1000), desc="tokenizing", unit=" x1000 replies"):
            sequences += [ids + end for ids in tokenizer(replies[start : start + 1000], add_special_tokens=False).input_ids]
        corpus = f"ShareGPT V3 training split, assistant turns ({len(replies)})"
    else:
        try:
            records = list(read_records(args.records, args.max_tokens))
            if args.greedy:
                model = R2LMForDiffusionLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval().to(
                    "cuda" if torch.cuda.is_available() else "cpu")  # a GPU labels millions of tokens in minutes
                made = cached_labels(records, model, args.cache, args.records) if args.cache else (
                    reply_labels(ids, spans, model) for ids, spans in records)
            else:
                made = (reply_labels(ids, spans) for ids, spans in records)
            labels = list(tqdm(made, total=len(records), desc="labelling" if args.greedy else "records",
                               unit=" records", dynamic_ncols=True))
        except ValueError as err:
            parser.error(str(err))
        sequences = [ids for ids, _ in records]
        corpus = (f"ShareGPT V3 training split, {len(sequences)} conversations through the chat template, replies "
                  + ("labelled by the model's greedy tokens" if args.greedy else "as written"))
    table = NGramTable.build(sequences, vocab_size, args.order, args.min_count, corpus=corpus,
                             tokenizer=tokenizer_digest(tokenizer), labels=labels)
    if args.ship:
        table.config = TableConfig(**{**asdict(table.config), "target_digest": target_digest(
            R2LMForDiffusionLM.from_pretrained(args.model))})
    table.save(args.out, overwrite=args.overwrite)
    logger.info("%s: %d contexts of 1 .. %d tokens from %d tokens", args.out, len(table), table.config.order,
                table.config.tokens)


if __name__ == "__main__":
    main()
