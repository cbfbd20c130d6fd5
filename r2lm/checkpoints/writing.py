"""Writing a checkpoint folder: the checks on its destination, then an atomic write.

A folder is written into a temporary folder beside it, `.DST.tmp-PID-TOKEN@HOST` (the writer's process and host: a
later writer removes the leftovers of one that was killed, never those of a live one), which is sealed (the umask's
permissions, the manifest listing every file with its sha256: r2lm.checkpoints.manifest) and renamed to DST when
complete. --overwrite replaces only a folder with such a manifest and nothing else in it, its files unchanged
since, or an empty folder: r2lm never deletes what it did not write (nor a user's edit of what it wrote), and never
replaces a training run or checkpoint folder. DST is checked before the work and again just before the rename.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from r2lm.checkpoints.hf import copy_tokenizer_files, read_generation_config, weight_files
from r2lm.checkpoints.manifest import LEGACY_MANIFEST, MANIFEST, listed_files, read_manifest, seal, sha256_of
from r2lm.checkpoints.training import training_files
from r2lm.configuration_r2lm import R2LMConfig
from r2lm.generation_config import decoding_generation_config

logger = logging.getLogger(__name__)

OVERWRITE_HELP = f"replace DST if it is an earlier conversion's output (it has a {MANIFEST}) or empty"

_HOST = socket.gethostname()
_PRIVATE = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}@(?P<host>[^@]+)")


# ----------------------------------------------------------------------------------------------- DST checks


def check_destination(dst, sources: Sequence, overwrite: bool, needed_bytes: int | None = None) -> Path:
    """`dst` as a path, after the checks every converter makes before any expensive work. Raises ValueError.

    DST must not be, contain or lie inside a source (the sources are never modified); an existing DST must be
    replaceable (`check_replaceable`); its filesystem must be writable and have `needed_bytes` free (default: the
    size of the sources' weights)."""
    dst = Path(dst)
    for src in map(Path, sources):
        problem = _overlap(dst.resolve(), src.resolve())
        if problem:
            raise ValueError(f"DST {dst} {problem} the source {src}; the sources are never modified: choose another DST")
    if dst.parent.is_dir():
        remove_stale_temporaries(dst.parent)  # first: a killed swap may have left DST only as its .old copy
    check_replaceable(dst, overwrite)
    if needed_bytes is None:
        needed_bytes = sum(p.stat().st_size for src in sources for p in weight_files(src) if p.is_file())
    _check_writable(dst, needed_bytes)
    return dst


def _overlap(dst: Path, src: Path) -> str | None:
    if dst == src:
        return "is"
    if src.is_relative_to(dst):
        return "contains"
    if dst.is_relative_to(src):
        return "lies inside"
    return None


def check_replaceable(dst: Path, overwrite: bool) -> None:
    """Refuse an existing `dst` unless --overwrite is given and replacing it deletes only what r2lm wrote (a folder
    holding its manifest and the files listed there, as it wrote them) or nothing (an empty folder)."""
    dst = Path(dst)
    if not os.path.lexists(dst):
        return
    if dst.is_dir() and not dst.is_symlink():
        found = training_files(dst)
        if found:
            raise ValueError(
                f"DST {dst} is a training run or checkpoint folder (it holds {', '.join(found[:4])}); a conversion "
                "never replaces one, even with --overwrite: choose another DST"
            )
    why = _not_written_by_us(dst)
    if why:
        raise ValueError(
            f"DST {dst} already exists and {why}; --overwrite replaces only an empty folder or one r2lm wrote "
            f"(with its {MANIFEST}), so nothing else is ever deleted: move it away or choose another DST"
        )
    if not overwrite:
        raise ValueError(f"{dst} already exists; pass --overwrite to replace it")


def _not_written_by_us(dst: Path) -> str | None:
    """Why replacing the existing `dst` could delete something r2lm did not write; None if it cannot: every entry
    is a file its manifest lists, unchanged (the sha256 recorded there; an older conversion's r2lm_manifest.json
    has names only), or a folder holding such files."""
    if dst.is_symlink():
        return "is a symbolic link"
    if not dst.is_dir():
        return "is a file, not a folder"
    if next(dst.iterdir(), None) is None:
        return None
    try:  # before walking it: DST may be a home folder
        digests = read_manifest(dst)
        listed = set(digests) if digests is not None else listed_files(dst)
    except ValueError as err:
        return f"has a manifest that cannot be read ({err})"
    if listed is None:
        return f"has no {MANIFEST} (nor an older {LEGACY_MANIFEST}): it was not written by r2lm"
    holders = {str(parent) for name in listed for parent in PurePosixPath(name).parents}
    ours = listed | {MANIFEST, LEGACY_MANIFEST}
    extra = []
    for path in sorted(dst.rglob("*")):
        name = path.relative_to(dst).as_posix()
        is_file, is_dir = path.is_file() and not path.is_symlink(), path.is_dir() and not path.is_symlink()
        if not (is_file and name in ours or is_dir and name in holders):
            extra.append(f"{name}/" if is_dir else name)
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        return f"holds files r2lm did not write ({', '.join(extra[:5])}{more})"
    changed = _changed_files(dst, digests or {})
    if changed:
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        return (f"its {', '.join(changed[:5])}{more} changed since r2lm wrote it (the sha256 differs from {MANIFEST}): "
                "an edit that --overwrite would throw away")
    return None


def _changed_files(dst: Path, digests: dict[str, str]) -> list[str]:
    """The files of `dst` whose sha256 differs from `digests` (those present: a missing one loses nothing)."""
    return [name for name in sorted(digests) if (dst / name).is_file() and sha256_of(dst / name) != digests[name]]


def _check_writable(dst: Path, needed_bytes: int) -> None:
    """Create (and remove) a folder where the temporary folder will go, and compare the free space with the need,
    so that a read-only or full filesystem is reported now, not by a traceback after the model is built."""
    parent = Path(os.path.abspath(dst)).parent
    while not parent.exists():  # the folder the first mkdir of the write will happen in
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"cannot write DST {dst}: {parent} is a file, not a folder")
    probe = _private_path(parent / Path(os.path.abspath(dst)).name, "tmp")
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as err:
        raise ValueError(f"cannot write DST {dst}: {parent} is not writable ({err.strerror}); choose another DST") from None
    free = shutil.disk_usage(parent).free
    if free < needed_bytes:
        raise ValueError(
            f"not enough space for DST {dst}: {parent} has {_size(free)} free and the output needs about "
            f"{_size(needed_bytes)} (the size of the weights); free some space or choose another DST"
        )


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# ----------------------------------------------------------------------------------------------- writing


def write_checkpoint(model, dst: Path, src: Path, overwrite: bool = False, tokenizer=None) -> None:
    """`model.save_pretrained` into `dst`, atomically, with `tokenizer` (default: the tokenizer files of `src`, if
    any) and a generation_config.json: for an R2LM, `src`'s (if any) with the decoding defaults that
    `model.generate` reads added where it has none (block_size, threshold, confidence); for a transformers
    backbone (to-hf), `src`'s as it is."""
    src = Path(src)
    source_config = src / "generation_config.json"
    base = read_generation_config(src)  # a corrupt one is refused, not replaced by defaults or copied
    r2lm = isinstance(model.config, R2LMConfig)
    if r2lm:
        model.generation_config = decoding_generation_config(model.config, base)
    with atomic_output_dir(dst, overwrite) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        else:
            copy_tokenizer_files(src, tmp)
        if source_config.is_file() and not r2lm:
            shutil.copy(source_config, tmp / "generation_config.json")


@contextlib.contextmanager
def atomic_output_dir(dst: Path, overwrite: bool = False):
    """Yield a temporary folder beside `dst`; on success seal it (permissions, manifest) and rename it to `dst`, on
    failure (SIGTERM included, see r2lm/convert/__main__.py) remove it.

    Readers never see a half-written `dst`: it either does not exist, is the old folder, or is complete."""
    dst = Path(os.path.abspath(dst))
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(dst.parent)
    check_replaceable(dst, overwrite)
    tmp = _private_path(dst, "tmp")
    try:
        tmp.mkdir()
        yield tmp
        seal(tmp)
        _swap_into_place(tmp, dst, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s", dst)


def _private_path(dst: Path, kind: str) -> Path:
    """A hidden name beside `dst` for this process's temporary (kind "tmp") or replaced ("old") folder."""
    return dst.with_name(f".{dst.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}@{_HOST}")


def _swap_into_place(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Rename `tmp` to `dst`. An existing `dst` is renamed aside first and removed last, so `dst` is always the old
    folder or the new one; a failure (or SIGTERM) between the two renames puts the old one back.

    `dst` is checked again first, by the same rules as before the work: it may have appeared or changed while the
    output was written (a user's folder, another conversion's output), and only what is replaceable now is."""
    try:
        check_replaceable(dst, overwrite)
    except ValueError as err:
        raise ValueError(f"DST changed while this conversion ran, and its output was not kept: {err}") from None
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
        return
    old = _private_path(dst, "old")
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(folder: Path) -> None:
    """Remove what writers on this host that are gone (a SIGKILL skips every clean-up) left in `folder`: temporary
    folders, and replaced folders after a swap. A writer killed between the two renames of a swap left DST only
    as its replaced folder: that one is renamed back. Live writers' folders and other hosts' are left alone."""
    for path in Path(folder).iterdir():
        match = _PRIVATE.fullmatch(path.name)
        if match is None or match["host"] != _HOST or _alive(int(match["pid"])):
            continue
        dst = path.with_name(match["name"])
        try:
            if match["kind"] == "old" and not os.path.lexists(dst):
                os.rename(path, dst)
                logger.warning("restored %s, which a conversion (process %s) was replacing when it was killed", dst, match["pid"])
            else:
                _remove(path)
                logger.warning("removed %s, left by a killed conversion (process %s)", path, match["pid"])
        except OSError as err:  # another run cleaning up at the same time
            logger.debug("could not clean up %s: %s", path, err)
