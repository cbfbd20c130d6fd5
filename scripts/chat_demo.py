"""Chat with an R2LM converted from a transformers model, several ways, against that original model:

    python scripts/chat_demo.py R2LM_CHECKPOINT --reference SRC [--gguf-file FILE] [--drafter DIR] [--prompt TEXT ...]

- cached parallel decoding (threshold rule): the text, tokens accepted per denoising step;
- verified decoding (verify=True): the window drafts, the causal pass verifies; for a frozen-backbone R2LM the text
  is the original model's own greedy text, token for token (checked against the reference's `generate`);
- the same with prompt-lookup drafts (verify_draft="lookup"): copies of the prompt and the answer so far, verified
  by forwards of the draft's columns alone (checked the same way);
- with --drafter, the same with a drafter trained for the frozen model (r2lm.drafter; verify_draft="lookup+drafter":
  lookup where the answer repeats, the drafter elsewhere; checked the same way);
- AR decoding of the same backbone (block size 1 without sidecars), the speed both are compared with.

The prompts go through the tokenizer's chat template as one left-padded batch. Prints each answer and a table of
generated tokens / s, tokens per forward and the ratio to AR.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from r2lm import R2LMForDiffusionLM, generate
from r2lm.convert.to_hf import without_sidecars

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Give me three tips for sleeping better."]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="R2LM checkpoint folder")
    parser.add_argument("--reference", required=True, help="the transformers checkpoint (folder) it was converted from")
    parser.add_argument("--gguf-file", help="the reference is this GGUF file in --reference")
    parser.add_argument("--prompt", action="append", help=f"a user message (repeatable; default: {len(PROMPTS)} examples)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--block-size", type=int, default=None, help="default: the checkpoint's")
    parser.add_argument("--verify-block-size", type=int, default=4,
                        help="verify=True's draft length (a verification forward reads b * (b + 2) columns)")
    parser.add_argument("--lookup-block-size", type=int, default=4,
                        help="the draft length of verify_draft='lookup' (a verification forward reads b columns)")
    parser.add_argument("--drafter", help="a drafter trained for the model (train/pretrain.py objective=drafter)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = R2LMForDiffusionLM.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    extra = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    reference = AutoModelForCausalLM.from_pretrained(args.reference, **extra).eval()
    chats = [[{"role": "user", "content": p}] for p in (args.prompt or PROMPTS)]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = batch.input_ids, batch.attention_mask
    plain = without_sidecars(model)  # the backbone alone: AR decoding
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    options = dict(max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    block = args.block_size or model.config.block_size
    with torch.no_grad():
        parallel, t_parallel = timed(lambda: generate(model, ids, mask, block_size=block, threshold=args.threshold, **options))
        verified, t_verify = timed(lambda: generate(model, ids, mask, block_size=args.verify_block_size, verify=True,
                                                    **options))
        looked_up, t_lookup = timed(lambda: generate(model, ids, mask, block_size=args.lookup_block_size, verify=True,
                                                     verify_draft="lookup", **options))
        drafted = None
        if args.drafter:
            from r2lm.drafter import Drafter

            drafter = Drafter.from_pretrained(args.drafter).eval()
            drafted, t_drafted = timed(lambda: generate(model, ids, mask, verify=True, drafter=drafter, **options))
        ar, t_ar = timed(lambda: generate(plain, ids, mask, block_size=1, **options))
        own = reference.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)

    def answer(seq, row):
        return tokenizer.decode(seq[row, ids.shape[1] :], skip_special_tokens=True).strip()

    for row, chat in enumerate(chats):
        print(f"\n>>> {chat[0]['content']}")
        print(f"[cached parallel, threshold {args.threshold}] {answer(parallel.sequences, row)}")
        print(f"[verify=True] {answer(verified.sequences, row)}")
    def same(a, b):  # either may stop early, once every row has ended
        width = max(a.shape[1], b.shape[1])
        return torch.equal(*(torch.nn.functional.pad(s, (0, width - s.shape[1]), value=pad) for s in (a, b)))

    rows = [("cached parallel", parallel, t_parallel), ("verify=True", verified, t_verify),
            ("verify=True, lookup", looked_up, t_lookup)]
    if drafted is not None:
        rows.append(("verify=True, drafter", drafted, t_drafted))
    identical = all(same(out.sequences, own) for _, out, _ in rows[1:])
    print(f"\nverify=True output (every draft) identical to the original model's own greedy generate: {identical}")
    print(f"\n{'decoding':<22}{'tokens/s':>10}{'tokens/forward':>16}{'tokens/step':>13}{'vs AR':>8}")
    for name, out, seconds in (*rows, ("AR (backbone)", ar, t_ar)):
        print(f"{name:<22}{out.new_tokens / seconds:>10.1f}{out.tokens_per_forward:>16.2f}{out.tokens_per_step:>13.2f}"
              f"{(out.new_tokens / seconds) / (ar.new_tokens / t_ar):>8.2f}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
