"""DeepSpeed checkpoints that are never half valid.

Layout under OUTPUT_DIR/checkpoints/:

    step-00000500/            complete: DeepSpeed shards + config.json + tokenizer + trainer_state.json
    .tmp-step-00000600/       being written (or left by a crash): ignored by resume and export, removed later
    latest                    tag of the newest complete checkpoint (for DeepSpeed's own tools)

Every rank writes its shards into the temporary folder; after a barrier rank 0 adds the model config, the
tokenizer and trainer_state.json, then renames the folder. A rename is atomic, so a folder named step-N is
complete by construction. The folder needs nothing else to be exported (python -m convert deepspeed-to-hf).
Multi-node runs need OUTPUT_DIR on a filesystem all nodes share (as DeepSpeed's resume does anyway).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

TAG_RE = re.compile(r"^step-(\d{8,})$")
STATE_FILE = "trainer_state.json"


def tag_of(step: int) -> str:
    return f"step-{step:08d}"


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
    return json.loads(state_file.read_text())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(engine, root: Path, step: int, state: dict, write_extras, rank: int, barrier, keep: int = 0) -> Path:
    """Save a complete checkpoint of `engine` after `step` optimizer steps; collective (every rank calls it).

    write_extras(folder): rank 0 writes the model config and tokenizer there before the rename."""
    root = Path(root)
    tag = tag_of(step)
    tmp_name = f".tmp-{tag}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root / tmp_name, ignore_errors=True)  # left by a crash at this very step
    barrier()
    engine.save_checkpoint(str(root), tag=tmp_name, client_state={"trainer_state": state}, save_latest=False)
    barrier()
    final = root / tag
    if rank == 0:
        write_extras(root / tmp_name)
        (root / tmp_name / STATE_FILE).write_text(json.dumps(state, indent=1))
        old = None
        if final.exists():  # the same step saved by an earlier, replayed run: swap, so a valid one always exists
            old = root / f".old-{tag}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(root / tmp_name, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _write_atomic(root / "latest", tag)
        _prune(root, keep)
    barrier()
    logger.info("saved checkpoint %s", final)
    return final


def _prune(root: Path, keep: int) -> None:
    for path in root.iterdir():  # temporary folders of earlier crashed saves
        if path.name.startswith((".tmp-step-", ".old-step-")) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
    if keep > 0:
        for _, path in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)


def load(engine, path: Path) -> dict:
    """Restore engine (weights, optimizer, LR schedule) from a complete checkpoint; returns its trainer state."""
    path = Path(path)
    state = read_state(path)
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise ValueError(f"DeepSpeed could not load the checkpoint {path}")
    return state
