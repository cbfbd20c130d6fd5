"""Metrics of a run: one JSON line per step (and per evaluation) in OUTPUT_DIR/metrics.jsonl, mirrored to wandb.

The JSONL file is the record tests and scripts read: a resumed run first drops the lines written after its
checkpoint, so the file always holds one consistent history (the steps a crashed run did past its last
checkpoint are recomputed, and logged once). Only rank 0 writes.
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import secrets
from pathlib import Path

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir, kind: str | None = "train") -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    lines = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for i, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if i == lines[-1][0]:  # a last line cut short (a crash, a full disk): the step it logged is redone
                logger.warning("%s: line %d is incomplete (%s); ignored", path, i, err)
                break
            raise ValueError(f"{path}: line {i} is not a JSON record ({err}); the metrics file is damaged") from err
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}: line {i} is not a metrics record (a JSON object with a step)")
        records.append(record)
    return [r for r in records if kind is None or r.get("kind") == kind]


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class Tracker:
    def __init__(self, cfg, run_dir: Path, rank: int, start_step: int):
        self.enabled = rank == 0
        self.run = None
        if not self.enabled:
            return
        self.path = Path(run_dir) / METRICS_FILE
        kept = [r for r in read_metrics(run_dir, kind=None) if r["step"] <= start_step] if start_step else []
        partial = self.path.with_name(self.path.name + ".tmp")  # the history so far survives a crash right here
        partial.write_text("".join(json.dumps(r) + "\n" for r in kept))
        partial.replace(self.path)
        self._init_wandb(cfg, Path(run_dir))

    def _init_wandb(self, cfg, run_dir: Path) -> None:
        mode = cfg.wandb.mode
        if mode == "disabled":
            return
        if mode == "online" and not _has_wandb_key():
            logger.warning("wandb.mode=online but no API key (WANDB_API_KEY or ~/.netrc): logging offline instead")
            mode = "offline"
        os.environ["WANDB_DIR"] = str(run_dir)  # wandb writes OUTPUT_DIR/wandb/, beside the checkpoints
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        id_file = run_dir / "wandb_run_id"  # a resumed run continues the same wandb run
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id)
        self.run = wandb.init(
            project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.wandb.name or run_dir.name, tags=cfg.wandb.tags,
            config=cfg.to_dict(), dir=str(run_dir), mode=mode, id=run_id, resume="allow",
        )
        logger.info("wandb %s run %s in %s", mode, run_id, run_dir / "wandb")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.run is not None:
            prefix = "eval/" if record.get("kind") == "eval" else "train/"
            self.run.log({prefix + k: v for k, v in record.items() if k not in ("step", "kind")}, step=record["step"])

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
