"""The prefix-cache benchmark's workloads (`python -m eval.prefix_bench`; its --help describes each): token
sequences cut from real text (Python's pydoc topics) so that prompts share exactly the prefixes a workload means
them to share, and nothing by accident."""

from __future__ import annotations

import logging
import random
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eval.common import REPO

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- text


class TextPool:
    """Token sequences cut from real text: documents from consecutive paragraphs, questions and answers from
    single sentences. Every call consumes fresh text (nothing is handed out twice)."""

    def __init__(self, paragraphs: list[str], tokenizer, rng: random.Random):
        self.tok, self.rng = tokenizer, rng
        self.docs = [p for i, p in enumerate(paragraphs) if i % 4]  # 3/4 of the paragraphs feed documents
        sentences = []
        for i, p in enumerate(paragraphs):
            if i % 4 == 0:  # the other quarter is split into sentences for questions and answers
                sentences += [s.strip() for s in re.split(r"(?<=[.!?])\s+", p) if 5 <= len(s.split()) <= 30]
        rng.shuffle(sentences)
        self.sentences = sentences
        self._doc, self._sentence = 0, 0

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def document(self, n_tokens: int, header: str = "") -> list[int]:
        """About n_tokens tokens of consecutive paragraphs (cut at n_tokens exactly)."""
        parts, count = [], len(self.encode(header)) if header else 0
        while count < n_tokens + 8:
            if self._doc >= len(self.docs):
                raise RuntimeError("the corpus ran out of paragraphs: use smaller workloads (--quick, fewer rounds)")
            parts.append(self.docs[self._doc])
            count += len(self.encode(self.docs[self._doc])) + 1
            self._doc += 1
        return self.encode(header + "\n\n".join(parts))[:n_tokens]

    def sentence(self) -> str:
        if self._sentence >= len(self.sentences):
            raise RuntimeError("the corpus ran out of sentences: use smaller workloads")
        self._sentence += 1
        return self.sentences[self._sentence - 1]

    def question(self, speaker: str = "Question", reply: str = "Answer") -> list[int]:
        s = self.sentence().rstrip(".!?")
        return self.encode(f"\n\n{speaker}: {s}?\n{reply}:")

    def answer(self, max_tokens: int) -> list[int]:
        text = " " + self.sentence()
        while len(self.encode(text)) < max_tokens // 2:
            text += " " + self.sentence()
        return self.encode(text)[:max_tokens]


def read_paragraphs(corpus: Path, out: Path) -> list[str]:
    if not (corpus / "train.txt").is_file():
        corpus = out / "corpus"
        if not (corpus / "train.txt").is_file():
            logger.info("writing the pydoc corpus to %s", corpus)
            subprocess.run([sys.executable, str(REPO / "scripts" / "make_corpus.py"), str(corpus)], check=True)
    text = (corpus / "train.txt").read_text()
    return [p for p in text.split("\n\n") if p.strip()]


# ---------------------------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    requests: list  # token lists (whole prompts)
    kinds: list  # per request: "qa" (working set), "scan" (one-off), "turn"
    info: dict = field(default_factory=dict)


def make_docs(pool: TextPool, rng: random.Random, args) -> list[list[int]]:
    lo, hi = args.doc_tokens
    return [pool.document(rng.randint(lo, hi)) for _ in range(args.docs)]


def doc_qa(pool, rng, docs, args) -> Workload:
    items = [(d, pool.question()) for d in range(len(docs)) for _ in range(args.questions)]
    rng.shuffle(items)
    return Workload("doc_qa", [docs[d] + q for d, q in items], ["qa"] * len(items),
                    {"documents": len(docs), "document_tokens": [len(d) for d in docs],
                     "questions_per_document": args.questions})


def multi_turn(pool, rng, args) -> Workload:
    system = pool.document(args.system_tokens, header="System: you answer questions about the Python language "
                           "reference. Ground every answer in these notes.\n\n")
    order = [c for c in range(args.conversations) for _ in range(args.turns)]
    rng.shuffle(order)  # random interleaving; each conversation keeps its own turn order
    history = {c: list(system) for c in range(args.conversations)}
    requests = []
    for c in order:
        prompt = history[c] + pool.question("User", "Assistant")
        requests.append(prompt)
        history[c] = prompt + pool.answer(args.answer_tokens)
    return Workload("multi_turn", requests, ["turn"] * len(requests),
                    {"system_tokens": len(system), "conversations": args.conversations, "turns": args.turns,
                     "longest_prompt": max(map(len, requests))})


def mixed(pool, rng, docs, args) -> Workload:
    lo, hi = args.doc_tokens
    requests, kinds, scan_tokens = [], [], 0
    for _ in range(args.rounds):
        items = [("qa", docs[d] + pool.question()) for d in range(len(docs))]
        for _ in range(args.scan_per_round):
            one_off = pool.document(rng.randint(lo, hi)) + pool.question()
            scan_tokens += len(one_off)
            items.append(("scan", one_off))
        rng.shuffle(items)
        kinds += [k for k, _ in items]
        requests += [r for _, r in items]
    return Workload("mixed", requests, kinds,
                    {"rounds": args.rounds, "working_set_documents": len(docs), "scan_per_round": args.scan_per_round,
                     "scan_tokens": scan_tokens, "qa_requests": kinds.count("qa"), "scan_requests": kinds.count("scan")})


def head(config, tokens: list[int]) -> list[int]:
    """The part of a prompt generate() prefills (and looks up): all but the last token under `shift`."""
    return tokens[: config.kind.head(len(tokens))]
