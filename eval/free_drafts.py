"""What free drafts would commit: prompt lookup and n-gram tables simulated over the target's greedy replies.

    python -m eval.free_drafts --target TARGET [--table NAME=DIR ...] [--prompts 16] [--skip 3] [--new-tokens 128]
        [--draft 4] [--out docs/results/free_drafts]

Drafts that cost no forward (r2lm.generation.lookup, r2lm.ngram) are worth what verification would accept of them.
That depends on the target's text, not on the machine: so this measures it without timing anything. The target
writes its greedy replies (AR, --new-tokens tokens, EOS) to --prompts prompts per category, after the first --skip
(the lossless benchmark's own prompts are its first 3); then, for each source, verification is replayed over each
reply: a step drafts --draft tokens after the text so far, commits the drafted tokens the reply agrees with and the
reply's next token (AR's own). Sources: `lookup` (the row's latest earlier occurrence of its last 2, else 1, tokens),
each table alone, and `lookup+NAME` (lookup where a suffix recurs, else the table). Printed and written as JSON and
a PNG, per category: tokens per step (τ: what verification with that source alone would commit per forward), and
the share of drafts whose first token is right; for lookup also by the length of the matched suffix (what
r2lm.generation.policy's lookup confidence rests on).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from eval.common import eos_of
from eval.decoders import category_prompts, left_pad, r2lm_decoder
from eval.machine import name_of

logger = logging.getLogger("eval.free_drafts")

CATEGORIES = ("code", "chat", "prose")


def greedy_replies(target, tokenizer, prompts: list[list[int]], new_tokens: int, batch: int = 8) -> list[list[int]]:
    """The target's AR greedy reply to each prompt, through its end-of-sequence token (kept: AR generates it)."""
    eos = eos_of(tokenizer, target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    decode = r2lm_decoder(target, [] if eos is None else [eos], pad, block_size=1)
    replies = []
    for first in range(0, len(prompts), batch):
        with torch.no_grad():
            replies += decode(*left_pad(prompts[first : first + batch], pad), new_tokens).rows
    return replies


def replay(prompt: list[int], reply: list[int], draft) -> dict:
    """Verification replayed over one reply: `draft(texts) -> (tokens [size] with -1 past its end, matched n)`."""
    from r2lm.generation.lookup import RowTexts

    texts, done, steps, drafted, first = RowTexts([list(prompt)]), 0, 0, 0, 0
    by_match = {1: [0, 0], 2: [0, 0]}  # lookup's drafts by suffix length: [drafted, first token right]
    while done < len(reply):
        tokens, matched = draft(texts)
        agreed = 0
        while agreed < len(tokens) and done + agreed < len(reply) and tokens[agreed] == reply[done + agreed]:
            agreed += 1
        if len(tokens) and tokens[0] >= 0:
            drafted, first = drafted + 1, first + (agreed > 0)
            if matched in by_match:
                by_match[matched][0] += 1
                by_match[matched][1] += agreed > 0
        step = min(agreed + 1, len(reply) - done)
        texts.extend([reply[done : done + step]])
        done, steps = done + step, steps + 1
    return {"tokens": len(reply), "steps": steps, "drafted": drafted, "first_right": first, "by_match": by_match}


def sources(tables: dict, size: int) -> dict:
    """name -> draft(texts): lookup, each table alone, and lookup else each table."""

    def lookup(texts):
        tokens, matched = texts.lookup(size, -1)
        return tokens[0], int(matched[0])

    def alone(table):
        return lambda texts: (table.draft([texts.tokens[0]], size, -1)[0][0], 0)

    def lookup_else(table):
        def draft(texts):
            tokens, matched = lookup(texts)
            return (tokens, matched) if matched else alone(table)(texts)

        return draft

    out = {"lookup": lookup}
    for name, table in tables.items():
        out[name] = alone(table)
        out[f"lookup+{name}"] = lookup_else(table)
    return out


def measure(replies: dict, tables: dict, size: int) -> dict:
    """Per source and category: τ, the share of drafts right at their first token, and lookup's by suffix length."""
    results = {}
    for name, draft in sources(tables, size).items():
        results[name] = {}
        for category, rows in replies.items():
            runs = [replay(prompt, reply, draft) for prompt, reply in rows]
            total = {k: sum(r[k] for r in runs) for k in ("tokens", "steps", "drafted", "first_right")}
            cell = {"tau": total["tokens"] / total["steps"], "first_right": total["first_right"] / max(total["drafted"], 1),
                    "drafted": total["drafted"], "steps": total["steps"]}
            if name == "lookup":
                for n in (1, 2):
                    made, right = (sum(r["by_match"][n][i] for r in runs) for i in (0, 1))
                    cell[f"first_right_after_{n}"] = right / max(made, 1)
                    cell[f"drafted_after_{n}"] = made
            results[name][category] = cell
    return results


def print_table(result: dict) -> None:
    print(f"\nfree drafts replayed over the target's greedy replies ({result['prompts']} prompts a category, "
          f"{result['new_tokens']} tokens, {result['draft']} drafted a step): τ (first token right)")
    print(f"{'source':<34}" + "".join(f"{c:>16}" for c in CATEGORIES))
    for name, cells in result["sources"].items():
        print(f"{name:<34}" + "".join(f"{cells[c]['tau']:>9.2f} ({cells[c]['first_right']:.2f})" for c in CATEGORIES))
    cells = result["sources"]["lookup"]
    for n in (2, 1):
        print(f"{f'lookup after a {n}-token match':<34}" + "".join(
            f"{'':>6}({cells[c][f'first_right_after_{n}']:.2f} of {cells[c][f'drafted_after_{n}']:>4})" for c in CATEGORIES))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["sources"])
    fig, ax = plt.subplots(figsize=(3.5 + 0.3 * len(names) * len(CATEGORIES), 3.8))
    width, colors = 0.8 / len(names), plt.get_cmap("tab20").colors
    for k, name in enumerate(names):
        ax.bar([c + k * width for c in range(len(CATEGORIES))], [result["sources"][name][c]["tau"] for c in CATEGORIES],
               width, label=name, color=colors[k % len(colors)])
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(CATEGORIES))], CATEGORIES)
    ax.set_ylabel("tokens per verification step (τ)")
    ax.set_ylim(1, None)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def named(text: str) -> tuple[str, Path]:
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"--table takes NAME=DIR, got {text!r}")
    return name, Path(folder)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="the target model folder (R2LM)")
    parser.add_argument("--table", type=named, action="append", default=[], metavar="NAME=DIR",
                        help="an n-gram table (python -m r2lm.ngram build; repeatable)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per category (default: %(default)s)")
    parser.add_argument("--skip", type=int, default=3, help="leave out each category's first SKIP prompts (default: "
                        "%(default)s, the lossless benchmark's)")
    parser.add_argument("--new-tokens", type=int, default=128, help="reply length (default: %(default)s)")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are passed over")
    parser.add_argument("--draft", type=int, default=4, help="tokens drafted a step (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/results/free_drafts"), help="folder for "
                        "free_drafts.json and free_drafts.png (default: %(default)s)")
    args = parser.parse_args(argv)
    for option in ("prompts", "new_tokens", "draft", "max_prompt_tokens"):
        if getattr(args, option) <= 0:
            parser.error(f"--{option.replace('_', '-')} must be positive, got {getattr(args, option)}")
    if args.skip < 0:
        parser.error(f"--skip must be >= 0, got {args.skip}")
    names = [name for name, _ in args.table]
    if len(set(names)) != len(names) or "lookup" in names:
        parser.error(f"--table names must differ and not be 'lookup', got {names}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from r2lm import R2LMForDiffusionLM
    from r2lm.ngram import NGramTable

    try:
        target = R2LMForDiffusionLM.from_pretrained(args.target).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.target, padding_side="left")
        tables = {name: NGramTable.load(folder) for name, folder in args.table}
        for table in tables.values():
            table.check_model(target.config)
        prompts = {c: [ids for _, ids in category_prompts(c, args.skip + args.prompts, tokenizer,
                                                          args.max_prompt_tokens)[args.skip :]] for c in CATEGORIES}
    except (OSError, ValueError) as err:
        parser.error(str(err))
    replies = {c: list(zip(prompts[c], greedy_replies(target, tokenizer, prompts[c], args.new_tokens), strict=True))
               for c in tqdm(CATEGORIES, desc="greedy replies", unit=" category")}
    result = {"target": name_of(args.target), "tables": {name: {"folder": name_of(folder),
                                                                 **json.loads((folder / "config.json").read_text())}
                                                          for name, folder in args.table},
              "prompts": args.prompts, "skip": args.skip, "new_tokens": args.new_tokens, "draft": args.draft,
              "reply_tokens": {c: sum(len(r) for _, r in replies[c]) for c in CATEGORIES},
              "sources": measure(replies, tables, args.draft)}
    print_table(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "free_drafts.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "free_drafts.png")
    logger.info("wrote %s and %s", args.out / "free_drafts.json", args.out / "free_drafts.png")
    return result


if __name__ == "__main__":
    main()
