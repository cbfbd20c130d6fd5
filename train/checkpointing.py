"""DeepSpeed checkpoints that are never half valid: the engine's save and load. The layout on disk (tags, the
temporary folder, the manifest, `latest`, resume candidates) is r2lm.checkpoints.training's.

Every rank writes its shards into the temporary folder; after a barrier rank 0 adds the model config, the
tokenizer, the trainer state and the checksum manifest, then renames the folder (r2lm.checkpoints.training
finish_save): a folder named step-N is complete by construction.
"""

from __future__ import annotations

import logging
from pathlib import Path

from r2lm.checkpoints.training import begin_save, finish_save, read_state, tag_of, temporary_tag

logger = logging.getLogger(__name__)


def save(engine, root: Path, step: int, state: dict, write_extras, rank: int, barrier, keep: int = 0,
         protect: Path | None = None) -> Path:
    """Save a complete checkpoint of `engine` after `step` optimizer steps; collective (every rank calls it).

    write_extras(folder): rank 0 writes the model config and tokenizer there before the rename. Pruning beyond
    `keep` spares `protect` (the run's last good checkpoint, train/guard.py)."""
    root = Path(root)
    tmp_tag = temporary_tag(step)
    if rank == 0:
        begin_save(root, step)
    barrier()
    engine.save_checkpoint(str(root), tag=tmp_tag, client_state={"trainer_state": state}, save_latest=False)
    barrier()
    if rank == 0:
        write_extras(root / tmp_tag)
        finish_save(root, step, state, keep, protect)
    barrier()
    final = root / tag_of(step)
    logger.info("saved checkpoint %s", final)
    return final


def load(engine, path: Path) -> dict:
    """Restore engine (weights, optimizer, LR schedule) from a complete checkpoint; returns its trainer state.

    The caller verifies it first (first_intact); a checkpoint without a manifest can still fail to load here."""
    path = Path(path)
    state = read_state(path)
    try:
        load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    except (RuntimeError, OSError, EOFError) as err:  # torch.load of a damaged shard: "PytorchStreamReader failed ..."
        raise ValueError(f"cannot load the checkpoint {path} (damaged?): {type(err).__name__}: {err}") from err
    if load_path is None:
        raise ValueError(f"DeepSpeed could not load the checkpoint {path}")
    return state
