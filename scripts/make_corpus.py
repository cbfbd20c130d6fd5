"""Write real English text that ships with every Python: the documentation topics of `pydoc_data`.

    python scripts/make_corpus.py OUT_DIR

Writes OUT_DIR/train.txt and OUT_DIR/heldout.txt (paragraphs separated by blank lines; every 20th topic held out).
"""

import argparse
import pydoc_data.topics
import re
from pathlib import Path


def paragraphs(text: str) -> list[str]:
    parts = (re.sub(r"[ \t]+", " ", p).strip() for p in re.split(r"\n\s*\n", text))
    return [p for p in parts if len(p) > 40]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    train, heldout = [], []
    for i, name in enumerate(sorted(pydoc_data.topics.topics)):
        (heldout if i % 20 == 19 else train).extend(paragraphs(pydoc_data.topics.topics[name]))
    (args.out_dir / "train.txt").write_text("\n\n".join(train) + "\n")
    (args.out_dir / "heldout.txt").write_text("\n\n".join(heldout) + "\n")
    print(f"wrote {len(train)} training and {len(heldout)} held-out paragraphs to {args.out_dir}")


if __name__ == "__main__":
    main()
