"""Continued pretraining of an R2LM checkpoint with DeepSpeed (docs/design.md section 3).

    deepspeed --num_gpus 8 train/pretrain.py --config configs/train/NAME.yaml [key=value ...]
    torchrun --nproc_per_node 8 train/pretrain.py --config ...
    python train/pretrain.py --config ...                  (one process)
    scripts/launch_multinode.sh HOSTFILE --config ...       (several nodes)

Overrides use dotted keys for nesting and YAML scalars for values: `lr=3e-4 data.streaming=true stop_at=100`.
The DeepSpeed JSON (`deepspeed=`) chooses the ZeRO stage and communication settings; batch sizes, gradient
clipping, precision, the optimizer (torch AdamW: nothing to compile) and the warmup + cosine schedule come from
the training config, so one YAML describes the run.

Run folder (`output_dir`): run.lock (one run at a time, train/lock.py), config.yaml (resolved config), train.log,
metrics.jsonl (one line per step and per evaluation), wandb/, checkpoints/step-N/ (complete DeepSpeed checkpoints
with a checksum manifest, see r2lm/checkpoints/training.py) and final/ (HF-format R2LM folder written at the end).
Nothing is written there before the config and the data pass their checks. With resume=auto a rerun continues
from the newest intact checkpoint and reproduces the uninterrupted run's losses exactly (same world size, settings
and data files: check_resume; a checkpoint without its manifest, or data changed since, only when asked for with
resume_unverified / resume_data_changed). A loss or gradient that becomes NaN or infinite stops the run, naming the
last checkpoint saved before the divergence (train/guard.py), which keep_checkpoints never prunes.

Block-hybrid conversion runs in two stages of this program: objective=attention_transfer (stage 1,
train/transfer.py: only feature maps and gates train; attention_transfer.json reports the held-out per-layer MSE
before and after) and lora.enabled=true (stage 2, train/lora.py: peft LoRA under the block loss; final/ is then
the adapter, merged with python -m convert merge-lora).

Certainty forcing (objective=certainty, r2lm.diffusion) trains for parallel decoding on a teacher's continuations
(train/teacher_data.py writes them as a jsonl dataset for data.train); metrics.jsonl and wandb get its parts: ce,
entropy and right_fraction (masked tokens whose argmax is already the target), and eval_* of each.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # the deepspeed and torchrun launchers run a file, whose folder is train/, not a
    sys.path.insert(0, str(REPO))  # module: the repository becomes importable (python -m train.pretrain needs none)

from train.checks import check_export, validate  # noqa: E402  (light: no torch import)
from train.config import TrainConfig, keys_help, load_config  # noqa: E402
from train.distributed import init_distributed, rank0_decides, setup_environment, setup_logging  # noqa: E402
from train.guard import NonFiniteLossError  # noqa: E402
from train.trainer import Result, run  # noqa: E402

logger = logging.getLogger("train.pretrain")


def train(cfg: TrainConfig) -> Result:
    """Run (or continue) the training described by `cfg`; collective across ranks."""
    rank, local_rank, world = setup_environment()
    setup_logging(rank, None)
    plan = validate(cfg)  # bad input stops here, before the process group, the data or the model

    from deepspeed import comm as dist

    from train.lock import RunLock

    init_distributed(rank, world)
    # one run per output_dir: rank 0 holds the lock for the run's ranks; a refused run stops on every rank
    lock = rank0_decides(lambda: RunLock(cfg.output_dir), rank, dist, share=False)
    try:
        if cfg.export:  # now, not after the training (rank 0: it hashes final/'s files)
            rank0_decides(lambda: check_export(cfg), rank, dist)
        return run(cfg, plan, rank, local_rank, world, dist, lock)
    finally:
        if lock is not None:
            lock.release()


# ---------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train/pretrain.py", description=__doc__, epilog=keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="training config YAML (configs/train/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. lr=3e-4 data.train=corpus.txt")
    # the deepspeed launcher passes --local_rank; the value is also in the LOCAL_RANK environment variable
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        train(cfg)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        logger.error("%s", err)
        print(f"error: {err}", file=sys.stderr)
        return 3
    finally:
        end_process_group()
    return 0


def end_process_group() -> None:
    """Destroy the process group before the interpreter ends: left to interpreter shutdown, gloo's worker threads
    can still hold work whose release needs the GIL, and the rank aborts after a finished run ("terminate called
    without an active exception", exit 250; seen in a launcher test, pytorch/pytorch#190489). At the end of the
    script, not of train(): an in-process caller keeps its group."""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
