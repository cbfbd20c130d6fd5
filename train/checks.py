"""The checks of a training run before it starts (train/pretrain.py): bad input fails here (ValueError), before
any work starts and before anything is written.

validate() does every check that needs no process group: the model folder (config, weights, tokenizer), the
objective and LoRA settings, the data sources, the DeepSpeed config (read_deepspeed_config: batch sizes, clipping and
precision come from the training config), output_dir (check_output_dir), and which checkpoints the run may continue
(resume_candidates). Exact resume (check_resume, choose_checkpoint) refuses another world size or model, a changed
setting that the optimizer, schedule, data or noise state depends on, and, unless asked for, a checkpoint without
its manifest or data files changed since it was saved: what every checkpoint records of them is data_record's.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from train.config import TrainConfig, resolve_path
from train.optimizer import schedule_so_far_unchanged
from train.sources import data_changes, fingerprint, resolve_source

logger = logging.getLogger(__name__)


@dataclass
class Plan:
    """Everything validate() resolved: the run can start."""

    model_config: object
    tokenizer: object
    ds_config: dict
    resume_candidates: list[Path]  # newest first; the run continues from the first intact one (none: a fresh run)
    source_dtype: str
    objective: object  # train/objectives.py: what this run trains, on what, and how it exports


def read_deepspeed_config(cfg: TrainConfig, use_bf16: bool) -> dict:
    """The DeepSpeed JSON `cfg.deepspeed`, checked against the training config and completed from it: batch sizes,
    gradient clipping and precision are the training config's, the optimizer and schedule are not DeepSpeed's."""
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


def choose_checkpoint(cfg: TrainConfig, plan: Plan) -> str | None:
    """The checkpoint to continue from: the newest candidate whose files match their manifest (with resume=auto a
    damaged one is skipped with a warning for the previous one, which must fit this run as well)."""
    from r2lm.checkpoints import first_intact

    if not plan.resume_candidates:
        return None
    chosen = first_intact(plan.resume_candidates, fallback=cfg.resume == "auto")
    check_resume(cfg, chosen)  # validate() checked the newest readable candidate, maybe not this one
    return str(chosen)


def data_sources(cfg: TrainConfig) -> dict[str, list[str]]:
    """{"data.train": files, "data.heldout": files} of the local data (a hub dataset has no files to record)."""
    sources = {}
    for what, spec in (("data.train", cfg.data.train), ("data.heldout", cfg.data.heldout)):
        if spec is not None:
            sources[what] = resolve_source(spec, cfg.data.format, what).files or []
    return sources


def data_record(cfg: TrainConfig, known: dict | None) -> dict:
    """The fingerprints of the data files that a checkpoint records (`known`: an earlier record, not read again)."""
    return {what: fingerprint(files, (known or {}).get(what)) for what, files in data_sources(cfg).items()}


def data_changes_since(cfg: TrainConfig, state: dict) -> list[str]:
    """How the data files differ from those a checkpoint's trainer state recorded (none recorded: none known)."""
    recorded = state.get("data_files")
    if recorded is None:  # a checkpoint of an older r2lm
        return []
    return [f"{what} file {change}" for what, files in data_sources(cfg).items()
            for change in data_changes(recorded.get(what, {}), files)]
