"""Chat with an R2LM converted from a transformers model, several ways, against that original model:

    python scripts/chat_demo.py R2LM_CHECKPOINT --reference SRC [--gguf-file FILE] [--drafter DIR] [--prompt TEXT ...]

- cached parallel decoding (threshold rule): the text, tokens accepted per denoising step (lossy);
- verified decoding (verify=True), whose text is the original model's own greedy text, token for token (checked
  against the reference's `generate`), drafted
    - by the R2LM's own diffusion window,
    - by prompt lookup (copies of the prompt and the answer so far),
    - by lookup and the n-gram table r2lm ships for this model (r2lm/ngrams/, when it ships one: SmolLM2-135M-
      Instruct's; what most often followed the last tokens in ShareGPT's training replies),
    - by the drafter r2lm ships for this model (r2lm/drafters/) beside lookup, and beside lookup and the table,
    - by --drafter (e.g. the quickstart's own, trained for a few minutes);
  each with the default policy (r2lm.generation.policy: it drafts only where measured acceptance pays for the
  measured cost of verifying, so no line should be slower than AR);
- AR decoding of the same backbone (block size 1 without sidecars), the speed every line is compared with.

Each prompt is answered alone (a chat answers one user at a time) through the tokenizer's chat template; every
decoder is warmed up once before it is timed, then timed over --passes passes, the decoders in another order for each
prompt of each pass, each prompt's fastest decode counting (as eval/lossless_bench.py counts tokens/s); after the first
pass, only the lines within 2x of AR's speed either way are timed again (noise cannot carry the others across AR's;
a shared machine's first pass can run markedly slower than its second, AR's included, and a narrow band then froze
lines at their first pass's figures: docs/results.md, "The chat demo's passes"). Prints the answers, then a table
of tokens/s, tokens per forward and the ratio to AR.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from r2lm import R2LMForDiffusionLM, generate
from r2lm.convert.gguf import reading_gguf
from r2lm.convert.to_hf import without_sidecars
from r2lm.drafter import Drafter
from r2lm.ngram import NGramTable
from r2lm.ops.linear import install

AR = "AR (backbone)"
FAR = 2.0  # a line this many times faster or slower than AR after a pass is not timed again
PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Give me three tips for sleeping better."]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="R2LM checkpoint folder")
    parser.add_argument("--reference", required=True, help="the transformers checkpoint (folder) it was converted from")
    parser.add_argument("--gguf-file", help="the reference is this GGUF file in --reference")
    parser.add_argument("--prompt", action="append", help=f"a user message (repeatable; default: {len(PROMPTS)} examples)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=2,
                        help="timed passes over the prompts, the decoders in another order for each prompt of each "
                             f"pass (each prompt's fastest decode counts; after the first, only lines within {FAR}x "
                             "of AR's speed)")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--block-size", type=int, default=None, help="parallel decoding's block (default: the checkpoint's)")
    parser.add_argument("--verify-block-size", type=int, default=4,
                        help="window and lookup drafts' length (a drafter drafts its own)")
    parser.add_argument("--drafter", help="a drafter trained for the model (train/pretrain.py objective=drafter), "
                        "shown beside the one r2lm ships")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.passes < 1:
        parser.error(f"--passes must be at least 1, got {args.passes}")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = R2LMForDiffusionLM.from_pretrained(args.model).eval()
    tuner = install(model)  # the CPU decode speedup, applied from outside (r2lm.ops.linear); shared by the drafters
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    extra = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    with reading_gguf():  # a GGUF file parsed once, not twice
        reference = AutoModelForCausalLM.from_pretrained(args.reference, **extra).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    options = dict(max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    b = args.verify_block_size
    decoders = {"cached parallel": (model, dict(block_size=args.block_size or model.config.block_size,
                                                threshold=args.threshold)),
                "verify, window": (model, dict(verify=True, block_size=b)),
                "verify, lookup": (model, dict(verify=True, verify_draft="lookup", block_size=b))}
    table = NGramTable.shipped(model)
    if table is not None:
        decoders["verify, lookup + shipped table"] = (model, dict(verify=True, ngram=table, block_size=b))
    shipped = Drafter.shipped(model)
    if shipped is not None:
        install(shipped, tuner)
        decoders["verify, shipped drafter"] = (model, dict(verify=True, drafter=shipped))
        if table is not None:
            decoders["verify, shipped drafter + table"] = (model, dict(verify=True, drafter=shipped, ngram=table))
    if args.drafter:
        drafter = Drafter.from_pretrained(args.drafter).eval()
        install(drafter, tuner)
        decoders["verify, --drafter"] = (model, dict(verify=True, drafter=drafter))
    decoders[AR] = (without_sidecars(model), dict(block_size=1))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in (args.prompt or PROMPTS)]
    inputs = [tokenizer(p, return_tensors="pt", add_special_tokens=False).input_ids for p in prompts]
    with torch.no_grad():
        for m, o in decoders.values():  # warm-up: first-use measurements (product orders, verification costs)
            generate(m, inputs[0], **{**options, "max_new_tokens": 8}, **o)
        # interleaved a prompt at a time (a load that comes and goes hits every line alike), each prompt of each
        # pass in another order, and each prompt's fastest decode counts: a shared machine's noise only adds time
        results = {name: [None] * len(inputs) for name in decoders}
        times = {name: [[] for _ in inputs] for name in decoders}

        def speed(name):  # tokens/s, each prompt's fastest decode counting
            return sum(o.new_tokens for o in results[name]) / sum(map(min, times[name]))

        names = list(decoders)
        for repeat in range(args.passes):
            if repeat:  # a line this far from AR's speed is not timed again: a few % of noise cannot carry it across
                names = [n for n in names if n == AR or 1 / FAR < speed(n) / speed(AR) < FAR]
            for i, ids in enumerate(inputs):
                turn = (repeat * len(inputs) + i) % len(names)
                for name in names[turn:] + names[:turn]:
                    m, o = decoders[name]
                    start = time.perf_counter()
                    results[name][i] = generate(m, ids, **options, **o)
                    times[name][i].append(time.perf_counter() - start)
        own = [reference.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=pad) for ids in inputs]

    def answer(out, ids):
        return tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True).strip()

    for i, (ids, text) in enumerate(zip(inputs, args.prompt or PROMPTS, strict=True)):
        print(f"\n>>> {text}")
        print(f"[cached parallel, threshold {args.threshold}] {answer(results['cached parallel'][i], ids)}")
        print(f"[verify=True: the original model's own text] {answer(results['verify, lookup'][i], ids)}")

    def same(a, b):  # either may stop early, once the row has ended
        width = max(a.shape[1], b.shape[1])
        return torch.equal(*(torch.nn.functional.pad(s, (0, width - s.shape[1]), value=pad) for s in (a, b)))

    verified = [name for name in decoders if name.startswith("verify")]
    identical = all(same(results[name][i].sequences, own[i]) for name in verified for i in range(len(inputs)))
    print(f"\nverify=True output (every draft source) identical to the original model's own greedy generate: {identical}")
    width = max(map(len, decoders)) + 2
    print(f"\n{'decoding':<{width}}{'tokens/s':>10}{'tokens/forward':>16}{'vs AR':>8}")
    for name, outs in results.items():
        tokens, forwards = sum(o.new_tokens for o in outs), sum(o.nfe for o in outs)
        print(f"{name:<{width}}{speed(name):>10.1f}{tokens / max(forwards, 1):>16.2f}{speed(name) / speed(AR):>8.2f}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
