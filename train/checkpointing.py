"""DeepSpeed checkpoints that are never half valid.

Layout under OUTPUT_DIR/checkpoints/:

    step-00000500/            complete: DeepSpeed shards + config.json + tokenizer + trainer_state.json
                              + checksums.sha256
    .tmp-step-00000600/       being written (or left by a crash): ignored by resume and export, removed later
    latest                    tag of the newest complete checkpoint (for DeepSpeed's own tools)

Every rank writes its shards into the temporary folder; after a barrier rank 0 adds the model config, the
tokenizer and trainer_state.json, and last the checksum manifest (sha256 of every other file, in `sha256sum`
format, so `sha256sum -c checksums.sha256` checks a folder by hand), then renames the folder. A rename is
atomic, so a folder named step-N is complete by construction; the manifest tells whether its files are still
the ones written (verify_checkpoint: resume and export call it, and a resumed run falls back to the previous
checkpoint when the newest is damaged). The folder needs nothing else to be exported (python -m convert
deepspeed-to-hf). Multi-node runs need OUTPUT_DIR on a filesystem all nodes share (as DeepSpeed's resume does
anyway).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

TAG_RE = re.compile(r"^step-(\d{8,})$")
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "checksums.sha256"


class DamagedCheckpointError(ValueError):
    """A file of a checkpoint is missing or differs from what its manifest says was written."""


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
    try:
        return json.loads(state_file.read_text())
    except ValueError as err:
        raise DamagedCheckpointError(f"checkpoint {path}: {STATE_FILE} is damaged (not JSON: {err})") from None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """The sha256 of every file under `folder` into folder/checksums.sha256 (written last: it covers the rest)."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    lines = [f"{sha256_of(p)}  {p.relative_to(folder).as_posix()}\n" for p in files]
    (folder / MANIFEST_FILE).write_text("".join(lines))


def read_manifest(folder: Path) -> dict[str, str] | None:
    """{relative path: sha256} of a checkpoint's manifest; None when it has none."""
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        return None
    entries = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name:
            raise DamagedCheckpointError(f"checkpoint {folder}: line {number} of {MANIFEST_FILE} is not 'SHA256  FILE'")
        entries[name] = digest
    return entries


def verify_checkpoint(folder: Path) -> bool:
    """Check every file of a checkpoint against its manifest before it is loaded (resume, deepspeed-to-hf).

    Returns True when all files match; False (with a warning) for a checkpoint without a manifest, written
    before r2lm wrote them, which cannot be verified. Raises DamagedCheckpointError (a ValueError) naming the
    first missing or changed file."""
    folder = Path(folder)
    expected = read_manifest(folder)
    if expected is None:
        logger.warning("checkpoint %s has no %s (written by an older r2lm): its files cannot be verified", folder,
                       MANIFEST_FILE)
        return False
    for name, digest in expected.items():
        path = folder / name
        if not path.is_file():
            raise DamagedCheckpointError(f"checkpoint {folder}: {name} is missing (listed in {MANIFEST_FILE})")
        if sha256_of(path) != digest:
            raise DamagedCheckpointError(f"checkpoint {folder}: {name} is damaged (truncated or changed since it was "
                                         f"saved: its sha256 differs from {MANIFEST_FILE})")
    return True


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


def current_umask() -> int:
    """The process umask, read without changing it where /proc tells it (os.umask can only set it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(folder: Path) -> None:
    """Give every file and folder under `folder` the mode a plain open() / mkdir gives under the umask
    (safetensors writes its files 0600, whatever the umask says)."""
    umask = current_umask()
    for path in [Path(folder), *Path(folder).rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


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
        write_manifest(root / tmp_name)
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
