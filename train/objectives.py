"""The training objectives of train/pretrain.py, one entry each: what the run loop needs of an objective, and
nothing else branches on its name.

    diffusion            ar | mdlm | block | certainty (r2lm.diffusion): an R2LM trained on packed text
    attention_transfer   stage 1 of block-hybrid conversion (train/transfer.py): only feature maps and gates train
    drafter              a drafter for the frozen model (r2lm.drafter, train/drafter.py) on the target's own text

An objective checks the config against the model before any work (`check`), builds the module DeepSpeed trains
(`module`), its data (`data`), the loss of one batch (`loss`: a r2lm.diffusion.Loss, whose `metrics()` are logged
beside it), what a checkpoint holds beside the shards (`write_extras`), the export (`export`), what is written
once training ends (`finish`) and what a held-out evaluation's log line adds to its loss (`eval_note`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class Objective(ABC):
    """What every objective shares; each builds its own module and loss."""

    eval_at_start = False  # evaluate before the first step (attention transfer reports its MSE before and after)

    def __init__(self, cfg):
        self.cfg = cfg

    def check(self, config) -> None:
        """Refuse a config that does not fit the model (ValueError), before any work starts."""
        return  # by default every config fits

    @abstractmethod
    def module(self, model_dir: Path, plan):
        """The torch module DeepSpeed trains, loaded from model_dir."""

    def data(self, plan, eos_id: int, rank: int, world: int, first_on_node: bool, barrier):
        from train.data import build_data

        return build_data(self.cfg, plan.tokenizer, eos_id, rank, world, first_on_node=first_on_node, barrier=barrier)

    @abstractmethod
    def loss(self, engine, batch, generator, model_config):
        """The loss of one micro-batch (a r2lm.diffusion.Loss), its noise drawn from `generator`."""

    def write_extras(self, folder: Path, engine, plan, model_dir: Path, export_dtype: str) -> None:
        """What a checkpoint (and its export) holds beside the weight shards: the model config and the tokenizer."""
        from train.lora import base_model, save_adapter_config

        model_config = base_model(engine.module).config
        config = type(model_config).from_dict(model_config.to_dict())
        config.dtype = export_dtype
        config.save_pretrained(folder)
        plan.tokenizer.save_pretrained(folder)
        if (model_dir / "generation_config.json").is_file():
            (folder / "generation_config.json").write_text((model_dir / "generation_config.json").read_text())
        if self.cfg.lora.enabled:
            save_adapter_config(engine.module, folder)

    def export(self, last_checkpoint: Path, export_dir: Path, model_dir: Path, dtype: torch.dtype, engine) -> None:
        """final/ from the last checkpoint (rank 0): an R2LM folder, or the LoRA adapter alone."""
        if self.cfg.lora.enabled:  # python -m convert merge-lora merges it
            from train.lora import export_adapter

            export_adapter(last_checkpoint, export_dir, model_dir, dtype=dtype, overwrite=True)
        else:
            from r2lm.checkpoints.export import export_deepspeed_checkpoint

            export_deepspeed_checkpoint(last_checkpoint, export_dir, dtype=dtype, overwrite=True)

    def finish(self, run_dir: Path, model_config) -> None:
        """After the last step of a completed run (rank 0)."""
        return  # by default nothing more to write

    def eval_note(self, record: dict) -> str:
        """What the log line of a held-out evaluation adds to its loss (attention transfer: each layer's MSE)."""
        return ""


class Diffusion(Objective):
    """ar | mdlm | block | certainty on an R2LM (r2lm.diffusion), optionally with a frozen backbone."""

    def check(self, config) -> None:
        from r2lm.diffusion import check_objective

        cfg = self.cfg
        check_objective(cfg.objective, config)
        if cfg.objective in ("block", "certainty") and cfg.seq_len <= config.block_size:
            raise ValueError(f"seq_len {cfg.seq_len} must exceed the block size {config.block_size} (block 0 is "
                             "context only)")
        if cfg.complementary and cfg.objective not in ("block", "certainty"):
            raise ValueError("complementary masks exist for the block objective only (and certainty, which always "
                             "uses them)")
        if cfg.freeze_backbone and not config.sidecar_layers:
            raise ValueError("freeze_backbone leaves nothing to train: the model has no sidecar_layers")

    def module(self, model_dir: Path, plan):
        from r2lm import R2LMForDiffusionLM

        model = R2LMForDiffusionLM.from_pretrained(model_dir, dtype=torch.float32)  # fp32 master weights
        if self.cfg.freeze_backbone:
            logger.info("frozen backbone: training %d sidecar tensors", len(model.freeze_backbone()))
        return model

    def loss(self, engine, batch, generator, model_config):
        from r2lm.diffusion import compute_loss

        cfg, options = self.cfg, {"eps": self.cfg.eps}
        if cfg.objective == "ar":
            options = {}
        elif cfg.objective == "block":
            options["complementary"] = cfg.complementary
        elif cfg.objective == "certainty":
            options.update(entropy_weight=cfg.certainty.entropy_weight, temperature=cfg.certainty.temperature)
        return compute_loss(cfg.objective, engine, batch.to(engine.device), separator_id=self.eos_id,
                            generator=generator, config=model_config, **options)

    def data(self, plan, eos_id, rank, world, first_on_node, barrier):
        self.eos_id = eos_id
        return super().data(plan, eos_id, rank, world, first_on_node, barrier)


class AttentionTransfer(Diffusion):
    """Stage 1 of block-hybrid conversion (train/transfer.py)."""

    eval_at_start = True

    def check(self, config) -> None:
        from train.transfer import check_attention_transfer

        cfg = self.cfg
        check_attention_transfer(config)
        if cfg.data.heldout is None and not cfg.data.heldout_fraction:
            raise ValueError("objective attention_transfer reports the held-out per-layer MSE before and after "
                             "training: give data.heldout or data.heldout_fraction")
        if cfg.seq_len <= config.block_size:
            raise ValueError(f"seq_len {cfg.seq_len} must exceed the block size {config.block_size} (block 0 is "
                             "context only)")
        if cfg.complementary:
            raise ValueError("complementary masks exist for the block objective only (and certainty, which always "
                             "uses them)")
        if cfg.lora.enabled:
            raise ValueError("lora.enabled does not combine with objective attention_transfer: stage 1 trains only the "
                             "feature maps and gates; LoRA is stage 2 (objective block, from stage 1's export)")

    def module(self, model_dir: Path, plan):
        from train.transfer import AttentionTransferLM, freeze_for_transfer

        model = AttentionTransferLM.from_pretrained(model_dir, dtype=torch.float32)
        names = freeze_for_transfer(model)  # stage 1 trains the feature maps and gates only, whatever freeze_backbone says
        logger.info("attention transfer: training %d feature-map / gate tensors of hybrid layers %s%s", len(names),
                    model.config.hybrid_layers, " (freeze_backbone is implied)" if self.cfg.freeze_backbone else "")
        return model

    def loss(self, engine, batch, generator, model_config):
        from train.transfer import transfer_loss

        return transfer_loss(engine, batch.to(engine.device), separator_id=self.eos_id, generator=generator,
                             config=model_config, eps=self.cfg.eps)

    def finish(self, run_dir: Path, model_config) -> None:
        from train.tracking import read_metrics
        from train.transfer import write_summary

        write_summary(run_dir, read_metrics(run_dir, "eval"), model_config, self.cfg.steps)

    def eval_note(self, record: dict) -> str:
        return "".join(f", layer {key.rsplit('_', 1)[1]} MSE {value:.4g}" for key, value in record.items()
                       if key.startswith("eval_mse_layer_"))


class Drafting(Objective):
    """A drafter for the frozen model `model` (train/drafter.py): only the drafter trains; final/ is the drafter."""

    def check(self, config) -> None:
        from r2lm.drafter import DrafterConfig
        from train.config import FRESH_DRAFTERS, resolve_path
        from train.drafter import trained_config

        cfg = self.cfg
        if cfg.lora.enabled or cfg.freeze_backbone or cfg.complementary:
            raise ValueError("objective drafter trains a drafter beside a frozen model: lora, freeze_backbone and "
                             "complementary do not apply")
        if not config.kind.verifiable:
            raise ValueError("a drafter serves verify=True, which needs a causal model with shift prediction and "
                             "softmax layers")
        if cfg.drafter.init in FRESH_DRAFTERS:
            self.drafter_config = DrafterConfig.for_target(config, **cfg.drafter.choices())
        else:
            self.drafter_config = trained_config(resolve_path(cfg.drafter.init), cfg.drafter, config)
        if cfg.data.heldout_fraction:
            raise ValueError("objective drafter reads held-out teacher records from data.heldout, not "
                             "data.heldout_fraction")

    def module(self, model_dir: Path, plan):
        from r2lm.drafter import Drafter
        from train.config import FRESH_DRAFTERS, resolve_path
        from train.drafter import FeatureCache

        drafter = Drafter(self.drafter_config)
        init = self.cfg.drafter.init
        if init in FRESH_DRAFTERS:
            drafter.draft_ids.copy_(self.vocabulary(len(drafter.draft_ids)))
        else:  # its files checked against their checksums, its draft vocabulary kept: it goes on where it stopped
            drafter.load_state_dict(Drafter.from_pretrained(resolve_path(init)).state_dict())
        if init == "target":
            drafter.start_from(self.target)
        drafter.bind(self.target)
        section = self.cfg.drafter
        top = self.target.config.num_hidden_layers - 1
        if section.distill and top not in drafter.config.feature_layers:
            raise ValueError(f"drafter.distill reads the target's logits from its last layer's output: add layer {top} "
                             f"to drafter.feature_layers ({drafter.config.feature_layers})")
        self.features = FeatureCache(section.features_cache, self.target, tuple(drafter.config.feature_layers),
                                     getattr(torch, section.features_dtype))
        logger.info("drafter: %d layers (%s in-block attention%s), draft vocabulary %d, features of target layers "
                    "%s", drafter.config.num_hidden_layers, drafter.config.in_block,
                    ", reverse sidecar" if drafter.config.sidecar else "", len(drafter.draft_ids),
                    drafter.config.feature_layers)
        return drafter

    def vocabulary(self, size: int) -> torch.Tensor:
        """The draft vocabulary: the `size` tokens most frequent in the training records' replies, and every EOS."""
        counts = torch.zeros(self.target.config.vocab_size, dtype=torch.long)
        for record in self.records:
            for start, end in record.spans:
                counts.index_add_(0, torch.tensor(record.ids[start:end]), torch.ones(end - start, dtype=torch.long))
        eos = self.target.config.eos_token_id
        for i in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            counts[i] = counts.max() + 1
        return counts.topk(size).indices.sort().values

    def data(self, plan, eos_id, rank, world, first_on_node, barrier):
        from r2lm.drafter import target_digest
        from train.config import resolve_path
        from train.data import Data
        from train.drafter import EvalBatches, TrainBatches, load_target, read_records
        from train.sources import resolve_source

        cfg = self.cfg
        pad = plan.tokenizer.pad_token_id if plan.tokenizer.pad_token_id is not None else eos_id
        self.target = load_target(resolve_path(cfg.model))  # (the data is read first: it is checked against it)
        target = self.drafter_config.target_digest = target_digest(self.target)  # bind() warns on another model
        self.records = read_records(resolve_source(cfg.data.train, cfg.data.format, "data.train").files, cfg.seq_len,
                                    "data.train", cfg.drafter.max_tokens, target)
        train = TrainBatches(self.records, cfg.micro_batch_size, cfg.grad_accum, rank, world, cfg.seed, pad)
        heldout = None
        if cfg.data.heldout is not None:
            held = read_records(resolve_source(cfg.data.heldout, cfg.data.format, "data.heldout").files, cfg.seq_len,
                                "data.heldout", target=target)
            heldout = EvalBatches(held, cfg.micro_batch_size, world, cfg.eval_batches, pad)
        logger.info("drafter data: %d training records, %d tokens (%d to draft)%s", len(self.records),
                    sum(len(r.ids) for r in self.records), sum(r.reply_tokens for r in self.records),
                    f", {len(heldout.records)} held out" if heldout else "")
        return Data(train, heldout, eos_id, len(self.records))

    def loss(self, engine, batch, generator, model_config):
        for target in (self.target, self.features.target):  # the frozen target sits beside the drafter DeepSpeed placed
            if target.device != engine.device:
                target.to(engine.device)
        captured = [h.to(engine.device) for h in self.features(batch)]
        section = self.cfg.drafter
        return engine(captured, batch["ids"].to(engine.device), batch["valid"].to(engine.device),
                      batch["reply"].to(engine.device), section.blocks, generator, section.decay,
                      section.feature_weight, section.distill,
                      section.replay if torch.is_grad_enabled() else 0.0,  # evaluation: the random anchors alone
                      section.conditional)

    def write_extras(self, folder: Path, engine, plan, model_dir: Path, export_dtype: str) -> None:
        engine.module.config.save_pretrained(folder)

    def export(self, last_checkpoint: Path, export_dir: Path, model_dir: Path, dtype: torch.dtype, engine) -> None:
        """final/: the drafter alone (its config and weights), beside which the target is loaded."""
        from r2lm.checkpoints.writing import atomic_output_dir

        with atomic_output_dir(export_dir, overwrite=True) as tmp:
            engine.module.to(dtype).save_pretrained(tmp)
            engine.module.float()
        logger.info("exported the drafter to %s (load it with r2lm.drafter.Drafter.from_pretrained)", export_dir)


OBJECTIVES = {"ar": Diffusion, "mdlm": Diffusion, "block": Diffusion, "certainty": Diffusion,
              "attention_transfer": AttentionTransfer, "drafter": Drafting}


def objective_of(cfg) -> Objective:
    if cfg.objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {cfg.objective!r}; expected one of {tuple(OBJECTIVES)}")
    return OBJECTIVES[cfg.objective](cfg)
