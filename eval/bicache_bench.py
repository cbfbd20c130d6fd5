"""BiCache on a trained bidirectional model: profile the safe-depth table, then decode a document-QA workload with
and without the shared-document reuse, and measure what the approximation costs.

    python -m eval.bicache_bench --model /tmp/bidir_run/final --corpus /tmp/c [--out runs/bicache_bench]

- Profile (r2lm.prefix.profile) on the first half of the held-out text: prefixes of several lengths, each followed
  by `--question-tokens` of real text and `--new-tokens` [MASK]s, as a request looks at decode time. One table per tau.
- Workload: a few long documents from the training text, several questions each (batch size 1, the document is the
  shared prefix, added to the store once). Decoded by the no-cache bidirectional decoder with a fixed schedule
  (LLaDA's `steps` schedule, no EOS stop), so with and without BiCache take the same steps and the time difference is the
  cost per step. Reported: tokens/s (decode only, and with the one-time prefix encoding), the depths the table gave,
  and token agreement with the no-reuse output.
- Accuracy: on the second half of the held-out text, (prefix, question, continuation) triples; the continuation is
  masked (all of it, and a seeded half of it) and predicted by the exact forward and by the stitched forward, at the
  table's depth and at every forced depth. Reported: masked-token cross-entropy and accuracy.

Prints a table, writes results.json, the tables (table_tau*.json, loadable with SafeDepthTable.load) and a PNG.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from r2lm import R2LMForDiffusionLM, generate
from r2lm.prefix import BiCache, prefix_ratio, profile
from r2lm.prefix.bicache import stitched_forward

QUESTIONS = [
    "\n\nQuestion: What is this section about?\nAnswer:",
    "\n\nQuestion: Which statement does the text describe, and what does it do?\nAnswer:",
    "\n\nQuestion: Give an example from the text above.\nAnswer:",
    "\n\nQuestion: What happens when the described operation fails?\nAnswer:",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="trained bidirectional R2LM checkpoint (with its tokenizer)")
    p.add_argument("--corpus", type=Path, required=True, help="folder with train.txt and heldout.txt (make_corpus.py)")
    p.add_argument("--out", type=Path, default=Path("runs/bicache_bench"))
    p.add_argument("--taus", type=float, nargs="+", default=[0.9, 0.95, 0.97, 0.99])
    p.add_argument("--quantile", type=float, default=0.0, help="sample quantile the profile aggregates by (0 = min)")
    p.add_argument("--profile-prefixes", type=int, nargs="+", default=[8, 16, 32, 64, 96, 128, 192, 240])
    p.add_argument("--profile-offsets", type=int, default=3, help="samples per prefix length")
    p.add_argument("--question-tokens", type=int, default=16, help="real tokens after the prefix in profile/eval samples")
    p.add_argument("--doc-tokens", type=int, nargs="+", default=[64, 128, 192, 240], help="one document per length")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps-per-block", type=int, default=None,
                   help="LLaDA steps per block (default: block_size / 2, i.e. two tokens per step)")
    p.add_argument("--eval-prefixes", type=int, nargs="+", default=[32, 64, 128, 192, 240])
    p.add_argument("--eval-offsets", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the workload; the fastest counts")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- data


def halves(tokenizer, path: Path) -> tuple[list[int], list[int]]:
    """The held-out text as one token stream, split in two: profiling never sees the accuracy samples."""
    ids = tokenizer(path.read_text()).input_ids
    return ids[: len(ids) // 2], ids[len(ids) // 2 :]


def windows(tokens: list[int], prefix_lens, offsets: int, after: int):
    """(prefix, following `after` tokens) windows of `tokens`, `offsets` evenly spaced starts per prefix length."""
    out = []
    for P in prefix_lens:
        room = len(tokens) - P - after
        if room < 0:
            raise ValueError(f"{len(tokens)} tokens cannot hold a prefix of {P} and {after} more")
        for i in range(offsets):
            s = room * i // max(offsets - 1, 1)
            out.append((tokens[s : s + P], tokens[s + P : s + P + after]))
    return out


def documents(tokenizer, path: Path, lengths) -> list[list[int]]:
    """Documents of the given token lengths: runs of consecutive training paragraphs, from spread-out places."""
    paragraphs = path.read_text().split("\n\n")
    docs = []
    for i, n in enumerate(lengths):
        start, ids = (i + 1) * len(paragraphs) // (len(lengths) + 1), []
        while len(ids) < n:
            ids += tokenizer(paragraphs[start] + "\n\n").input_ids
            start += 1
        docs.append(ids[:n])
    return docs


# ---------------------------------------------------------------------------------------------- measurements


def decode_workload(model, requests, args, store=None):
    """(seconds, outputs): every request decoded once, batch size 1."""
    outputs, start = [], time.perf_counter()
    for doc, question in requests:
        prompt = torch.tensor([doc + question])
        blocks = -(-args.new_tokens // args.block_size)
        per_block = args.steps_per_block or max(1, args.block_size // 2)
        out = generate(model, prompt, max_new_tokens=args.new_tokens, block_size=args.block_size, steps=blocks * per_block,
                       eos_token_id=[], bicache=store)
        outputs.append(out.sequences[0, prompt.shape[1] :])
    return time.perf_counter() - start, outputs


def timed(model, requests, args, make_store=None):
    """Fastest of `repeats` passes (a shared machine's noise only ever adds time); a fresh store per pass, so the
    prefix encoding is timed too."""
    best = None
    for _ in range(args.repeats):
        encode_s, store = 0.0, None
        if make_store is not None:
            t0 = time.perf_counter()
            store = make_store()
            encode_s = time.perf_counter() - t0
        seconds, outputs = decode_workload(model, requests, args, store)
        if best is None or seconds + encode_s < best[0] + best[1]:
            best = (seconds, encode_s, outputs, store)
    return best


def entry_table(tables):
    """Any of the tables: a throwaway store only computes entries here, the depth is chosen explicitly."""
    return next(iter(tables.values()))


@torch.no_grad()
def masked_scores(model, samples, args, tables):
    """Masked-token cross-entropy, accuracy and KL(exact || reuse) per token of the continuation, exact vs stitched
    (every forced depth and each table's depth), for a fully masked continuation and a seeded half-masked one.

    For scale, `kl_other_prefix` is KL(exact || exact with another sample's prefix of the same length): how much the
    predictions depend on the prefix at all. A reuse error is small or large relative to that."""
    L, mask_id, q = model.config.num_hidden_layers, model.config.mask_token_id, args.question_tokens
    # the columns that predict the continuation after[q:]: its own under inplace (LLaDA), one earlier under shift
    lead = model.config.kind.lead
    predicting = slice(q - lead, -lead or None)
    gen = torch.Generator().manual_seed(0)
    same_length = {}
    for prefix, _ in samples:
        same_length.setdefault(len(prefix), []).append(prefix)
    results = {}
    for name, ratio in (("all_masked", 1.0), ("half_masked", 0.5)):
        by_depth = torch.zeros(L + 1, 3)  # summed (loss, correct, KL(exact || reuse)) over masked tokens
        by_tau = {tau: torch.zeros(3) for tau in tables}
        count, kl_other = 0, 0.0
        for prefix, after in samples:
            target = torch.tensor(after[q:])
            masked = torch.rand(len(target), generator=gen) < ratio if ratio < 1 else torch.ones(len(target), dtype=torch.bool)
            masked[0] |= not masked.any()
            rest = torch.tensor(after[:q] + torch.where(masked, mask_id, target).tolist())[None]
            entry = BiCache(entry_table(tables)).add(model, prefix)
            scores, exact = [], None
            for depth in range(L + 1):  # depth 0 is the exact forward
                logp = stitched_forward(model, entry, rest, depth)[0, predicting][masked].log_softmax(-1)
                exact = logp if exact is None else exact
                scores.append(torch.stack([F.nll_loss(logp, target[masked], reduction="sum"),
                                           (logp.argmax(-1) == target[masked]).sum().float(),
                                           F.kl_div(logp, exact, log_target=True, reduction="sum")]))
            group = same_length[len(prefix)]
            other = group[(group.index(prefix) + 1) % len(group)]
            other_logp = stitched_forward(model, BiCache(entry_table(tables)).add(model, other), rest, 0)
            kl_other += float(F.kl_div(other_logp[0, predicting][masked].log_softmax(-1), exact, log_target=True, reduction="sum"))
            by_depth += torch.stack(scores)
            for tau, table in tables.items():
                by_tau[tau] += scores[table.depth(prefix_ratio(len(prefix), rest.shape[1]))]
            count += int(masked.sum())
        results[name] = {
            "tokens": count,
            "loss_by_depth": (by_depth[:, 0] / count).tolist(),
            "accuracy_by_depth": (by_depth[:, 1] / count).tolist(),
            "kl_by_depth": (by_depth[:, 2] / count).tolist(),
            "kl_other_prefix": kl_other / count,
            "by_tau": {str(t): {"loss": float(v[0] / count), "accuracy": float(v[1] / count), "kl": float(v[2] / count)}
                       for t, v in by_tau.items()},
        }
    return results


# ---------------------------------------------------------------------------------------------- report


def plot(path: Path, tables, scores, rows, L):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    table = next(iter(tables.values()))
    sim = torch.tensor(table.similarity)
    for layer in range(L):
        ax[0].plot(table.edges, sim[:, layer], marker="o", label=f"layer {layer}")
    for tau in tables:
        ax[0].axhline(tau, color="gray", lw=0.7, ls=":")
    ax[0].set(xlabel="prefix ratio bucket (lower edge)", ylabel="min cosine, prefix K/V alone vs in context",
              title="profile (dotted: tau)")
    ax[0].legend(fontsize=7)
    for i, (name, s) in enumerate(scores.items()):
        ax[1].plot(range(1, L + 1), s["kl_by_depth"][1:], marker="o", color=f"C{i}", label=name)
        ax[1].axhline(s["kl_other_prefix"], color=f"C{i}", ls="--", lw=0.8, label=f"{name}: another prefix")
    ax[1].set(xlabel="forced reuse depth b", ylabel="KL(exact || reuse) per masked token (nats)", yscale="log",
              title="held-out canvas: divergence from the exact forward")
    ax[1].legend(fontsize=8)
    for i, row in enumerate(rows):  # labels staggered: configs with the same depths land on the same spot
        ax[2].scatter(row["tokens_per_s"], row["agreement"], s=40)
        label = row["config"].replace("BiCache ", "")
        ax[2].annotate(label, (row["tokens_per_s"], row["agreement"]), xytext=(4, 6 - 12 * (i % 2)),
                       textcoords="offset points", fontsize=8)
    ax[2].set(xlabel="tokens/s (decode)", ylabel="token agreement with no reuse", title="workload")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = R2LMForDiffusionLM.from_pretrained(args.model).eval()
    if model.config.kind.exact_cache:
        raise SystemExit(f"{args.model} is a {model.config.attention} model; BiCache is for bidirectional ones")
    if model.config.kind.shift and args.question_tokens < 1:
        raise SystemExit("--question-tokens must be >= 1 for a shift model: the token before the continuation predicts it")
    L, mask_id = model.config.num_hidden_layers, model.config.mask_token_id
    profile_half, eval_half = halves(tokenizer, args.corpus / "heldout.txt")

    # 1. profile: rest = real question tokens + the [MASK] canvas, as at decode time
    samples = [(p, a + [mask_id] * args.new_tokens)
               for p, a in windows(profile_half, args.profile_prefixes, args.profile_offsets, args.question_tokens)]
    t0 = time.perf_counter()
    tables = {tau: profile(model, samples, tau=tau, quantile=args.quantile) for tau in args.taus}
    profile_s = (time.perf_counter() - t0) / len(args.taus)
    for tau, table in tables.items():
        table.save(args.out / f"table_tau{tau}.json")

    # 2. workload
    docs = documents(tokenizer, args.corpus / "train.txt", args.doc_tokens)
    questions = [tokenizer(q).input_ids for q in QUESTIONS]
    requests = [(d, q) for d in docs for q in questions]
    n_tokens = len(requests) * args.new_tokens
    base_s, _, base_out, _ = timed(model, requests, args)
    rows = [dict(config="no reuse", tau=None, depths={}, tokens_per_s=n_tokens / base_s, tokens_per_s_incl_encode=n_tokens / base_s,
                 encode_s=0.0, speedup=1.0, agreement=1.0)]
    for tau, table in tables.items():
        def make_store(table=table):
            store = BiCache(table)
            for d in docs:
                store.add(model, d)
            return store

        seconds, encode_s, outputs, store = timed(model, requests, args, make_store)
        agreement = sum(float((o == b).float().mean()) for o, b in zip(outputs, base_out, strict=True)) / len(requests)
        rows.append(dict(config=f"BiCache tau={tau}", tau=tau, depths=dict(sorted(store.stats.depths.items())),
                         tokens_per_s=n_tokens / seconds, tokens_per_s_incl_encode=n_tokens / (seconds + encode_s),
                         encode_s=encode_s, speedup=base_s / seconds, agreement=agreement))

    # 3. accuracy on held-out text
    eval_samples = windows(eval_half, args.eval_prefixes, args.eval_offsets, args.question_tokens + args.new_tokens)
    scores = masked_scores(model, eval_samples, args, tables)

    ratios = sorted({round(prefix_ratio(len(d), len(q) + args.new_tokens), 3) for d, q in requests})
    print(f"model {args.model}: {L} layers; profile {len(samples)} samples ({profile_s:.1f} s per tau), "
          f"workload {len(docs)} documents x {len(questions)} questions, prefix ratios {ratios}")
    for tau, table in tables.items():
        print(f"  tau {tau}: buckets {table.edges}\n           measured {table.measured} -> table {table.depths}")
    head = (f"{'config':<18} {'depths used':<18} {'tok/s':>7} {'+encode':>8} {'speedup':>8} {'agree':>6} "
            f"{'CE(all)':>8} {'acc(all)':>8} {'KL(all)':>8} {'CE(half)':>8} {'acc(half)':>9}")
    print(head + "\n" + "-" * len(head))
    for row in rows:
        key = "exact" if row["tau"] is None else str(row["tau"])
        cells = []
        for name in ("all_masked", "half_masked"):
            s = scores[name]
            v = (s["loss_by_depth"][0], s["accuracy_by_depth"][0], 0.0) if key == "exact" else (
                s["by_tau"][key]["loss"], s["by_tau"][key]["accuracy"], s["by_tau"][key]["kl"])
            row[f"{name}_loss"], row[f"{name}_accuracy"], row[f"{name}_kl"] = v
            cells += [f"{v[0]:8.4f}", f"{v[1]:8.4f}", f"{v[2]:8.1e}"] if name == "all_masked" else [
                f"{v[0]:8.4f}", f"{v[1]:9.4f}"]
        depths = ",".join(f"{d}:{n}" for d, n in row["depths"].items()) or "-"
        print(f"{row['config']:<18} {depths:<18} {row['tokens_per_s']:7.1f} {row['tokens_per_s_incl_encode']:8.1f} "
              f"{row['speedup']:7.2f}x {row['agreement']:6.3f} " + " ".join(cells))
    for name, s in scores.items():
        print(f"{name} ({s['tokens']} tokens), by forced depth 0..{L}:\n  CE  " + " ".join(f"{v:.4f}" for v in s["loss_by_depth"])
              + "\n  acc " + " ".join(f"{v:.4f}" for v in s["accuracy_by_depth"])
              + "\n  KL  " + " ".join(f"{v:.1e}" for v in s["kl_by_depth"])
              + f"\n  for scale, KL to the exact forward with a different prefix of the same length: {s['kl_other_prefix']:.1e}")

    result = dict(args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, layers=L,
                  profile_samples=len(samples), profile_seconds_per_tau=profile_s, workload_ratios=ratios,
                  tables={str(t): vars(tb) for t, tb in tables.items()}, rows=rows, scores=scores)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(args.out / "bicache.png", tables, scores, rows, L)
    print(f"wrote {args.out}/results.json, {args.out}/bicache.png, {args.out}/table_tau*.json")


if __name__ == "__main__":
    main()
