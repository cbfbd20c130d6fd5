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
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # the deepspeed and torchrun launchers run a file, whose folder is train/, not a
    sys.path.insert(0, str(REPO))  # module: the repository becomes importable (python -m train.pretrain needs none)

from train.config import TrainConfig, keys_help, load_config  # noqa: E402  (light: no torch import)
from train.distributed import init_distributed, rank0_decides, setup_environment  # noqa: E402
from train.guard import DivergenceGuard, NonFiniteLossError  # noqa: E402

logger = logging.getLogger("train.pretrain")


# ---------------------------------------------------------------------------------------------- environment


def setup_logging(rank: int, run_dir: Path | None) -> None:
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if not any(getattr(h, "_r2lm", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(fmt)
        handler._r2lm = True
        root.addHandler(handler)
    for handler in [h for h in root.handlers if getattr(h, "_r2lm_file", None)]:  # an earlier in-process run's
        root.removeHandler(handler)
        handler.close()
    if run_dir is not None and rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(run_dir / "train.log")
        file_handler.setFormatter(fmt)
        file_handler._r2lm_file = str(run_dir)
        root.addHandler(file_handler)
    for noisy in ("deepspeed", "DeepSpeed", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# ---------------------------------------------------------------------------------------------- checks


@dataclass
class Plan:
    """Everything validate() resolved: the run can start."""

    model_config: object
    tokenizer: object
    ds_config: dict
    resume_candidates: list[Path]  # newest first; the run continues from the first intact one (none: a fresh run)
    source_dtype: str
    objective: object  # train/objectives.py: what this run trains, on what, and how it exports


def resolve_path(value: str) -> Path:
    path = Path(value).expanduser()
    if path.is_absolute() or path.exists():
        return path
    return REPO / path if (REPO / path).exists() else path


def read_deepspeed_config(cfg: TrainConfig, use_bf16: bool) -> dict:
    path = resolve_path(cfg.deepspeed)
    if not path.is_file():
        raise ValueError(f"DeepSpeed config {cfg.deepspeed} does not exist")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {err}") from None
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ValueError(f"DeepSpeed config {path} has an {key!r} section: the optimizer and the LR schedule come "
                             "from the training config (lr, warmup_steps, ...); remove it")
    if ds.get("fp16", {}).get("enabled"):
        raise ValueError(f"DeepSpeed config {path} enables fp16, which diffusion losses overflow; use precision=bf16")
    batch = {"train_micro_batch_size_per_gpu": cfg.micro_batch_size, "gradient_accumulation_steps": cfg.grad_accum,
             "gradient_clipping": cfg.grad_clip}
    for key, value in batch.items():
        if key in ds and ds[key] != value:
            raise ValueError(f"DeepSpeed config {path} sets {key}={ds[key]} but the training config gives {value}; "
                             "set it in the training config only")
    ds.pop("train_batch_size", None)  # DeepSpeed derives it from the two above and the world size
    ds.update(batch)
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": use_bf16}
    ds["fp16"] = {"enabled": False}
    ds.setdefault("steps_per_print", 10**9)  # progress is ours (tqdm + logging)
    return ds


def validate(cfg: TrainConfig) -> Plan:
    """Every check that needs no process group: bad input fails here, before any work starts (ValueError)."""
    import torch
    from transformers import AutoTokenizer

    from r2lm import R2LMConfig
    from r2lm.checkpoints import DamagedCheckpointError, check_weights
    from train.data import resolve_source
    from train.objectives import objective_of

    model_dir = resolve_path(cfg.model)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model {cfg.model} is not a checkpoint folder (no config.json); convert one with "
                         "python -m convert from-hf")
    try:
        config = R2LMConfig.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"model {cfg.model}: cannot read an R2LM config: {err}") from err
    if getattr(config, "model_type", None) != "r2lm":
        raise ValueError(f"model {cfg.model} is a {config.model_type!r} checkpoint; convert it with python -m convert from-hf")
    check_output_dir(cfg, model_dir)
    check_weights(model_dir)  # a missing or truncated weights file: named now, not by a traceback in from_pretrained
    if cfg.seq_len > config.max_position_embeddings:
        raise ValueError(f"seq_len {cfg.seq_len} is above the model's max_position_embeddings {config.max_position_embeddings}")
    objective = objective_of(cfg)
    objective.check(config)
    if cfg.lora.enabled:
        from train.lora import check_lora

        check_lora(cfg, config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"model {cfg.model} has no usable tokenizer: {err}") from err
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model only {config.vocab_size} embeddings")

    resolve_source(cfg.data.train, cfg.data.format, "data.train")
    if cfg.data.heldout is not None:
        resolve_source(cfg.data.heldout, cfg.data.format, "data.heldout")
    if cfg.precision == "bf16" and not torch.cuda.is_available():
        logger.warning("precision=bf16 on CPU: DeepSpeed supports it, but it is slow; precision=auto is fp32 here")
    use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and torch.cuda.is_available())
    ds_config = read_deepspeed_config(cfg, use_bf16)

    candidates = resume_candidates(cfg)
    for candidate in candidates:  # the newest whose trainer state reads; choose_checkpoint verifies it in full
        try:
            check_resume(cfg, candidate)
            break
        except DamagedCheckpointError:
            continue
    source_dtype = str(config.dtype).removeprefix("torch.") if config.dtype else "float32"
    return Plan(config, tokenizer, ds_config, candidates, source_dtype, objective)


RUN_FILES = ("config.yaml", "metrics.jsonl", "train.log", "checkpoints", "final", "wandb", "wandb_run_id")


def check_output_dir(cfg: TrainConfig, model_dir: Path) -> None:
    """A run writes RUN_FILES into output_dir and replaces final/ at the end: refuse an output_dir that would
    overwrite the model it trains, or files that are not a run's (a folder that never held a run has no lock file)."""
    from train.lock import LOCK_FILE

    out, model = Path(cfg.output_dir).resolve(), model_dir.resolve()
    for folder in (out / "final", out / "checkpoints"):
        if model == folder or folder in model.parents:
            raise ValueError(f"model {cfg.model} lies in {folder}, which this run (output_dir={cfg.output_dir}) "
                             "writes: copy the model elsewhere first, or choose another output_dir")
    if out == model or model in out.parents:
        raise ValueError(f"output_dir {cfg.output_dir} is (inside) the model folder {cfg.model}: choose another")
    if out.is_dir() and not (out / LOCK_FILE).exists():
        taken = [name for name in RUN_FILES if (out / name).exists()]
        if taken:
            raise ValueError(f"output_dir {cfg.output_dir} is not a training run's folder (no {LOCK_FILE}) but holds "
                             f"{', '.join(taken)}, which a run writes: move them, or choose another output_dir")


def check_export(cfg: TrainConfig) -> None:
    """The export replaces only an earlier export of a run (output_dir/final, unedited: its manifest's sha256)."""
    from r2lm.checkpoints import check_replaceable

    try:
        check_replaceable(Path(cfg.output_dir) / "final", overwrite=True)
    except ValueError as err:
        raise ValueError(f"export: {err}") from None


def resume_candidates(cfg: TrainConfig) -> list[Path]:
    """The checkpoints `cfg.resume` allows this run to continue from, newest first."""
    from r2lm.checkpoints import complete_checkpoints, read_state

    ckpt_root = Path(cfg.output_dir) / "checkpoints"
    if cfg.resume == "auto":
        return [path for _, path in reversed(complete_checkpoints(ckpt_root))]
    if cfg.resume == "never":
        if complete_checkpoints(ckpt_root):
            raise ValueError(f"{ckpt_root} already holds checkpoints and resume=never: use resume=auto to continue "
                             "that run, or a new output_dir")
        return []
    read_state(cfg.resume)  # raises when it is not a complete checkpoint
    return [Path(cfg.resume)]


def check_resume(cfg: TrainConfig, checkpoint: Path) -> None:
    """Refuse to continue `checkpoint` with settings that exact resume cannot honour (ValueError): another world
    size, another model, or a changed setting that the optimizer, schedule, data or noise state depends on (the
    checkpoint's state would silently win over the new value). Settings that do not change what is computed
    (logging, evaluation and checkpoint frequency, export ...: `resume_may_change` in train/config.py) may change.
    Also refused unless asked for: a checkpoint without a manifest (its files cannot be verified) and data files
    that changed since the checkpoint (the batches replayed are a function of the data)."""
    from r2lm.checkpoints import MANIFEST, read_manifest, read_state
    from train.config import resume_conflicts

    state = read_state(checkpoint)
    if read_manifest(checkpoint) is None and not cfg.resume_unverified:
        raise ValueError(
            f"checkpoint {checkpoint} has no {MANIFEST} (deleted, or written by an r2lm before manifests), so its "
            f"files cannot be checked against what was saved: restore {checkpoint / MANIFEST}, or give "
            "resume_unverified=true to resume from it unchecked"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if state["world_size"] != world:
        raise ValueError(
            f"checkpoint {checkpoint} was written by {state['world_size']} ranks but this run has {world}: exact "
            "resume needs the same world size (export it with python -m convert deepspeed-to-hf and start a new run)"
        )
    exported = (Path(cfg.output_dir) / "final" / "config.json").is_file()
    if state["step"] > cfg.steps or (state["step"] == cfg.steps and (exported or not cfg.export)):
        raise ValueError(f"checkpoint {checkpoint} is at step {state['step']}, the run has steps={cfg.steps}"
                         f"{' and is exported' if exported else ''}: nothing to do")
    # A finished run whose export did not happen (killed while exporting) resumes to export and nothing else.
    old = state["config"]
    old_model = Path(state.get("model_path") or resolve_path(old["model"]).resolve())
    if old_model != resolve_path(cfg.model).resolve():
        raise ValueError(
            f"checkpoint {checkpoint} continues a run of model {old['model']} ({old_model}), but this run has "
            f"model={cfg.model}: give model={old['model']} to continue it, or a new output_dir to train {cfg.model}"
        )
    conflicts = [(key, a, b) for key, a, b in resume_conflicts(old, cfg) if key != "model"]  # compared as a path above
    if ("steps", old["steps"], cfg.steps) in conflicts and schedule_so_far_unchanged(cfg, old["steps"], state["step"]):
        conflicts.remove(("steps", old["steps"], cfg.steps))
    if conflicts:
        changes = "; ".join(f"{key}: {a!r} in the checkpoint, {b!r} now" for key, a, b in conflicts)
        if any(key == "steps" for key, _, _ in conflicts):
            changes += (" (steps sets the cosine decay, so it would change the learning rate of the steps already "
                        "done; it may change only while the run is in warmup, or with min_lr_ratio=1)")
        raise ValueError(
            f"checkpoint {checkpoint} was saved with other settings, and exact resume continues its optimizer, "
            f"schedule, data order and noise as they were: {changes}. Give the checkpoint's values to continue that "
            "run, or use a new output_dir for a run with the new settings (python -m convert deepspeed-to-hf exports "
            "the checkpoint as a model to start it from)"
        )
    changes = data_changes_since(cfg, state)
    if changes and not cfg.resume_data_changed:
        raise ValueError(
            f"checkpoint {checkpoint} was saved with other data: {'; '.join(changes)}. Exact resume replays the "
            "batches the run would have read from the data as it was: restore it, or give resume_data_changed=true "
            f"to continue on the data as it is now (or start a new run in a new output_dir from python -m convert "
            f"deepspeed-to-hf {checkpoint} DST)"
        )


def data_sources(cfg: TrainConfig) -> dict[str, list[str]]:
    """{"data.train": files, "data.heldout": files} of the local data (a hub dataset has no files to record)."""
    from train.data import resolve_source

    sources = {}
    for what, spec in (("data.train", cfg.data.train), ("data.heldout", cfg.data.heldout)):
        if spec is not None:
            sources[what] = resolve_source(spec, cfg.data.format, what).files or []
    return sources


def data_record(cfg: TrainConfig, known: dict | None) -> dict:
    """The fingerprints of the data files that a checkpoint records (`known`: an earlier record, not read again)."""
    from train.data import fingerprint

    return {what: fingerprint(files, (known or {}).get(what)) for what, files in data_sources(cfg).items()}


def data_changes_since(cfg: TrainConfig, state: dict) -> list[str]:
    """How the data files differ from those a checkpoint's trainer state recorded (none recorded: none known)."""
    from train.data import data_changes

    recorded = state.get("data_files")
    if recorded is None:  # a checkpoint of an older r2lm
        return []
    return [f"{what} file {change}" for what, files in data_sources(cfg).items()
            for change in data_changes(recorded.get(what, {}), files)]


def schedule_so_far_unchanged(cfg: TrainConfig, old_steps: int, done: int) -> bool:
    """Whether the learning rates of the `done` steps taken and of the next one are the same under the run's old
    `steps` (the other schedule settings cannot have changed): then extending or shortening the run is exact."""
    import dataclasses

    old = dataclasses.replace(cfg, steps=old_steps)
    return all(lr_factor(step, old) == lr_factor(step, cfg) for step in range(done + 1))


# ---------------------------------------------------------------------------------------------- pieces


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr for optimizer step `step` (0-based): linear warmup, then cosine to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def noise_seed(*parts: int) -> int:
    """A generator seed from integers (seed, step, micro-step, rank): the noise is replayed exactly on resume."""
    import hashlib

    digest = hashlib.sha256("/".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def param_groups(model, weight_decay: float):
    """Trainable parameters; decay only matrices (norm weights, biases, gates and SSM A_log/D/dt_bias are 1-d)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # ZeRO drops empty groups, and the LR schedule must match its count


def build_engine(cfg: TrainConfig, plan: Plan, model_dir: Path):
    import deepspeed
    import torch

    model = plan.objective.module(model_dir, plan)
    if cfg.gradient_checkpointing:  # transformers 5 renamed it; keep working with either name
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    if cfg.lora.enabled:
        from train.lora import wrap

        model = wrap(model, cfg.lora)
    model.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("model %s: %.2fM parameters, %d trainable (%.3g%%)", model_dir, total / 1e6, trainable, 100 * trainable / total)
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
        fused=torch.cuda.is_available(),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=plan.ds_config)
    return engine


def evaluate(engine, data, cfg: TrainConfig, objective, model_config, rank: int, dist) -> dict:
    """The objective's loss on the held-out set with fixed noise, and its named parts (certainty: ce, entropy,
    right_fraction; attention transfer: each hybrid layer's MSE, `eval_mse_layer_N`): token-weighted over all
    ranks' batches."""
    import torch

    totals = torch.zeros(2, dtype=torch.float64, device=engine.device)
    parts: dict = {}
    engine.eval()
    with torch.no_grad():
        for k, indices, weight in data.heldout.plan(rank):
            batch = data.heldout.batch(indices)
            generator = torch.Generator(device=engine.device).manual_seed(noise_seed(cfg.eval_seed, k, rank))
            out = objective.loss(engine, batch, generator, model_config)
            tokens = float(out.tokens)
            totals += torch.tensor([float(out.loss) * tokens * weight, tokens * weight],
                                   dtype=torch.float64, device=engine.device)
            for name, value in out.metrics().items():
                parts[name] = parts.get(name, 0) + value.detach().to(torch.float64) * tokens * weight
    engine.train()
    dist.all_reduce(totals)
    record = {"eval_loss": float(totals[0] / totals[1]), "eval_tokens": int(totals[1])}
    for name in sorted(parts):
        dist.all_reduce(parts[name])
        record[f"eval_{name}"] = float(parts[name] / totals[1])
    return record


# ---------------------------------------------------------------------------------------------- the run


@dataclass
class Result:
    engine: object
    step: int
    run_dir: Path
    last_checkpoint: Path | None
    export_dir: Path | None


def choose_checkpoint(cfg: TrainConfig, plan: Plan) -> str | None:
    """The checkpoint to continue from: the newest candidate whose files match their manifest (with resume=auto a
    damaged one is skipped with a warning for the previous one, which must fit this run as well)."""
    from r2lm.checkpoints import first_intact

    if not plan.resume_candidates:
        return None
    chosen = first_intact(plan.resume_candidates, fallback=cfg.resume == "auto")
    check_resume(cfg, chosen)  # validate() checked the newest readable candidate, maybe not this one
    return str(chosen)


class GradientWatch:
    """The sum of every gradient backward produces (tensor hooks on the trainable parameters), in float64 so that
    only an inf or NaN makes it non-finite: a bad step is caught BEFORE engine.step() applies it. Whether DeepSpeed
    itself skips such an update depends on the ZeRO stage (stage 0 applies it, and reports no gradient norm)."""

    def __init__(self, module, device):
        import torch

        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.handles = [p.register_hook(self._add) for p in module.parameters() if p.requires_grad]

    def _add(self, grad) -> None:
        import torch

        self.total += grad.detach().sum(dtype=torch.float64)

    def all_finite(self, dist) -> bool:
        """Whether the gradients of every rank since the last call are finite (collective); restarts the sum."""
        import torch

        dist.all_reduce(self.total)
        finite = bool(torch.isfinite(self.total))
        self.total.zero_()
        return finite

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


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


def run(cfg: TrainConfig, plan: Plan, rank: int, local_rank: int, world: int, dist, lock) -> Result:
    """The training itself, in a locked output_dir (train() sets it up): the data, the run folder, then the Trainer's
    steps and its export."""
    import torch
    import yaml

    from train.data import eos_id_of

    torch.manual_seed(cfg.seed)
    eos_id = eos_id_of(plan.tokenizer, plan.model_config)
    try:  # the data's own checks (it decodes, it fills a sequence) end the validation: nothing is written before
        data = plan.objective.data(plan, eos_id, rank, world, local_rank == 0, dist.barrier)
    except ValueError:
        if lock is not None:
            lock.release(discard=True)  # and the output_dir, if this run created it
        raise
    run_dir = Path(cfg.output_dir)
    setup_logging(rank, run_dir)
    resume_from = rank0_decides(lambda: choose_checkpoint(cfg, plan), rank, dist)
    if rank == 0:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    trainer = Trainer(cfg, plan, data, rank, world, dist, Path(resume_from) if resume_from is not None else None)
    trainer.train()
    return trainer.finish()


# the fields of a step's record before the loss's named parts (train_step)
STEP_FIELDS = ("kind", "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s")


class Trainer:
    """The steps of one run over its engine, data, divergence guard and tracker: train() runs steps start..end
    (train_step, log_step, maybe_evaluate, maybe_save), finish() exports. Collective: every rank runs every step,
    and any rank's non-finite loss or gradient stops them all (NonFiniteLossError, naming the checkpoint to
    restart from)."""

    def __init__(self, cfg: TrainConfig, plan: Plan, data, rank: int, world: int, dist, resume_from: Path | None):
        from train.lora import base_model
        from train.tracking import Tracker

        self.cfg, self.plan, self.data, self.rank, self.world, self.dist = cfg, plan, data, rank, world, dist
        self.objective = plan.objective
        self.run_dir, self.model_dir = Path(cfg.output_dir), resolve_path(cfg.model)
        self.engine = build_engine(cfg, plan, self.model_dir)
        self.model_config = base_model(self.engine.module).config
        self.export_dtype = plan.source_dtype if cfg.export_dtype == "auto" else cfg.export_dtype
        self.tokens_per_step = cfg.micro_batch_size * cfg.grad_accum * world * cfg.seq_len
        self.start, self.end = 0, cfg.stop_at or cfg.steps
        self.last_checkpoint = resume_from
        self.guard = DivergenceGuard(self.model_dir, speaks=rank == 0)  # the checkpoint a divergence names (and pruning spares)
        resumed = self.resume(resume_from) if resume_from is not None else {}
        # what every checkpoint records of the data files (rank 0 writes the trainer state), for the next resume's check
        self.data_files = data_record(cfg, resumed.get("data_files")) if rank == 0 else None
        self.tracker = Tracker(cfg, self.run_dir, rank, self.start)
        self.progress = self.gradients = None  # while train() runs

    def resume(self, checkpoint: Path) -> dict:
        """Continue `checkpoint`: the engine, optimizer and schedule as saved, the guard as it was; its trainer state."""
        from train import checkpointing

        resumed = checkpointing.load(self.engine, checkpoint)
        self.start = resumed["step"]
        self.guard = DivergenceGuard.resumed(self.model_dir, checkpoint, resumed, speaks=self.rank == 0)
        logger.info("resumed from %s at step %d", checkpoint, self.start)
        changes = data_changes_since(self.cfg, resumed)  # check_resume let them through: resume_data_changed=true
        if changes:
            logger.warning("continuing on changed data (resume_data_changed=true): %s", "; ".join(changes))
        return resumed

    def train(self) -> None:
        """Steps start..end, each followed by its record, the evaluations and checkpoints the config asks for."""
        from tqdm.auto import tqdm

        if self.data.heldout is None:
            logger.info("no held-out data (data.heldout / data.heldout_fraction): held-out evaluation is off")
        if self.start == 0 and (self.cfg.eval_at_start or self.objective.eval_at_start):
            self.evaluate_at(0)  # attention transfer: its MSE before training
        self.progress = tqdm(total=self.end, initial=self.start, desc="train", unit="step", disable=self.rank != 0,
                             dynamic_ncols=True)
        self.engine.train()
        self.gradients = GradientWatch(self.engine.module, self.engine.device)
        try:
            for step in range(self.start, self.end):
                record = self.train_step(step)
                self.log_step(record)
                self.maybe_evaluate(record["step"])
                self.maybe_save(record["step"])
        finally:
            self.gradients.remove()
            self.progress.close()
            self.tracker.finish()
        self.guard.summary()

    def train_step(self, step: int) -> dict:
        """Optimizer step `step` (0-based) over grad_accum micro-batches, and its record for metrics.jsonl. A
        non-finite loss or gradient on any rank stops the run before the update that would apply it."""
        import torch

        engine, accum = self.engine, self.cfg.grad_accum
        t0 = time.perf_counter()
        lr = engine.get_lr()[0]  # what this step's update applies (as restored from a checkpoint, on resume)
        loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
        parts: dict = {}  # the loss's named parts (certainty: ce, entropy, ...), summed like the loss
        for micro in range(accum):
            out = self.loss(step, micro)
            for name, value in out.metrics().items():
                parts[name] = parts.get(name, 0) + value.detach().to(torch.float64)
            loss_sum += self.summed_over_ranks(out.loss, step, micro)
            engine.backward(out.loss)
            if micro == accum - 1 and not self.gradients.all_finite(self.dist):  # before the update, on every rank
                raise self.guard.error(f"non-finite gradient (inf or NaN) at step {step + 1}, before its update")
            engine.step()
        return self.step_record(step + 1, loss_sum, parts, lr, time.perf_counter() - t0)

    def loss(self, step: int, micro: int):
        """The objective's loss on micro-batch (step, micro), its noise and dropout seeded by (seed, step, micro,
        rank): a resumed run replays them exactly."""
        import torch

        batch, seed, rank = self.data.train(step, micro), self.cfg.seed, self.rank
        generator = torch.Generator(device=self.engine.device).manual_seed(noise_seed(seed, step, micro, rank))
        torch.manual_seed(noise_seed(seed, step, micro, rank, 1))  # dropout (LoRA) replays on resume
        return self.objective.loss(self.engine, batch, generator, self.model_config)

    def summed_over_ranks(self, loss, step: int, micro: int):
        """`loss` summed over the ranks (float64): every rank learns of a non-finite loss anywhere, and stops."""
        import torch

        reduced = loss.detach().to(torch.float64).clone()
        self.dist.all_reduce(reduced)
        if not torch.isfinite(reduced):
            raise self.guard.error(f"non-finite loss ({float(reduced)}) at step {step + 1} (micro-batch {micro})")
        return reduced

    def step_record(self, done: int, loss_sum, parts: dict, lr: float, elapsed: float) -> dict:
        """metrics.jsonl's line of step `done`: loss and parts averaged over micro-batches and ranks, lr, gradient
        norm, throughput. A gradient norm that overflowed stops the run."""
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            # finite gradients whose norm still overflowed: DeepSpeed skips such an update and every later one
            raise self.guard.error(f"non-finite gradient norm ({float(grad_norm)}) at step {done}")
        count = self.cfg.grad_accum * self.world
        record = {
            "kind": "train", "step": done, "loss": float(loss_sum) / count,
            "lr": lr, "grad_norm": None if grad_norm is None else float(grad_norm),
            "tokens": done * self.tokens_per_step, "tokens_per_s": self.tokens_per_step / elapsed, "step_time_s": elapsed,
        }
        for name in sorted(parts):  # the same names, in the same order, on every rank
            self.dist.all_reduce(parts[name])
            record[name] = float(parts[name]) / count
        return record

    def log_step(self, record: dict) -> None:
        """A step's record to metrics.jsonl (and wandb), the guard and the progress bar; every log_every steps and
        at the last, a log line."""
        done = record["step"]
        self.tracker.log(record)
        self.guard.step_done(done, record["loss"])  # finite loss and gradients: confirms the checkpoint before it
        self.progress.update(1)
        if done % self.cfg.log_every == 0 or done == self.end:
            parts = "".join(f", {name} {value:.4g}" for name, value in record.items() if name not in STEP_FIELDS)
            grad_norm = "n/a" if record["grad_norm"] is None else f"{record['grad_norm']:.3g}"
            self.progress.set_postfix(loss=f"{record['loss']:.4g}", lr=f"{record['lr']:.2e}", refresh=False)
            logger.info("step %d/%d: loss %.4g%s, lr %.3g, grad norm %s, %.0f tokens/s", done, self.cfg.steps,
                        record["loss"], parts, record["lr"], grad_norm, record["tokens_per_s"])

    def maybe_evaluate(self, done: int) -> None:
        """Every eval_every steps, and after the run's last step."""
        if (self.cfg.eval_every and done % self.cfg.eval_every == 0) or done == self.cfg.steps:
            self.evaluate_at(done)

    def evaluate_at(self, step: int) -> None:
        """The held-out evaluation after `step` steps (none without held-out data), to metrics.jsonl and the log."""
        if self.data.heldout is None:
            return
        metrics = evaluate(self.engine, self.data, self.cfg, self.objective, self.model_config, self.rank, self.dist)
        record = {"kind": "eval", "step": step, **metrics}
        self.tracker.log(record)
        logger.info("step %d: held-out loss %.4g (%d tokens)%s", step, record["eval_loss"], record["eval_tokens"],
                    self.objective.eval_note(record))

    def maybe_save(self, done: int) -> None:
        """Every save_every steps, and after the last step of this launch (stop_at): a checkpoint the guard watches."""
        from train import checkpointing

        cfg = self.cfg
        if (cfg.save_every and done % cfg.save_every == 0) or done == self.end:
            self.last_checkpoint = checkpointing.save(
                self.engine, self.run_dir / "checkpoints", done, self.state_at(done), self.write_extras, self.rank,
                self.dist.barrier, cfg.keep_checkpoints, protect=self.guard.good,
            )
            self.guard.saved(self.last_checkpoint)

    def state_at(self, step: int) -> dict:
        """The trainer state a checkpoint of step `step` records (what check_resume compares, and the guard's)."""
        cfg = self.cfg
        return {"step": step, "world_size": self.world, "tokens": step * self.tokens_per_step, "seed": cfg.seed,
                "config": cfg.to_dict(), "model_path": str(self.model_dir.resolve()),  # check_resume compares the model
                "guard": self.guard.state(), "data_files": self.data_files}

    def write_extras(self, folder: Path) -> None:
        """What a checkpoint (and its export) holds beside the shards."""
        self.objective.write_extras(folder, self.engine, self.plan, self.model_dir, self.export_dtype)

    def finish(self) -> Result:
        """After the last step: a completed run's summary and export (final/), or how to continue a stopped one."""
        import torch

        cfg, end = self.cfg, self.end
        if end == cfg.steps and self.rank == 0:
            self.objective.finish(self.run_dir, self.model_config)
        export_dir = None
        if cfg.export and end == cfg.steps:
            export_dir = self.run_dir / "final"
            if self.rank == 0:
                self.objective.export(self.last_checkpoint, export_dir, self.model_dir, getattr(torch, self.export_dtype),
                                      self.engine)
            self.dist.barrier()
        elif end < cfg.steps:
            logger.info("stopped at step %d of %d (stop_at); rerun with resume=auto to continue", end, cfg.steps)
        return Result(self.engine, end, self.run_dir, self.last_checkpoint, export_dir)


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
