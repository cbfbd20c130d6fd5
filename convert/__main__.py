"""Conversion CLI.

    python -m convert from-hf SRC DST [--sidecar-layers 3,7,11] [--mask-token TOKEN] [--d-state N] ...

Every command reads SRC without modifying it and writes DST atomically (a temporary folder renamed when
complete), refusing an existing DST unless --overwrite is given.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layer_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices like 3,7,11, got {text!r}") from None


def add_from_hf(sub) -> None:
    p = sub.add_parser(
        "from-hf",
        help="transformers Qwen3 / Qwen2 / Llama checkpoint -> R2LM checkpoint",
        description="Convert a transformers Qwen3, Qwen2 or Llama checkpoint folder (config.json, safetensors, "
        "tokenizer if present) into an R2LM checkpoint loadable with R2LMForDiffusionLM.from_pretrained. "
        "Sidecars start with zero gates, so the result computes exactly what the source did.",
    )
    p.add_argument("src", help="source checkpoint folder")
    p.add_argument("dst", help="output folder (written atomically)")
    p.add_argument("--sidecar-layers", type=layer_list, default=[], help="layers that get a reverse Mamba sidecar, e.g. 3,7,11")
    p.add_argument("--mask-token", default="<|mask|>", help="[MASK] token text; added to the tokenizer if missing (default: %(default)s)")
    p.add_argument("--mask-token-id", type=int, help="use this existing id as [MASK] instead of looking up --mask-token")
    p.add_argument("--attention", default="causal", choices=["causal", "block_causal", "bidirectional"], help="attention kind (default: %(default)s)")
    p.add_argument("--prediction", default="shift", choices=["shift", "inplace"], help="which logits predict a token (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=32, help="diffusion block length (default: %(default)s)")
    p.add_argument("--d-state", type=int, default=64, help="sidecar SSM state size (default: %(default)s)")
    p.add_argument("--expand", type=int, default=2, help="sidecar inner size / hidden size (default: %(default)s)")
    p.add_argument("--headdim", type=int, default=64, help="sidecar SSM head size (default: %(default)s)")
    p.add_argument("--ngroups", type=int, default=1, help="sidecar B/C groups (default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=64, help="sidecar SSD chunk length (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: the source's)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.set_defaults(run=run_from_hf)


def run_from_hf(args) -> None:
    from convert.from_hf import convert_from_hf

    convert_from_hf(
        args.src,
        args.dst,
        sidecar_layers=args.sidecar_layers,
        mask_token=args.mask_token,
        mask_token_id=args.mask_token_id,
        dtype=DTYPES.get(args.dtype),
        overwrite=args.overwrite,
        attention=args.attention,
        prediction=args.prediction,
        block_size=args.block_size,
        sidecar_d_state=args.d_state,
        sidecar_expand=args.expand,
        sidecar_headdim=args.headdim,
        sidecar_ngroups=args.ngroups,
        sidecar_chunk_size=args.chunk_size,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_from_hf(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        args.run(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
