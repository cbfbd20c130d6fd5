"""Generate from an R2LM checkpoint with cached parallel decoding, streaming committed blocks to the terminal.

    python scripts/generate.py CHECKPOINT --prompt "The" [--prompt "Another"] [--max-new-tokens 64] ...
"""

import argparse
import logging
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, TextStreamer

from r2lm import R2LMForDiffusionLM, generate


def check_checkpoint(parser: argparse.ArgumentParser, checkpoint: str) -> None:
    """Exit with a usage error (status 2) unless `checkpoint` is a checkpoint folder: transformers would take a
    missing path for a hub repo id and fail with a message about repo ids."""
    folder = Path(checkpoint)
    if not folder.is_dir():
        parser.error(f"{checkpoint}: no such checkpoint folder")
    if not (folder / "config.json").is_file():
        parser.error(f"{checkpoint} is not a checkpoint folder: it has no config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="R2LM checkpoint folder (model + tokenizer)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, help="default: the model's block_size")
    parser.add_argument("--threshold", type=float, default=0.9, help="confidence threshold for unmasking (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cache", action="store_true", help="recompute everything every step (the exactness oracle)")
    args = parser.parse_args()
    check_checkpoint(parser, args.checkpoint)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    tokenizer.padding_side = "left"
    model = R2LMForDiffusionLM.from_pretrained(args.checkpoint).eval()
    batch = tokenizer(args.prompt, return_tensors="pt", padding=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True) if len(args.prompt) == 1 else None
    start = time.perf_counter()
    out = generate(
        model, batch.input_ids, batch.attention_mask, max_new_tokens=args.max_new_tokens, block_size=args.block_size,
        threshold=args.threshold, temperature=args.temperature, top_p=args.top_p,
        generator=torch.Generator().manual_seed(args.seed), tokenizer=tokenizer, streamer=streamer,
        use_cache=not args.no_cache,
    )
    seconds = time.perf_counter() - start
    if streamer is None:
        for prompt, row in zip(args.prompt, out.sequences[:, batch.input_ids.shape[1] :], strict=True):
            print(f"{prompt!r} -> {tokenizer.decode(row, skip_special_tokens=True)!r}")
    print(
        f"\n[{out.new_tokens} tokens in {seconds:.2f} s: {out.nfe} forwards, {out.tokens_per_step:.2f} tokens per "
        f"denoising step, {out.new_tokens / seconds:.1f} tokens/s]"
    )


if __name__ == "__main__":
    main()
