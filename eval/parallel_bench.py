"""Parallel decoding, measured: tokens per step and per forward, what they cost in quality, and the speed they buy
against AR decoding, before and after parallelism training (certainty forcing), R2LM against the causal dLLM.

    python -m eval.parallel_bench --model r2lm=BEFORE,AFTER --model causal=BEFORE,AFTER \\
        [--reference smollm2=HF_FOLDER] --text HELDOUT [--thresholds 0.5 0.7 0.9] [--prompts 16]
        [--prompt-tokens 64] [--new-tokens 64] [--block-size 16] [--verify 4 8 8:2 8:3 12:2] [--batch-sizes 1 8]
        [--speed-prompts 4]
        [--out docs/results] [--results-md docs/results.md] [--update]

For every checkpoint (a model name's BEFORE and AFTER parallelism training), on the same held-out prompts (the
first --prompt-tokens tokens of held-out documents), greedy:

- accepted and oracle tokens per step at each threshold (r2lm.generation.ParallelismMeter; oracle: window
  positions whose proposal already equals the token finally committed);
- quality: held-out masked NLL at mask ratios 0.15 / 0.5 / 0.9 (eval.likelihood.heldout_nll, the same masks for
  every checkpoint); token agreement of each threshold's output with the same model's one-token-per-step output
  (LLaDA's schedule with one step per token); with --reference NAME=HF_FOLDER (the original transformers model a
  name was converted from), agreement with the reference's own greedy continuation and the NLL of the generated
  text under the reference;
- speed, at each batch size, in one run interleaved a batch at a time over --speed-prompts prompts (batch 1 is
  timed over several prompts, since one prompt's text decides much of what a drafter guesses): R2LM at
  --speed-threshold, AR decoding of the same backbone (the model without its sidecars, block size 1, KV cache),
  transformers' generate on that backbone, and verify=True at each of --verify (B: drafts of B tokens, every
  outcome pre-drafted; B:W: W drafting windows per forward, `verify_windows`; lossless: it must equal AR token for
  token; checked), as generated tokens / s and ratios to AR; verify's accepted tokens per forward.

Writes parallel.json and parallel.png to --out and replaces the "Parallel decoding" section of --results-md
(between its markers, which scripts/make_results.py keeps) with tables rendered from the JSON (`render`). With
--update only the --model names given are measured again; the other models of parallel.json stay as they were
measured (the file records each model's commit; the prompt and measurement settings must match).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from eval import common
from eval.common import pack_texts, read_texts
from eval.likelihood import heldout_nll
from eval.machine import describe, label, linear_orders, name_of
from r2lm import R2LMForDiffusionLM, generate
from r2lm.convert.to_hf import without_sidecars
from r2lm.generation import ParallelismMeter
from r2lm.ops.linear import Tuner, install

REPO = Path(__file__).resolve().parents[1]

logger = logging.getLogger("eval.parallel_bench")
BEGIN, END = "<!-- parallel decoding: begin (eval/parallel_bench.py) -->", "<!-- parallel decoding: end -->"


# ---------------------------------------------------------------------------------------------- inputs


def load(path: str, tuner: Tuner):
    """The model (decoding through `tuner`, as the run's other models do) and its tokenizer."""
    from transformers import AutoTokenizer

    model = R2LMForDiffusionLM.from_pretrained(path).eval()
    install(model, tuner)
    return model, AutoTokenizer.from_pretrained(path, padding_side="left")


def held_out_prompts(tokenizer, texts: list[str], count: int, length: int) -> torch.Tensor:
    """[count, length]: the first `length` tokens of the first `count` held-out documents that are long enough."""
    rows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == count:
            break
    if len(rows) < count:
        raise ValueError(f"only {len(rows)} held-out documents have {length} tokens; {count} prompts were asked for")
    return torch.tensor(rows)


# ---------------------------------------------------------------------------------------------- measurements


@torch.no_grad()
def parallelism(model, prompts, args) -> dict:
    """Accepted / oracle tokens per step at each threshold, and agreement with one token per step."""
    options = dict(max_new_tokens=args.new_tokens, block_size=args.block_size, eos_token_id=[])
    blocks = -(-args.new_tokens // args.block_size)
    one = generate(model, prompts, steps=blocks * args.block_size, **options).sequences[:, prompts.shape[1] :]
    out = {"one_per_step": one}
    for threshold in args.thresholds:
        meter = ParallelismMeter()
        seq = generate(model, prompts, threshold=threshold, step_callback=meter, **options).sequences[:, prompts.shape[1] :]
        out[threshold] = {**meter.summary(seq), "agreement_with_one_per_step": float((seq == one).float().mean()),
                          "tokens": seq}
    return out


@torch.no_grad()
def reference_scores(reference, prompts, outputs: dict, new_tokens: int) -> dict:
    """Agreement with the reference's greedy continuation, and the reference's NLL of each generated text."""
    greedy = reference.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[:, prompts.shape[1] :]
    scores = {}
    for key, tokens in outputs.items():
        text = torch.cat([prompts, tokens], 1)
        logits = reference(text).logits[:, prompts.shape[1] - 1 : -1].float()
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        scores[key] = {"agreement_with_reference": float((tokens == greedy).float().mean()), "reference_nll": float(nll)}
    return scores


@torch.no_grad()
def verify_options(spec: str) -> dict:
    """generate() options of a --verify entry: "B" (drafts of B tokens, every outcome pre-drafted), "B:W" (W
    drafting windows) or "B:lookup" (drafts by prompt lookup, no drafting window)."""
    b, _, w = spec.partition(":")
    if not (b.isdigit() and (not w or w.isdigit() or w == "lookup")):
        raise ValueError(f"--verify takes B, B:W (positive integers) or B:lookup, got {spec!r}")
    if w == "lookup":
        return dict(block_size=int(b), verify_draft="lookup")
    return dict(block_size=int(b), verify_windows=int(w) if w else None)


def verify_spec(spec: str) -> str:
    try:
        verify_options(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def speed_batches(prompts: torch.Tensor, count: int, batch: int) -> list[torch.Tensor]:
    """The batches a speed measurement decodes: the first max(count, batch) prompts, `batch` at a time (the prompts
    repeated where there are fewer than one batch), so batch 1 is timed over `count` prompts rather than one."""
    rows = -(-max(count, batch) // batch) * batch
    ids = prompts.repeat(-(-rows // prompts.shape[0]), 1)[:rows]
    return list(ids.split(batch))


def speed(model, prompts, args, batch: int) -> dict:
    """tokens/s of R2LM, AR (same backbone), transformers' generate and verify=True, interleaved, over the batches
    of `speed_batches` (each decoder's time: all of them, median over --repeats)."""
    from r2lm.convert.to_hf import transformers_backbone

    batches = speed_batches(prompts, args.speed_prompts, batch)
    plain = without_sidecars(model)
    hf = transformers_backbone(plain).eval()
    n = args.new_tokens
    runs = {
        "r2lm": lambda ids: generate(model, ids, max_new_tokens=n, block_size=args.block_size,
                                     threshold=args.speed_threshold, eos_token_id=[]),
        "ar": lambda ids: generate(plain, ids, max_new_tokens=n, block_size=1, eos_token_id=[]),
        "transformers": lambda ids: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                                min_new_tokens=n, do_sample=False, pad_token_id=0),
    }
    for spec in args.verify:
        options = verify_options(spec)
        runs[f"verify@{spec}"] = lambda ids, o=options: generate(model, ids, max_new_tokens=n, verify=True,
                                                                 eos_token_id=[], **o)
    lookups = [verify_options(spec)["block_size"] for spec in args.verify if spec.endswith(":lookup")]
    if lookups and batch == 1:  # transformers' own prompt lookup (assisted generation: one row at a time)
        runs["transformers_lookup"] = lambda ids: hf.generate(ids, attention_mask=torch.ones_like(ids),
                                                              max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                                              pad_token_id=0, prompt_lookup_num_tokens=max(lookups))
    logger.info("speed at batch %d: %d prompts, %s; %d repeats", batch, len(batches) * batch, ", ".join(runs),
                args.repeats)
    for run in runs.values():  # warm-up
        run(batches[0])
    # Interleaved a batch at a time, so a drift in this machine's speed (a shared host's memory bandwidth moves AR's
    # tok/s by 10-25% within minutes) falls on every decoder alike rather than on whichever ran then.
    times, results = {name: [] for name in runs}, {}  # results: each decoder's outputs of its first timed pass
    for _ in range(args.repeats):
        spent, outputs = dict.fromkeys(runs, 0.0), {name: [] for name in runs}
        for ids in batches:
            for name, run in runs.items():
                start = time.perf_counter()
                outputs[name].append(run(ids))
                spent[name] += time.perf_counter() - start
        for name in runs:
            times[name].append(spent[name])
            results.setdefault(name, outputs[name])
    sequences = {name: [out if torch.is_tensor(out) else out.sequences for out in outs]  # transformers: a tensor
                 for name, outs in results.items()}
    verified = [f"verify@{spec}" for spec in args.verify]

    def same_as_ar(name):
        return all(map(torch.equal, sequences[name], sequences["ar"]))

    checks = {"verify_is_ar": all(map(same_as_ar, verified)),
              "ar_is_transformers": all(same_as_ar(t) for t in ("transformers", "transformers_lookup") if t in results)}
    tps = {name: len(batches) * batch * n / statistics.median(t) for name, t in times.items()}

    def per_forward(name):  # over all the batches: generated tokens / the forwards each row took part in
        outs = results[name]
        return sum(o.new_tokens for o in outs) / sum(o.new_tokens / o.tokens_per_forward for o in outs)

    return {"prompts": len(batches) * batch, "tokens_per_s": tps, "vs_ar": {k: v / tps["ar"] for k, v in tps.items()},
            "vs_transformers": {k: v / tps["transformers"] for k, v in tps.items()},
            "r2lm_tokens_per_forward": per_forward("r2lm"),
            "verify_tokens_per_forward": {v: per_forward(v) for v in verified}, **checks}


def measure(path: str, args, texts, tuner: Tuner, reference=None) -> dict:
    model, tokenizer = load(path, tuner)
    prompts = held_out_prompts(tokenizer, texts, args.prompts, args.prompt_tokens)
    par = parallelism(model, prompts, args)
    entry = {"checkpoint": path, "sidecar_layers": model.config.sidecar_layers, "thresholds": {}}
    for t in args.thresholds:
        entry["thresholds"][f"{t:g}"] = {k: v for k, v in par[t].items() if k != "tokens"}
    if reference is not None:
        outputs = {f"{t:g}": par[t]["tokens"] for t in args.thresholds} | {"one_per_step": par["one_per_step"]}
        entry["reference"] = reference_scores(reference, prompts, outputs, args.new_tokens)
    eos = tokenizer.eos_token_id
    rows = pack_texts(tokenizer, texts, args.nll_seq_len, eos, args.nll_sequences)
    nll = heldout_nll(model, rows, mode="auto", block_size=args.block_size, separator_id=eos, progress=False)
    entry["masked_nll"] = {r: v["nll"] for r, v in nll["masked"].items()}
    entry["speed"] = {str(b): speed(model, prompts, args, b) for b in args.batch_sizes}
    return entry


# ---------------------------------------------------------------------------------------------- report


def backbone_changed(before: str, after: str) -> bool:
    """Whether any weight but the sidecars' differs between two checkpoints (LoRA merged into the backbone, or a run
    without freeze_backbone): then verify=True of `after` no longer decodes the original model's text."""
    from safetensors import safe_open

    def tensors(folder):
        return {p: safe_open(str(p), "pt") for p in sorted(Path(folder).glob("*.safetensors"))}

    def named(handles):
        return {k: (h, k) for h in handles.values() for k in h.keys() if ".sidecar." not in k}

    a, b = named(tensors(before)), named(tensors(after))
    return a.keys() != b.keys() or any(not torch.equal(a[k][0].get_tensor(k), b[k][0].get_tensor(k)) for k in a)


def _changed_backbone_notes(results: dict) -> list[str]:
    """What "verify == AR" means for a model whose training changed the backbone (LoRA): lossless against that model,
    not against the original one; its speed is not the original model's (read from the reference columns)."""
    notes = []
    for name, stages in results["models"].items():
        if not stages.get("after", {}).get("backbone_changed"):
            continue  # a frozen backbone: verify=True decodes the original model's greedy text before and after
        before, after = (stages[stage].get("reference", {}).get("one_per_step") for stage in ("before", "after"))
        if before is None or after is None:
            notes.append(f"\n{name}, after: its training changed the backbone, so its verify rows are lossless with "
                         "respect to the trained model, not the original one.")
            continue
        notes.append(
            f"\n{name}, after: its training changed the backbone, so its AR decoding is no longer the original "
            f"model's (NLL of its one-token-per-step text under the original {after['reference_nll']:.3f}, against "
            f"{before['reference_nll']:.3f} before; {after['agreement_with_reference']:.1%} token agreement). Its "
            "verify rows are lossless with respect to the trained model, not the original: their ratios to AR "
            "measure a faster decoding of a different (here more repetitive) model, not a faster original model.")
    return notes


def render(results: dict) -> str:
    """The "Parallel decoding" section of docs/results.md, from parallel.json."""
    s = results["settings"]
    commit = f"{results.get('commit', '?')}, {label(results.get('machine'))}"
    earlier = {name: f"{run['commit']}, {label(run.get('machine'))}" for name, run in results.get("measured", {}).items()
               if run["commit"] != results.get("commit") or run.get("machine") != results.get("machine")}
    if earlier:
        commit += "; kept from earlier runs (`--update`): " + ", ".join(f"{n} at {c}" for n, c in earlier.items())
    lines = [
        "## Parallel decoding",
        "",
        f"Generated by `python -m eval.parallel_bench` (commit {commit}): {s['prompts']} held-out "
        f"prompts of {s['prompt_tokens']} tokens, {s['new_tokens']} new tokens, block size {s['block_size']}, greedy. "
        "*Accepted* tokens per step: what the threshold rule took; *oracle*: window positions whose proposal already "
        "equalled the token finally committed (a rule that knew which proposals are right could take them). "
        "Agreement: share of generated tokens equal to the same model's one-token-per-step output.",
        "",
        "| model | stage | threshold | accepted / step | oracle / step | agreement | masked NLL @0.5 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, stages in results["models"].items():
        for stage, e in stages.items():
            for t, v in e["thresholds"].items():
                lines.append(f"| {name} | {stage} | {t} | {v['accepted_tpf']:.2f} | {v['oracle_tpf']:.2f} | "
                             f"{v['agreement_with_one_per_step']:.1%} | {e['masked_nll'].get('0.5', float('nan')):.3f} |")
    refs = [(n, st, e) for n, stages in results["models"].items() for st, e in stages.items() if "reference" in e]
    if refs:
        lines += ["", "Against the original model (the transformers checkpoint converted): agreement with its greedy "
                  "continuation, and its NLL of the generated text.", "",
                  "| model | stage | output | agreement with original | NLL under original |", "|---|---|---|---|---|"]
        for name, stage, e in refs:
            for key, v in e["reference"].items():
                lines.append(f"| {name} | {stage} | {key} | {v['agreement_with_reference']:.1%} | {v['reference_nll']:.3f} |")
    specs = list(dict.fromkeys(k for stages in results["models"].values() for e in stages.values()
                               for v in e["speed"].values() for k in v["verify_tokens_per_forward"]))
    lengths = ", ".join(k.removeprefix("verify@") for k in specs)
    lines += ["", f"Speed: generated tokens / s, R2LM at threshold {s['speed_threshold']}, AR = the same backbone "
              "without sidecars decoding one token per forward with the KV cache, transformers = its `generate` on "
              f"that backbone, verify@b = `verify=True` with drafts of b tokens, every outcome pre-drafted (b + 1 "
              "windows), verify@b:w with w windows (`verify_windows`), verify@b:lookup with drafts copied from the "
              "row's own text (`verify_draft=\"lookup\"`, prompt lookup: no window); here "
              f"{lengths} (lossless: its output is AR's, checked); transformers lookup = its `generate` with "
              "`prompt_lookup_num_tokens` (the longest B:lookup; batch 1 only: assisted generation decodes one row). "
              "Ratios to AR over the prompts timed (every decoder decodes the same ones, a batch at a time, and is "
              "timed over all of them); one interleaved run per batch size.",
              "",
              f"| model | stage | batch | prompts timed | R2LM / AR | verify@{lengths} / AR | AR / transformers "
              f"| transformers lookup / AR | R2LM tokens/forward | verify@{lengths} tokens/forward | verify == AR |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, stages in results["models"].items():
        for stage, e in stages.items():
            for batch, v in e["speed"].items():
                ratios = " / ".join(f"{v['vs_ar'][k]:.2f}" if k in v["vs_ar"] else "-" for k in specs)
                per_forward = " / ".join(f"{v['verify_tokens_per_forward'][k]:.2f}"
                                         if k in v["verify_tokens_per_forward"] else "-" for k in specs)
                theirs = v["vs_ar"].get("transformers_lookup")
                timed = v.get("prompts", int(batch))  # measured before --speed-prompts: one batch
                lines.append(f"| {name} | {stage} | {batch} | {timed} | {v['vs_ar']['r2lm']:.2f} | {ratios} | "
                             f"{v['vs_transformers']['ar']:.2f} | {'-' if theirs is None else f'{theirs:.2f}'} | "
                             f"{v['r2lm_tokens_per_forward']:.2f} | {per_forward} | {v['verify_is_ar']} |")
    lines += _changed_backbone_notes(results)
    lines += ["", "![parallel decoding](results/parallel.png)"]
    return "\n".join(lines)


def replace_section(path: Path, section: str) -> None:
    """Replace this benchmark's section of `path` (eval.common.replace_section, between its markers)."""
    common.replace_section(path, section, BEGIN, END)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, accepted, oracle, ratio, verified = [], [], [], [], []
    top = f"{max(results['settings']['thresholds']):g}"
    for name, stages in results["models"].items():
        for stage, e in stages.items():
            labels.append(f"{name}\n{stage}")
            accepted.append(e["thresholds"][top]["accepted_tpf"])
            oracle.append(e["thresholds"][top]["oracle_tpf"])
            ratio.append([v["vs_ar"]["r2lm"] for v in e["speed"].values()])
            verified.append([max(v["vs_ar"][k] for k in v["verify_tokens_per_forward"]) for v in e["speed"].values()])
    x = range(len(labels))
    # about an inch a bar group per panel, so that two-line labels such as "smollm2_lora\nbefore" do not overlap
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(11.0, 2.0 * len(labels)), 4.4))
    left.bar([i - 0.2 for i in x], accepted, 0.4, label="accepted")
    left.bar([i + 0.2 for i in x], oracle, 0.4, label="oracle")
    left.set(title=f"tokens per step at threshold {top}", xticks=list(x), xticklabels=labels)
    left.legend()
    batches = results["settings"]["batch_sizes"]
    width = 0.8 / (2 * len(batches))
    for j, b in enumerate(batches):
        for k, (values, what) in enumerate(((ratio, "threshold"), (verified, "verify, best of b[:w] and b:lookup"))):
            offset = (2 * j + k - (2 * len(batches) - 1) / 2) * width
            right.bar([i + offset for i in x], [r[j] for r in values], width, label=f"{what}, batch {b}",
                      hatch="//" if k else None)
    right.axhline(1.0, color="k", lw=0.8)
    right.set(title="tokens/s / AR tokens/s", xticks=list(x), xticklabels=labels)
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)  # below: bars fill the panel
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, metavar="NAME=BEFORE,AFTER",
                        help="checkpoints of one model before and after parallelism training (repeatable)")
    parser.add_argument("--reference", action="append", default=[], metavar="NAME=HF_FOLDER",
                        help="the transformers checkpoint a model was converted from")
    parser.add_argument("--text", type=Path, required=True, help="held-out text (.txt / .jsonl / folder)")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    parser.add_argument("--speed-threshold", type=float, default=0.9)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--verify", nargs="+", default=["4", "8", "8:2", "8:3", "12:2", "4:lookup", "8:lookup"],
                        metavar="B[:W|:lookup]", type=verify_spec,
                        help="verify=True's draft lengths B, each with W drafting windows (default B + 1: every "
                             "outcome; a verification forward reads B * (W + 1) columns) or drafted by prompt "
                             "lookup (B columns)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--speed-prompts", type=int, default=4,
                        help="prompts each speed measurement decodes, a batch at a time (at least one batch): batch "
                             "1 is timed over this many prompts, not one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nll-seq-len", type=int, default=256)
    parser.add_argument("--nll-sequences", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--update", action="store_true",
                        help="measure the --model names given and keep the other models of OUT/parallel.json as "
                             "they were measured (their commit is noted); the prompt and measurement settings must "
                             "be the ones that file was made with")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    parser.add_argument("--results-md", type=Path, default=REPO / "docs" / "results.md")
    args = parser.parse_args(argv)
    if not 1 <= args.speed_prompts <= args.prompts:
        parser.error(f"--speed-prompts must be between 1 and --prompts ({args.prompts}), got {args.speed_prompts}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    texts = read_texts(args.text)
    references = dict(item.split("=", 1) for item in args.reference)
    # files by name (eval.machine.name_of), never an absolute path of this machine
    settings = {k: (name_of(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results = {"settings": settings, "commit": common.commit(), "machine": describe(), "models": {}, "measured": {}}
    tuner = Tuner()  # r2lm.ops.linear's product orders, decided once for every model of the run
    if args.update:
        results = kept_results(args.out / "parallel.json", results)
    for item in args.model:
        name, paths = item.split("=", 1)
        before, after = paths.split(",")
        reference = AutoModelForCausalLM.from_pretrained(references[name]).eval() if name in references else None
        results["models"][name] = {}
        for stage, path in (("before", before), ("after", after)):
            logger.info("%s, %s parallelism training: %s", name, stage, path)
            results["models"][name][stage] = measure(path, args, texts, tuner, reference)
        results["models"][name]["after"]["backbone_changed"] = backbone_changed(before, after)
        results["measured"][name] = {"commit": results["commit"], "verify": args.verify, "machine": results["machine"],
                                     "linear_orders": linear_orders(tuner)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parallel.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "parallel.png")
    section = render(results)
    replace_section(args.results_md, section)
    print(section)
    return results


# what every model of one parallel.json must have been measured with (the tables compare them row by row)
SHARED_SETTINGS = ("text", "thresholds", "speed_threshold", "prompts", "prompt_tokens", "new_tokens", "block_size",
                   "batch_sizes", "repeats", "nll_seq_len", "nll_sequences", "threads")


def kept_results(path: Path, results: dict) -> dict:
    """`--update`: the models of an earlier parallel.json, under this run's settings and commit, each model with the
    commit it was measured at (`measured`). Refuses a file made with other prompt or measurement settings."""
    if not path.is_file():
        raise FileNotFoundError(f"--update keeps the models of {path}, which does not exist")
    old = json.loads(path.read_text())
    differ = [k for k in SHARED_SETTINGS if old["settings"].get(k) != results["settings"][k]]
    if differ:
        raise ValueError(f"--update: {path} was measured with other settings ({', '.join(differ)}: "
                         f"{[old['settings'].get(k) for k in differ]}); rerun every model instead")
    measured = old.get("measured") or {name: {"commit": old.get("commit", "?"), "verify": old["settings"]["verify"]}
                                       for name in old["models"]}
    return {**results, "models": old["models"], "measured": measured}


if __name__ == "__main__":
    main()
