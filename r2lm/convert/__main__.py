"""Conversion CLI.

    r2lm-convert from-hf SRC DST [--sidecar-layers 3,7,11] [--mask-token TOKEN] [--d-state N] ...
    (the same: python -m r2lm.convert ..., and python -m convert ... in a checkout)

Every command reads SRC without modifying it and writes DST atomically (a temporary folder renamed when
complete, removed if the command fails or is stopped with SIGTERM or Ctrl-C). DST may not be, contain or lie
inside a source, or be a training run or checkpoint folder. An existing DST is refused unless --overwrite is given,
and even then only a folder r2lm wrote (it lists its files with their sha256 in checksums.sha256) or an empty one
is replaced. New weights (sidecars, feature maps) come from --seed: the same command gives the same bits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

import torch

from r2lm.checkpoints import OVERWRITE_HELP
from r2lm.checkpoints.export import export_deepspeed_checkpoint
from r2lm.configuration_r2lm import R2LMConfig
from r2lm.convert.dflash import export_dflash
from r2lm.convert.drafter import export_drafter
from r2lm.convert.from_hf import CHECK_TOLERANCE, convert_from_hf
from r2lm.convert.importers import DEFAULT_BLOCK_SIZE, DREAM_MASK_ID, LLADA2_MASK_ID, LLADA_MASK_ID, import_checkpoint
from r2lm.convert.merge_lora import merge_lora
from r2lm.convert.to_hf import convert_to_hf
from r2lm.convert.to_hybrid import convert_to_hybrid
from r2lm.kind import ATTENTION, PREDICTIONS

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
    p.add_argument("--mask-token-id", type=int, help="use this existing id as [MASK] instead of looking up --mask-token "
                   "(not an EOS or padding id: the model could never generate)")
    p.add_argument("--attention", default=R2LMConfig.attention, choices=list(ATTENTION),
                   help="attention kind (default: %(default)s)")
    p.add_argument("--prediction", default=R2LMConfig.prediction, choices=list(PREDICTIONS),
                   help="which logits predict a token (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=32, help="diffusion block length (default: %(default)s)")
    p.add_argument("--d-state", type=int, default=64, help="sidecar SSM state size (default: %(default)s)")
    p.add_argument("--expand", type=int, default=2, help="sidecar inner size / hidden size (default: %(default)s)")
    p.add_argument("--headdim", type=int, default=64, help="sidecar SSM head size (default: %(default)s)")
    p.add_argument("--ngroups", type=int, default=1, help="sidecar B/C groups (default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=64, help="sidecar SSD chunk length (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: the source's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the new sidecar weights (default: %(default)s)")
    p.add_argument("--gguf-file", help="read the model from this GGUF file in SRC, its name there (llama.cpp's format; "
                   "quantised weights are dequantised by transformers' GGUF loader; needs the gguf package)")
    p.add_argument("--check", action="store_true", help="before writing, run the source model (transformers) and "
                   "the R2LM on a probe text in float32 and report the largest gap in their logits; an error if it "
                   f"exceeds {CHECK_TOLERANCE:g} (closed gates compute what the source computes)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(run=run_from_hf)


def run_from_hf(args) -> None:
    convert_from_hf(
        args.src,
        args.dst,
        sidecar_layers=args.sidecar_layers,
        mask_token=args.mask_token,
        mask_token_id=args.mask_token_id,
        dtype=DTYPES.get(args.dtype),
        overwrite=args.overwrite,
        seed=args.seed,
        gguf_file=args.gguf_file,
        check=args.check,
        attention=args.attention,
        prediction=args.prediction,
        block_size=args.block_size,
        sidecar_d_state=args.d_state,
        sidecar_expand=args.expand,
        sidecar_headdim=args.headdim,
        sidecar_ngroups=args.ngroups,
        sidecar_chunk_size=args.chunk_size,
    )


def add_deepspeed_to_hf(sub) -> None:
    p = sub.add_parser(
        "deepspeed-to-hf",
        help="DeepSpeed ZeRO-1/2/3 training checkpoint -> HF-format R2LM folder",
        description="Verify a DeepSpeed checkpoint written by train/pretrain.py against its checksums.sha256, "
        "reassemble its fp32 weights (any ZeRO stage; CPU only) and save them as an R2LM folder with the config and "
        "tokenizer stored beside the shards. "
        "CKPT: a checkpoint folder (run/checkpoints/step-00000500), a checkpoints folder (newest complete "
        "checkpoint, or --tag) or a run folder.",
    )
    p.add_argument("ckpt", help="checkpoint, checkpoints or run folder")
    p.add_argument("dst", help="output folder (written atomically)")
    p.add_argument("--tag", help="checkpoint tag inside a checkpoints folder (default: the newest complete one)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: the dtype in the saved config)")
    p.add_argument("--model-config", help="folder with config.json (+ tokenizer) for checkpoints that have none beside them")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(run=run_deepspeed_to_hf)


def run_deepspeed_to_hf(args) -> None:
    export_deepspeed_checkpoint(
        args.ckpt, args.dst, tag=args.tag, dtype=DTYPES.get(args.dtype), model_config=args.model_config, overwrite=args.overwrite
    )


def add_to_hybrid(sub) -> None:
    p = sub.add_parser(
        "to-hybrid",
        help="swap chosen layers of an R2LM / block_causal checkpoint to block-hybrid attention",
        description="Give the chosen layers block-hybrid attention: exact softmax inside the active block, Hedgehog "
        "linear attention over committed blocks (their decoding cache is a constant-size state). Train the feature "
        "maps afterwards with attention transfer (train/pretrain.py objective attention_transfer).",
    )
    p.add_argument("src", help="R2LM checkpoint folder (causal or block_causal)")
    p.add_argument("dst", help="output folder (written atomically)")
    p.add_argument("--layers", type=layer_list, required=True, help="layers to convert, e.g. 0,4,8")
    p.add_argument("--feature-dim", type=int, help="Hedgehog feature dim F, at most head_dim (default: 64)")
    p.add_argument("--untied-feature-maps", action="store_true",
                   help="separate query and key feature maps (LoLCATs) instead of one per head (LLaDA-Hybrid)")
    p.add_argument("--seed", type=int, default=0, help="seed of the new feature maps (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(run=run_to_hybrid)


def run_to_hybrid(args) -> None:
    convert_to_hybrid(args.src, args.dst, args.layers, feature_dim=args.feature_dim,
                      tie_feature_maps=not args.untied_feature_maps, overwrite=args.overwrite, seed=args.seed)


def add_to_hf(sub) -> None:
    p = sub.add_parser(
        "to-hf",
        help="causal R2LM checkpoint -> transformers Qwen3 / Qwen2 / Llama checkpoint",
        description="Export the backbone of a causal R2LM checkpoint without hybrid layers as the transformers model "
        "it is (Qwen3 with qk_norm, Qwen2 with q/k/v bias, otherwise Llama); one with sidecars with --drop-sidecars.",
    )
    p.add_argument("src", help="R2LM checkpoint folder")
    p.add_argument("dst", help="output folder (written atomically)")
    p.add_argument("--drop-sidecars", action="store_true",
                   help="export a causal R2LM with sidecars as its backbone: the forward AR and verified decoding run "
                        "(servable by vLLM, llama.cpp, transformers); the window drafts are lost")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(run=run_to_hf)


def run_to_hf(args) -> None:
    convert_to_hf(args.src, args.dst, overwrite=args.overwrite, drop_sidecars=args.drop_sidecars)


def add_merge_lora(sub) -> None:
    p = sub.add_parser(
        "merge-lora",
        help="R2LM checkpoint + peft LoRA adapter -> merged R2LM checkpoint",
        description="Merge a peft LoRA adapter (e.g. the final/ of a train/pretrain.py run with lora.enabled, stage 2 "
        "of hybrid conversion) into the R2LM checkpoint it was trained on, and write a plain R2LM checkpoint. The "
        "adapter is checked against SRC first (target modules, weight names, shapes, rank).",
    )
    p.add_argument("src", help="R2LM checkpoint folder the adapter was trained on")
    p.add_argument("adapter", help="peft adapter folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("dst", help="output folder (written atomically)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: SRC's)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(run=run_merge_lora)


def run_merge_lora(args) -> None:
    merge_lora(args.src, args.adapter, args.dst, dtype=DTYPES.get(args.dtype), overwrite=args.overwrite)


def add_drafter(sub) -> None:
    p = sub.add_parser(
        "drafter",
        help="a trained drafter -> the folder that ships it (its target recorded, --dtype, checksums)",
        description="Write a drafter (a drafter run's final/ or checkpoint) as it ships: for the target MODEL (checked "
        "to have its shapes; its digest recorded, so binding the drafter to another model warns), in --dtype, with "
        "checksums.sha256 over its files.",
    )
    p.add_argument("src", help="drafter folder, or a checkpoint of a train/pretrain.py objective=drafter run")
    p.add_argument("dst", help="output folder (written atomically)")
    p.add_argument("--target", required=True, help="the R2LM checkpoint the drafter drafts for")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="output dtype (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(run=run_drafter)


def run_drafter(args) -> None:
    export_drafter(args.src, args.dst, args.target, dtype=DTYPES[args.dtype], overwrite=args.overwrite)


def add_drafter_to_dflash(sub) -> None:
    p = sub.add_parser(
        "drafter-to-dflash",
        help="a drafter of layout dflash -> the folder vLLM's DFlash speculative method loads",
        description="Write a drafter trained with drafter.layout=dflash as vLLM's DFlash drafter (config.json with "
        "dflash_config, model.safetensors, mask_embedding.pt), for the target MODEL, which vLLM serves as exported by "
        "`r2lm-convert to-hf --drop-sidecars`. A drafter of r2lm's own layout, or made for another target, is refused. "
        "Serve with --speculative-config '{\"method\": \"dflash\", \"model\": DST, \"num_speculative_tokens\": "
        "BLOCK_SIZE - 1}' (scripts/serve.sh does all of it).",
    )
    p.add_argument("src", help="drafter folder, or a checkpoint of a train/pretrain.py objective=drafter run")
    p.add_argument("dst", help="output folder (written atomically)")
    p.add_argument("--target", required=True, help="the R2LM checkpoint the drafter drafts for")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(run=run_drafter_to_dflash)


def run_drafter_to_dflash(args) -> None:
    export_dflash(args.src, args.dst, args.target, overwrite=args.overwrite)


IMPORTERS = {  # layout: (command, help, description) of the importers of pretrained diffusion LMs (importers.py)
    "llada": (
        "from-llada",
        "LLaDA 1 checkpoint (GSAI-ML/LLaDA-8B-*) -> bidirectional, inplace R2LM checkpoint",
        "Import a LLaDA 1 checkpoint folder (OLMo-style config.json with d_model / n_heads / n_layers ..., "
        "safetensors with model.transformer.{wte, blocks.N.*, ln_f, ff_out}, tokenizer if present) as an R2LM "
        "checkpoint with attention=bidirectional and prediction=inplace (the [MASK] at i predicts token i). "
        "The vocabulary is embedding_size (wte's padded row count). Bidirectional models take no sidecars.",
    ),
    "dream": (
        "from-dream",
        "Dream checkpoint (Dream-org/Dream-v0-*) -> bidirectional, shift R2LM checkpoint",
        "Import a Dream checkpoint folder (Qwen2 layout with q/k/v bias, model_type 'Dream') as an R2LM "
        "checkpoint with attention=bidirectional and prediction=shift (the hidden state at i-1 predicts token i, "
        "as Dream's sampler shifts its logits). Bidirectional models take no sidecars.",
    ),
    "llada2": (
        "from-llada2",
        "dense LLaDA 2.x checkpoint -> block_causal, inplace R2LM checkpoint (MoE layers not supported)",
        "Import a LLaDA 2.x checkpoint folder (model.word_embeddings, fused attention.query_key_value with "
        "query/key_layernorm, partial RoPE, model.norm, lm_head) as an R2LM checkpoint with "
        "attention=block_causal and prediction=inplace. Only dense checkpoints import: MoE layers "
        "(num_experts set and first_k_dense_replace < num_hidden_layers; mlp.gate / mlp.experts / "
        "mlp.shared_experts) are NOT supported by r2lm and are refused, e.g. LLaDA2.x-mini/flash.",
    ),
}
IMPORTED_MASK = {"llada": LLADA_MASK_ID, "dream": DREAM_MASK_ID, "llada2": LLADA2_MASK_ID}


def add_importers(sub) -> None:
    """from-llada, from-dream, from-llada2: pretrained diffusion-LM checkpoints -> R2LM (convert/importers.py)."""
    for layout, (command, help_text, description) in IMPORTERS.items():
        p = sub.add_parser(command, help=help_text, description=description)
        p.add_argument("src", help="source checkpoint folder (read only)")
        p.add_argument("dst", help="output folder (written atomically)")
        p.add_argument("--mask-token-id", type=int,
                       help=f"[MASK] id (default: the config's mask_token_id, else {IMPORTED_MASK[layout]})")
        p.add_argument("--block-size", type=int,
                       help=f"diffusion block length for training and decoding (default: the config's block_size, else {DEFAULT_BLOCK_SIZE})")
        if layout == "llada2":
            p.add_argument("--sidecar-layers", type=layer_list, default=[],
                           help="layers that get a zero-gated reverse Mamba sidecar, e.g. 3,7,11")
            p.add_argument("--d-state", type=int, default=64, help="sidecar SSM state size (default: %(default)s)")
            p.add_argument("--expand", type=int, default=2, help="sidecar inner size / hidden size (default: %(default)s)")
            p.add_argument("--headdim", type=int, default=64, help="sidecar SSM head size (default: %(default)s)")
            p.add_argument("--ngroups", type=int, default=1, help="sidecar B/C groups (default: %(default)s)")
            p.add_argument("--chunk-size", type=int, default=64, help="sidecar SSD chunk length (default: %(default)s)")
            p.add_argument("--seed", type=int, default=0, help="seed of the new sidecar weights (default: %(default)s)")
        p.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: the stored weights')")
        p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
        p.set_defaults(run=run_importer(layout))


def run_importer(layout: str):
    def run(args: argparse.Namespace) -> None:
        sidecar = {}
        if layout == "llada2":
            sidecar = dict(
                sidecar_layers=args.sidecar_layers, sidecar_d_state=args.d_state, sidecar_expand=args.expand,
                sidecar_headdim=args.headdim, sidecar_ngroups=args.ngroups, sidecar_chunk_size=args.chunk_size,
                seed=args.seed,
            )
        import_checkpoint(
            layout, args.src, args.dst, mask_token_id=args.mask_token_id, block_size=args.block_size,
            dtype=DTYPES.get(args.dtype), overwrite=args.overwrite, **sidecar,
        )

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="r2lm-convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_from_hf(sub)
    add_deepspeed_to_hf(sub)
    add_to_hybrid(sub)
    add_to_hf(sub)
    add_merge_lora(sub)
    add_drafter(sub)
    add_drafter_to_dflash(sub)
    add_importers(sub)
    return parser


class Terminated(BaseException):
    """SIGTERM (sent by timeout, Slurm, docker stop) as an exception, so that the atomic writer removes its
    temporary folder before the process ends; a BaseException, as KeyboardInterrupt, so that no handler eats it."""


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    handle_sigterm = threading.current_thread() is threading.main_thread()  # Python runs handlers only there
    if handle_sigterm:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        args.run(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Terminated:
        print("error: terminated by SIGTERM; temporary files removed", file=sys.stderr)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # end as a SIGTERM-killed process does, for the shell or scheduler
        return 128 + signal.SIGTERM
    finally:
        if handle_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
