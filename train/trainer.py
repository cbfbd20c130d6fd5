"""The run itself, once train/pretrain.py has validated it (train/checks.py) and holds its output_dir: run() builds
the data and the run folder, then the Trainer builds the DeepSpeed engine (build_engine: the objective's module,
LoRA, the optimizer and schedule of train/optimizer.py), runs the steps (loss, backward, update, the divergence guard
of train/guard.py, metrics, held-out evaluation, checkpoints) and exports the model at the end.

Every step's noise and dropout are seeded by (seed, step, micro-step, rank) (r2lm.diffusion.noise_seed), so a run
resumed from a checkpoint replays the uninterrupted run's losses exactly.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from train.checks import Plan, choose_checkpoint, data_changes_since, data_record
from train.config import TrainConfig, resolve_path
from train.distributed import rank0_decides, setup_logging
from train.guard import DivergenceGuard
from train.optimizer import build_optimizer

logger = logging.getLogger(__name__)


@dataclass
class Result:
    """What a run ends with (train/pretrain.py train() returns it): the last checkpoint and the export are None
    where there is none."""

    engine: object
    step: int
    run_dir: Path
    last_checkpoint: Path | None
    export_dir: Path | None


def run(cfg: TrainConfig, plan: Plan, rank: int, local_rank: int, world: int, dist, lock) -> Result:
    """The training itself, in a locked output_dir (train/pretrain.py train() sets it up): the data, the run folder, then the Trainer's
    steps and its export."""
    import torch
    import yaml

    from r2lm.text import eos_id_of

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

        from r2lm.diffusion import noise_seed

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


def build_engine(cfg: TrainConfig, plan: Plan, model_dir: Path):
    """The DeepSpeed engine over the objective's module (LoRA-wrapped where asked), with the run's optimizer and
    schedule (train/optimizer.py)."""
    import deepspeed

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
    optimizer, scheduler = build_optimizer(model, cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=plan.ds_config)
    return engine


def evaluate(engine, data, cfg: TrainConfig, objective, model_config, rank: int, dist) -> dict:
    """The objective's loss on the held-out set with fixed noise, and its named parts (certainty: ce, entropy,
    right_fraction; attention transfer: each hybrid layer's MSE, `eval_mse_layer_N`): token-weighted over all
    ranks' batches."""
    import torch

    from r2lm.diffusion import noise_seed

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
