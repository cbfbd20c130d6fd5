"""Fixed-text records for a drafter (objective=drafter with drafter.distill): ShareGPT's training-split
conversations as they are, the original answers, tokenised through the target's chat template, every assistant turn
a reply span the drafter learns to continue. The labels are the target's own next-token distributions, computed from
its features in training; the text only supplies contexts. Generating that many replies with the target would cost
days on a CPU (teacher_data.py); reading text costs one forward per token.

    python -m train.fixed_text --target MODEL --out data/sharegpt_text.jsonl --max-tokens 10000000 \\
        [--exclude heldout.jsonl] [--agreement 200]

Records (jsonl, as train/drafter.py reads them): {"id": "sharegpt/<segment>", "ids": token ids, "prompt_tokens":
the first reply's start, "spans": [[start, end), ...] of every reply (its end-of-turn token included: what the
target would generate), "source": "sharegpt-text", "tokenizer": a digest of the tokenizer's files}. Conversations
are taken in a seeded random order (the leading records are a random sample: drafter.max_tokens reads the same
corpus at several sizes), held-out ones never (r2lm.workloads' split, closed over conversations and prompt texts),
nor those of --exclude files (the drafter's own held-out teacher answers). A conversation longer than
--max-record-tokens keeps its turns up to the last reply that fits.

--agreement N measures, before any training, how far the text is from what the target would write: over the replies
of the first N records, the share of tokens that are the target's own greedy next token (1.0 on its own replies),
written beside OUT as OUT.agreement.json. The file is written whole or not at all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
from pathlib import Path

logger = logging.getLogger("train.fixed_text")

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


def messages_of(conversation: dict) -> list[dict]:
    """A ShareGPT conversation as chat messages: an optional system turn, then user and assistant turns alternating
    from a user turn, cut at the first turn that breaks that order (or is empty)."""
    messages = []
    for turn in conversation.get("conversations") or []:
        role, content = ROLES.get(turn.get("from")), (turn.get("value") or "").strip()
        want = ("system", "user") if not messages else ("assistant",) if messages[-1]["role"] == "user" else ("user",)
        if role not in want or not content:
            break
        messages.append({"role": role, "content": content})
    return messages


def encode_conversation(tokenizer, messages: list[dict], max_tokens: int) -> tuple[list[int], list[list[int]]]:
    """(ids, reply spans) of a conversation through the chat template, each piece tokenised as decoding would read
    it: the text up to an assistant turn's generation prompt, then the reply (to its end-of-turn token). Turns after
    the last reply that fits in max_tokens are left out; ([], []) if no reply fits or the template does not render
    each conversation as an extension of its beginning."""
    render = tokenizer.apply_chat_template
    ids: list[int] = []
    spans: list[list[int]] = []
    done = ""  # what is tokenised so far
    special = set(tokenizer.all_special_ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:k], tokenize=False, add_generation_prompt=True)
        whole = render(messages[: k + 1], tokenize=False)
        if not prompt.startswith(done) or not whole.startswith(prompt):
            return ([], []) if not spans else (ids, spans)
        head = tokenizer(prompt[len(done) :], add_special_tokens=False)["input_ids"]
        reply = tokenizer(whole[len(prompt) :], add_special_tokens=False)["input_ids"]
        ends = [i + 1 for i, token in enumerate(reply) if token in special]
        end = ends[-1] if ends else len(reply)  # through the end-of-turn token: what the target generates
        if len(ids) + len(head) + end > max_tokens:
            break
        ids += head
        spans.append([len(ids), len(ids) + end])
        ids += reply
        done = whole
    if spans:
        ids = ids[: spans[-1][1]]  # nothing after the last reply
    return ids, spans


def tokenizer_digest(folder: Path) -> str:
    """A digest of the tokenizer files of a model folder: which ids a record's tokens are."""
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")):
        if (folder / name).is_file():
            digest.update(name.encode() + (folder / name).read_bytes())
    return digest.hexdigest()


def excluded_conversations(files: list[Path]) -> set[str]:
    from r2lm.workloads import SHAREGPT, conversation_of

    out = set()
    for file in files:
        with file.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                try:
                    source, _, segment = str(json.loads(line).get("id", "")).partition("/")
                except (json.JSONDecodeError, AttributeError):
                    raise ValueError(f"--exclude {file}, line {number}: not a JSON record with an id") from None
                if source == SHAREGPT:
                    out.add(conversation_of(segment))
    return out


def write_records(args, tokenizer) -> dict:
    from tqdm.auto import tqdm

    from r2lm.workloads import SHAREGPT, conversation_of, sharegpt_split

    excluded = excluded_conversations(args.exclude)
    conversations = [c for c in sharegpt_split("train") if conversation_of(c["id"]) not in excluded]
    random.Random(args.seed).shuffle(conversations)
    digest = tokenizer_digest(args.target)
    tokens = replies = count = 0
    partial = args.out.with_name(args.out.name + ".partial")
    with partial.open("w", encoding="utf-8") as f, tqdm(total=args.max_tokens, desc="records", unit="tok",
                                                         unit_scale=True, dynamic_ncols=True) as progress:
        for conversation in conversations:
            ids, spans = encode_conversation(tokenizer, messages_of(conversation), args.max_record_tokens)
            if not spans:
                continue
            f.write(json.dumps({"id": f"{SHAREGPT}/{conversation['id']}", "ids": ids, "prompt_tokens": spans[0][0],
                                "spans": spans, "source": "sharegpt-text", "tokenizer": digest}) + "\n")
            count, tokens = count + 1, tokens + len(ids)
            replies += sum(b - a for a, b in spans)
            progress.update(len(ids))
            if tokens >= args.max_tokens:
                break
    partial.replace(args.out)  # whole or not at all
    summary = {"records": count, "tokens": tokens, "reply_tokens": replies, "conversations_excluded": len(excluded),
               "complete": tokens >= args.max_tokens}
    logger.info("wrote %s: %d records, %d tokens (%d in replies)%s", args.out, count, tokens, replies,
                "" if summary["complete"] else f": the training split holds fewer than {args.max_tokens}")
    return summary


def agreement(args, records: int) -> dict:
    """The target's top-1 agreement with the reply tokens of the first `records` records of args.out."""
    import torch
    from tqdm.auto import tqdm

    from r2lm import R2LMForDiffusionLM

    model = R2LMForDiffusionLM.from_pretrained(args.target, dtype=torch.float32).eval()
    same = total = 0
    nll = 0.0
    with args.out.open(encoding="utf-8") as f, torch.no_grad():
        for line in tqdm(list(f)[:records], desc="agreement", unit="record", dynamic_ncols=True):
            record = json.loads(line)
            ids = torch.tensor(record["ids"])[None]
            logits = model(ids).logits[0, :-1, : model.config.vocab_size].float()
            for start, end in record["spans"]:
                predicted, text = logits[start - 1 : end - 1], ids[0, start:end]
                same += int((predicted.argmax(-1) == text).sum())
                nll += float(torch.nn.functional.cross_entropy(predicted, text, reduction="sum"))
                total += end - start
    out = {"records": records, "reply_tokens": total, "top1_agreement": same / max(total, 1),
           "nll_per_token": nll / max(total, 1)}
    logger.info("the target's greedy token is the text's on %.1f%% of %d reply tokens (NLL %.3f per token)",
                100 * out["top1_agreement"], total, out["nll_per_token"])
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="the target model folder (its tokenizer and chat "
                        "template tokenise the text; --agreement runs it)")
    parser.add_argument("--out", type=Path, required=True, help="the jsonl file to write")
    parser.add_argument("--max-tokens", type=int, default=10_000_000, help="stop once the records hold this many "
                        "tokens (default: 10M)")
    parser.add_argument("--max-record-tokens", type=int, default=2048, help="at most this many tokens per record "
                        "(default: 2048; training cuts records into seq_len windows)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], help="a jsonl file of records whose "
                        "ShareGPT conversations are left out (repeatable): the drafter's own held-out answers")
    parser.add_argument("--seed", type=int, default=0, help="the order of the conversations (default: 0)")
    parser.add_argument("--agreement", type=int, default=0, metavar="N", help="then measure the target's top-1 "
                        "agreement with the replies of the first N records (OUT.agreement.json)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        for name in ("max_tokens", "max_record_tokens"):
            if getattr(args, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
        if args.agreement < 0:
            raise ValueError(f"--agreement must be >= 0, got {args.agreement}")
        if args.out.suffix != ".jsonl" or args.out.is_dir():
            raise ValueError(f"--out {args.out}: the output is a jsonl file; name it *.jsonl")
        for file in args.exclude:
            if not file.is_file():
                raise ValueError(f"--exclude {file}: no such file")
        from train.teacher_data import check_writable_folder, load_tokenizer

        check_writable_folder(args.out)
        tokenizer = load_tokenizer(str(args.target), "--target")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"--target {args.target}: its tokenizer has no chat template")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        summary = write_records(args, tokenizer)
        if args.agreement:
            summary["agreement"] = agreement(args, args.agreement)
            path = args.out.with_name(args.out.name + ".agreement.json")
            path.write_text(json.dumps(summary, indent=1) + "\n")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
