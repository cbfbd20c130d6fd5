"""Generate from an R2LM checkpoint with cached parallel decoding (`model.generate`).

    r2lm-generate CHECKPOINT --prompt "The for statement" [--prompt "Another" ...] [--chat] [--max-new-tokens 64]
    (the same: python -m r2lm.cli.generate ...)

One prompt streams to the terminal as its blocks are committed; several are decoded as one left-padded batch and
printed when done. Decoding options left out come from the checkpoint's generation_config.json (which
model.generate reads: block size, unmasking rule, sampling, ...). Tokens per denoising step and tokens per second
follow the text, on stderr.

Ctrl-C stops it with status 130, and a closed stdout (`r2lm-generate ... | head -c 1`) with 141, as a shell reports
a command that SIGINT or SIGPIPE stopped, without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch
from transformers import TextStreamer

from r2lm.checkpoints import check_tokenizer, check_weights, load_tokenizer, read_config
from r2lm.device import resolve_device
from r2lm.drafter import Drafter
from r2lm.generation import costs
from r2lm.generation.drafts import DRAFTS
from r2lm.generation.policy import POLICIES
from r2lm.generation.sampling import CONFIDENCES
from r2lm.modeling_r2lm import R2LMForDiffusionLM
from r2lm.ngram import NGramTable
from r2lm.ops.linear import Tuner, install
from r2lm.unmasking import RULES

SHIPPED_DRAFTER = "(shipped)"  # --drafter / --ngram without a folder: what r2lm ships for the model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="r2lm-generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="R2LM checkpoint folder (model + tokenizer)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a left-padded batch")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user message through the tokenizer's chat template")
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    decoding = parser.add_argument_group("decoding (default: the checkpoint's generation_config.json)")
    decoding.add_argument("--max-new-tokens", type=int, help="tokens to generate per prompt (default there: 128)")
    decoding.add_argument("--block-size", type=int, help="tokens decoded in parallel per block")
    rules = decoding.add_mutually_exclusive_group()  # one flag per unmasking rule of the table, as generate() takes
    for name, rule in RULES.items():
        rules.add_argument(f"--{name.replace('_', '-')}", dest=name, type=rule.parse, help=rule.help)
    decoding.add_argument("--confidence", choices=CONFIDENCES, help="how a position's confidence is measured")
    decoding.add_argument("--temperature", type=float, help="0 is greedy; above 0 samples")
    decoding.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    decoding.add_argument("--top-p", type=float, help="sample within this probability mass (nucleus)")
    decoding.add_argument("--seed", type=int, help="seed of the sampler, for a reproducible sampled output")
    decoding.add_argument("--stop", action="append", metavar="TEXT", help="stop a prompt's output at TEXT; repeatable")
    decoding.add_argument("--no-cache", action="store_true", help="recompute everything every step (the exactness oracle)")
    decoding.add_argument("--compile", action="store_true", help="torch.compile the cached decode step")
    products = decoding.add_mutually_exclusive_group()  # the CPU decode speedup, applied from outside the model
    products.add_argument("--linear-decisions", metavar="FILE", type=Path,
                          help="keep the order each few-row matrix product takes on this CPU (r2lm.ops.linear) in "
                               "FILE: loaded when it exists (refused if made on another machine or torch), and saved "
                               "there when this run decided orders it lacked, so later runs compute the same bits and "
                               "measure nothing again")
    products.add_argument("--plain-products", action="store_true",
                          help="multiply as the plain model does (F.linear) instead of in the order measured fastest")
    verify = parser.add_argument_group("lossless verified decoding (the output is the model's own greedy AR text)")
    verify.add_argument("--verify", action="store_true",
                        help="draft --block-size tokens at a time, verify them with the causal pass (greedy only)")
    verify.add_argument("--verify-draft", choices=tuple(DRAFTS),
                        help="what drafts: the diffusion window (default without --drafter), prompt lookup (copies of "
                             "the prompt and the text so far, no drafting window: suits text that repeats itself), the "
                             "drafter, or lookup where the text repeats and the drafter elsewhere (default with "
                             "--drafter), each with the n-gram table beside lookup (default with --ngram)")
    verify.add_argument("--drafter", metavar="DIR", nargs="?", const=SHIPPED_DRAFTER,
                        help="a drafter trained for this checkpoint (train/pretrain.py objective=drafter; its final/); "
                             "--drafter alone: the one r2lm ships for this checkpoint's model (e.g. SmolLM2-135M-"
                             "Instruct). Implies --verify")
    verify.add_argument("--ngram", metavar="DIR", nargs="?", const=SHIPPED_DRAFTER,
                        help="an n-gram table for this checkpoint's vocabulary (python -m r2lm.ngram build): drafts "
                             "that cost no forward, what most often followed the text's last tokens in a corpus; "
                             "--ngram alone: the one r2lm ships for this checkpoint's model. Implies --verify")
    verify.add_argument("--verify-policy", choices=tuple(POLICIES),
                        help="how much each step drafts: adaptive (default: measured acceptance against measured "
                             "cost, never slower than AR by design) or longest (every draft whole)")
    verify.add_argument("--verify-windows", type=int, metavar="W",
                        help="window drafts: pre-draft W of the block_size + 1 ways a verification can end")
    verify.add_argument("--verify-siblings", type=int, metavar="K",
                        help="with a drafter: verify up to K of its next likeliest first tokens beside each draft, "
                             "where the policy finds they pay (default 3; 0: the draft alone)")
    verify.add_argument("--verify-costs", metavar="FILE", type=Path,
                        help="keep what the verification forwards cost on this machine (r2lm.generation.costs, what "
                             "the adaptive policy weighs) in FILE: loaded when it exists (refused if made on another "
                             "machine or torch), and saved there when this run measured costs it lacked, so later "
                             "runs skip the measurement that makes a first verified call slow (seconds on a CPU)")
    return parser


def check_checkpoint(parser: argparse.ArgumentParser, checkpoint: str) -> None:
    """Exit with a usage error (status 2) unless `checkpoint` is an R2LM checkpoint folder with readable weights:
    transformers would take a missing path for a hub repo id and fail with a message about repo ids, and a
    corrupt weights file with a traceback."""
    folder = Path(checkpoint)
    if not folder.is_dir():
        parser.error(f"{checkpoint}: no such checkpoint folder")
    try:
        model_type = read_config(folder).get("model_type")
    except ValueError as err:
        parser.error(str(err))
    if model_type != "r2lm":
        parser.error(f"{checkpoint} is a {model_type!r} checkpoint, not an R2LM one; convert it first "
                     "(r2lm-convert from-hf ...)")
    try:
        check_weights(folder)
    except ValueError as err:
        parser.error(str(err))
    try:
        check_tokenizer(folder)
    except ValueError as err:
        parser.error(str(err))


def check_device(parser: argparse.ArgumentParser, name: str | None) -> torch.device:
    """The --device, one this machine has (torch would fail with an assertion deep in the first copy)."""
    try:
        return resolve_device(name)
    except ValueError as err:
        parser.error(f"--device: {err}")


def decoding_options(args: argparse.Namespace, device: torch.device) -> dict:
    """The model.generate options given on the command line (the others come from generation_config.json)."""
    given = {
        "max_new_tokens": args.max_new_tokens, "block_size": args.block_size, "confidence": args.confidence,
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "stop_strings": args.stop,
        "verify_draft": args.verify_draft, "verify_windows": args.verify_windows,
        "verify_siblings": args.verify_siblings,
        **{name: getattr(args, name) for name in RULES},
    }
    options = {key: value for key, value in given.items() if value is not None}
    if args.seed is not None:
        options["generator"] = torch.Generator(device).manual_seed(args.seed)
    if args.no_cache:
        options["use_cache"] = False
    if args.compile:
        options["compile"] = True
    if args.verify or args.drafter is not None or args.ngram is not None:
        options["verify"] = True
    if args.verify_policy is not None:
        options["verify_policy"] = args.verify_policy
    return options


def encode(tokenizer, prompts: list[str], chat: bool, checkpoint: str):
    """The prompts as a left-padded batch (input_ids, attention_mask); with `chat`, each as a user message in the
    tokenizer's chat template (which adds the special tokens itself)."""
    if chat:
        if not tokenizer.chat_template:
            raise ValueError(f"--chat: the tokenizer of {checkpoint} has no chat template")
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    if len(prompts) > 1 and tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"a batch of prompts is left-padded, but the tokenizer of {checkpoint} has no pad or EOS "
                             "token to pad with; give one --prompt")
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out: which token it is does not matter
    return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)


def generate(args: argparse.Namespace, device: torch.device) -> None:
    tokenizer = load_tokenizer(args.checkpoint, padding_side="left")
    batch = encode(tokenizer, args.prompt, args.chat, args.checkpoint)
    options = decoding_options(args, device)
    model = R2LMForDiffusionLM.from_pretrained(args.checkpoint).to(device).eval()
    if args.drafter == SHIPPED_DRAFTER:
        options["drafter"] = Drafter.shipped(model)
        if options["drafter"] is None:
            raise ValueError(f"r2lm ships no drafter for {args.checkpoint}'s model: give --drafter DIR (train one with "
                             "train/pretrain.py objective=drafter)")
    elif args.drafter:
        options["drafter"] = Drafter.from_pretrained(args.drafter).to(device).eval()
    if args.ngram is not None:
        options["ngram"] = NGramTable.shipped(model) if args.ngram == SHIPPED_DRAFTER else NGramTable.load(args.ngram)
        if options["ngram"] is None:
            raise ValueError(f"r2lm ships no n-gram table for {args.checkpoint}'s model: give --ngram DIR (build one "
                             "with python -m r2lm.ngram build)")
    if args.verify_costs is not None and args.verify_costs.is_file():
        costs.load(args.verify_costs)
    known = costs.kept_tables()
    kept = args.linear_decisions is not None and args.linear_decisions.is_file()
    if not args.plain_products:  # one tuner for the model and its drafter: they share their decisions
        tuner = install(model, Tuner.load(args.linear_decisions) if kept else None)
        if options.get("drafter") is not None:
            install(options["drafter"], tuner)
        decided = tuner.decisions()
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if len(args.prompt) == 1 else None
    measuring = costs.spent()
    start = time.perf_counter()
    out = model.generate(batch.input_ids.to(device), batch.attention_mask.to(device), return_dict_in_generate=True,
                         tokenizer=tokenizer, streamer=streamer, **options)
    seconds = time.perf_counter() - start
    if args.linear_decisions is not None and tuner.decisions() != decided:
        tuner.save(args.linear_decisions)
    if args.verify_costs is not None and costs.kept_tables() != known:
        costs.save(args.verify_costs)
    if streamer is None:
        new = out.sequences[:, batch.input_ids.shape[1]:]
        for prompt, text in zip(args.prompt, tokenizer.batch_decode(new, skip_special_tokens=True), strict=True):
            print(f"{prompt!r} -> {text!r}")
    sys.stdout.flush()
    print(f"[{out.new_tokens} tokens in {seconds:.2f} s: {out.nfe} forwards, {out.tokens_per_step:.2f} tokens per "
          f"denoising step, {out.new_tokens / seconds:.1f} tokens/s]", file=sys.stderr)
    measuring = costs.spent() - measuring
    if args.verify_costs is None and measuring > 0:
        print(f"[{measuring:.2f} s of it measured what verification forwards cost on this machine: --verify-costs "
              "FILE keeps that for later runs, --linear-decisions FILE the product orders]", file=sys.stderr)


def main(argv=None) -> int:
    try:
        return run(argv)
    except KeyboardInterrupt:  # Ctrl-C: what a shell reports for a command SIGINT stopped (128 + 2), no traceback
        return 130
    except BrokenPipeError:
        # stdout was closed (`r2lm-generate ... | head -c 1`). Python's recipe (the signal module's note on SIGPIPE):
        # point stdout at devnull, so that the flush at exit does not fail again, and exit as a command SIGPIPE
        # stopped would (128 + 13)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def run(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_checkpoint(parser, args.checkpoint)
    if args.drafter is not None and not args.drafter.strip():
        parser.error("--drafter was given an empty folder name: give a drafter folder, or --drafter alone for the one "
                     "r2lm ships for this model")
    if args.drafter not in (None, SHIPPED_DRAFTER) and not (Path(args.drafter) / "config.json").is_file():
        parser.error(f"--drafter {args.drafter}: no drafter folder there (no config.json); train one with "
                     "train/pretrain.py objective=drafter")
    if args.ngram is not None and not args.ngram.strip():
        parser.error("--ngram was given an empty folder name: give a table folder, or --ngram alone for the one r2lm "
                     "ships for this model")
    if args.verify_costs is not None and not (args.verify or args.drafter is not None or args.ngram is not None):
        parser.error("--verify-costs keeps what verified decoding measures: pass --verify (or --drafter, --ngram)")
    device = check_device(parser, args.device)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        generate(args, device)
    except ValueError as err:  # a bad option value (generate names it) or prompt, before any forward
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
