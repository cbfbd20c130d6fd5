"""The one manifest of every folder r2lm writes (HF-format outputs and training checkpoints): checksums.sha256.

It holds the sha256 of every other file of the folder in `sha256sum` format (`sha256sum -c checksums.sha256`
checks a folder by hand), written last, when the folder is complete. It serves three readers: `--overwrite`
replaces a folder only while it holds nothing the manifest does not list (so nothing r2lm did not write is ever
deleted); resume and export verify a checkpoint's files against it before they load them; and every loader of
weights (R2LMForDiffusionLM.from_pretrained, the converters, merge-lora's adapter) verifies the weight files it
reads (`verify_files`), where their folder has a manifest. Weights are what a flipped bit changes in silence;
JSON files (config, generation config, tokenizer) are checked by their readers, and may be edited by hand.
A file's sha256 is computed once per process per version of it (its size, inode and change times): a load that
checks a folder and then loads it hashes it once, and the shards of a sharded checkpoint are hashed in parallel.

Folders written before this manifest existed: conversions listed their files (names only) in r2lm_manifest.json,
which still marks a folder as replaceable; training checkpoints had no manifest, and verify warns that they cannot
be checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

MANIFEST = "checksums.sha256"
LEGACY_MANIFEST = "r2lm_manifest.json"  # conversions before checksums.sha256: {"files": [names]}


class DamagedCheckpointError(ValueError):
    """A file of a checkpoint is missing or differs from what its manifest says was written."""


_digests: dict[tuple, str] = {}  # (path, device, inode, size, mtime, ctime) -> sha256: each file version hashed once


def sha256_of(path: Path) -> str:
    path = Path(path).resolve()
    st = path.stat()
    version = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if version not in _digests:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        if len(_digests) >= 4096:
            _digests.clear()
        _digests[version] = digest.hexdigest()
    return _digests[version]


def current_umask() -> int:
    """The process umask, read without changing it where /proc tells it (os.umask can only set it, which would
    race with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def seal(folder: Path) -> None:
    """Finish a folder before it is renamed into place: give everything in it the mode a plain open() / mkdir
    gives under the umask (safetensors and tempfile write 0600 whatever the umask says), then write the manifest,
    last, over every file."""
    folder = Path(folder)
    umask = current_umask()
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink() and p.name != MANIFEST)
    lines = [f"{sha256_of(p)}  {p.relative_to(folder).as_posix()}\n" for p in files]
    (folder / MANIFEST).write_text("".join(lines))


def read_manifest(folder: Path) -> dict[str, str] | None:
    """{relative path: sha256} of a folder's manifest; None when it has none."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    entries = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name:
            raise DamagedCheckpointError(f"checkpoint {folder}: line {number} of {MANIFEST} is not 'SHA256  FILE'")
        entries[name] = digest
    return entries


def listed_files(folder: Path) -> set[str] | None:
    """The files r2lm wrote into `folder`, as its manifest (or an older conversion's r2lm_manifest.json) lists
    them; None when it has neither. Raises ValueError for an unreadable one."""
    folder = Path(folder)
    entries = read_manifest(folder)
    if entries is not None:
        return set(entries)
    legacy = folder / LEGACY_MANIFEST
    if not legacy.is_file():
        return None
    try:
        return set(json.loads(legacy.read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{legacy}: {err!r}") from None


def verify_checkpoint(folder: Path) -> bool:
    """Check every file of a folder against its manifest before it is loaded (resume, export).

    Returns True when all files match; False (with a warning) for a folder without a manifest (written before r2lm
    wrote them, or by another program), which cannot be verified. Raises DamagedCheckpointError (a ValueError)
    naming the first missing or changed file."""
    folder = Path(folder)
    expected = read_manifest(folder)
    if expected is None:
        logger.warning("checkpoint %s has no %s (written by an older r2lm or another program): its files cannot be "
                       "verified", folder, MANIFEST)
        return False
    for name, digest in expected.items():
        path = folder / name
        if not path.is_file():
            raise DamagedCheckpointError(f"checkpoint {folder}: {name} is missing (listed in {MANIFEST})")
        if sha256_of(path) != digest:
            raise DamagedCheckpointError(f"checkpoint {folder}: {name} is damaged (truncated or changed since it was "
                                         f"saved: its sha256 differs from {MANIFEST})")
    return True


def verify_files(folder: Path, paths) -> None:
    """Check `paths`, files of `folder`, against the folder's manifest before a loader reads them: where the folder
    has one that lists a file, its sha256 must match. Folders without a manifest (downloads, other programs) and
    files it does not list are not checked. Raises DamagedCheckpointError (a ValueError) naming the file."""
    folder = Path(folder)
    expected = read_manifest(folder)
    if expected is None:
        return
    names = {path: Path(os.path.relpath(path.resolve(), folder.resolve())).as_posix() for path in map(Path, paths)}
    listed = [(path, expected[name]) for path, name in names.items() if name in expected]
    with ThreadPoolExecutor(max_workers=max(1, min(len(listed), os.cpu_count() or 1))) as pool:
        digests = list(pool.map(sha256_of, [path for path, _ in listed]))  # shards in parallel: hashlib frees the GIL
    for (path, digest), found in zip(listed, digests, strict=True):
        if found != digest:
            raise DamagedCheckpointError(
                f"{path} is damaged: its sha256 differs from the one {folder / MANIFEST} lists (truncated or changed "
                "since r2lm wrote it; restore it from a copy, or if you changed it on purpose, delete its line there)"
            )
