"""Training runs and their DeepSpeed checkpoints, as train/pretrain.py lays them out on disk.

    OUTPUT_DIR/               run.lock, config.yaml, train.log, metrics.jsonl, wandb/, final/ (the export)
      checkpoints/
        step-00000500/        complete: DeepSpeed shards + config.json + tokenizer + trainer_state.json
                              + checksums.sha256 (r2lm.checkpoints.manifest)
        .tmp-step-00000600/   being written (or left by a crash): ignored by resume and export, removed later
        latest                tag of the newest complete checkpoint (for DeepSpeed's own tools)

Every rank writes its shards into the temporary folder (train/checkpointing.py: DeepSpeed's engine save); rank 0
then adds the model config and tokenizer, and `finish_save` the trainer state and the manifest, and renames the
folder. A rename is atomic, so a folder named step-N is complete by construction; the manifest tells whether its
files are still the ones written (resume and export verify it, and a resumed run falls back to the previous
checkpoint when the newest is damaged: `first_intact`). A checkpoint needs nothing else to be exported
(r2lm.checkpoints.zero). Multi-node runs need OUTPUT_DIR on a filesystem all nodes share (as DeepSpeed's resume
does anyway).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import shutil
from pathlib import Path

from r2lm.checkpoints.manifest import DamagedCheckpointError, seal, verify_checkpoint

logger = logging.getLogger(__name__)

TAG_RE = re.compile(r"^step-(\d{8,})$")
STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"
_MODEL_STATES = re.compile(r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt$")

# What a run folder holds (see the module docstring), what checkpoints/ holds (DeepSpeed's zero_to_*.py besides),
# and what each checkpoint holds (DeepSpeed shards, trainer_state.json). A folder holding any of them is never the
# destination of a conversion.
TRAINING_MARKERS = (
    "run.lock", "config.yaml", "train.log", "metrics.jsonl", "wandb", "checkpoints", "attention_transfer.json",
    LATEST_FILE, "step-*", ".tmp-step-*", "zero_to_fp32.py",
    STATE_FILE, "*mp_rank_*_model_states.pt", "*optim_states.pt",
)


def training_files(folder: Path) -> list[str]:
    """The names in `folder` that make it a training run, checkpoints or checkpoint folder ([] for none)."""
    return sorted(p.name for p in Path(folder).iterdir() if any(fnmatch.fnmatch(p.name, m) for m in TRAINING_MARKERS))


def tag_of(step: int) -> str:
    return f"step-{step:08d}"


def temporary_tag(step: int) -> str:
    """The folder (under checkpoints/) the ranks write the checkpoint of `step` into; one name, so all ranks agree."""
    return f".tmp-{tag_of(step)}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = TAG_RE.match(path.name)
        if match and path.is_dir() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def read_state(path: Path) -> dict:
    state_file = Path(path) / STATE_FILE
    if not state_file.is_file():
        raise ValueError(f"{path} is not a complete training checkpoint (no {STATE_FILE})")
    try:
        return json.loads(state_file.read_text())
    except ValueError as err:
        raise DamagedCheckpointError(f"checkpoint {path}: {STATE_FILE} is damaged (not JSON: {err})") from None


def first_intact(candidates: list[Path], fallback: bool) -> Path:
    """The first of `candidates` (newest first) that passes verify_checkpoint. With `fallback`, a damaged one is
    skipped with a warning naming its bad file; without, or when every one is damaged, DamagedCheckpointError."""
    problems = []
    for i, path in enumerate(candidates):
        try:
            verify_checkpoint(path)
            return path
        except DamagedCheckpointError as err:
            if not fallback:
                raise
            problems.append(str(err))
            if i + 1 < len(candidates):
                logger.warning("%s; falling back to the previous complete checkpoint %s", err, candidates[i + 1])
    raise DamagedCheckpointError("every checkpoint is damaged: " + "; ".join(problems) + "; nothing to resume from: "
                                 "start the run again in a new output_dir")


def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and any(_MODEL_STATES.search(p.name) for p in path.iterdir())


def resolve_checkpoint(ckpt, tag: str | None = None) -> tuple[Path, str]:
    """(checkpoints root, tag) of CKPT: a checkpoint folder (OUTPUT_DIR/checkpoints/step-00000500), a checkpoints
    folder (its newest complete checkpoint, or `tag`) or a run folder holding checkpoints/. Raises ValueError."""
    path = Path(ckpt)
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist or is not a folder")
    if tag is None and _is_tag_dir(path):
        return path.parent, path.name
    if (path / "checkpoints").is_dir() and not _is_tag_dir(path):
        path = path / "checkpoints"
    if tag is None:
        newest = latest_checkpoint(path)
        if newest is not None:
            tag = newest.name
        elif (path / LATEST_FILE).is_file():
            tag = (path / LATEST_FILE).read_text().strip()
        else:
            raise ValueError(f"{path} holds no complete DeepSpeed checkpoint (no step-N folder, no 'latest' file)")
    if not _is_tag_dir(path / tag):
        raise ValueError(f"{path / tag} is not a DeepSpeed checkpoint (no *mp_rank_*_model_states.pt)")
    return path, tag


# ----------------------------------------------------------------------------------------------- saving (rank 0)


def begin_save(root: Path, step: int) -> None:
    """Before the ranks write the checkpoint of `step`: `root` exists, and what a crash at this very step left in
    its temporary folder is gone."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root / temporary_tag(step), ignore_errors=True)


def finish_save(root: Path, step: int, state: dict, keep: int = 0, protect: Path | None = None) -> Path:
    """After every rank wrote its shards (and rank 0 the config and tokenizer) into the temporary folder: the
    trainer state, the seal (permissions, manifest), the rename to step-N, `latest`, and the pruning of older
    checkpoints beyond `keep` (0: keep all), except `protect` (the run's last good one). Returns the checkpoint
    folder."""
    root = Path(root)
    tmp, final = root / temporary_tag(step), root / tag_of(step)
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
    seal(tmp)
    old = None
    if final.exists():  # the same step saved by an earlier, replayed run: swap, so a valid one always exists
        old = root / f".old-{tag_of(step)}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _write_atomic(root / LATEST_FILE, tag_of(step))
    _prune(root, keep, protect)
    return final


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prune(root: Path, keep: int, protect: Path | None = None) -> None:
    for path in root.iterdir():  # temporary folders of earlier crashed saves
        if path.name.startswith((".tmp-step-", ".old-step-")) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
    if keep > 0:
        for _, path in complete_checkpoints(root)[:-keep]:
            if protect is None or path.resolve() != Path(protect).resolve():
                shutil.rmtree(path, ignore_errors=True)
