"""One run at a time in an output_dir: an exclusive flock on OUTPUT_DIR/run.lock while the run lasts.

Rank 0 takes the lock for its whole run (the other ranks of that run work in the folder under it), so a second
run into the same folder is refused, naming the holder (pid, host, start time), before it reads a checkpoint or
writes a file. The kernel drops a flock when its process ends, however it ends: a lock file left behind by a
crashed or killed run holds no lock and blocks nothing. scripts/quickstart.sh takes the same kind of lock
(util-linux `flock`, the same flock(2) lock) on its folder.

The file holds the holder's description (JSON) while it is held and is emptied on release.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = "run.lock"


class OutputDirInUseError(ValueError):
    """Another live process holds the output_dir's lock."""


def describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return f"a process that has not written its pid yet ({text.strip()!r})" if text.strip() else "another process"


def _first_missing(folder: Path) -> Path | None:
    """The outermost folder of `folder` and its parents that does not exist yet (None if `folder` exists)."""
    missing = None
    for path in [folder, *folder.parents]:
        if path.exists():
            return missing
        missing = path
    return missing


class RunLock:
    """An exclusive lock on a run folder, created (with its parents) if needed. Raises OutputDirInUseError.

    `name` is the lock file in the folder, `option` and `target` name what is locked in the messages (defaults: the
    output_dir itself); train/teacher_data.py locks one output file this way, with OUT.lock beside it."""

    def __init__(self, folder: Path, name: str = LOCK_FILE, option: str = "output_dir", target: Path | None = None):
        self.folder = Path(folder)
        self.path = self.folder / name
        what = f"{option} {target if target is not None else self.folder}"
        self.created = _first_missing(self.folder)  # what release(discard=True) may remove again
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            raise ValueError(f"{what}: cannot create {self.path}: {err}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe_holder(self.path.read_text())
            os.close(self.fd)
            raise OutputDirInUseError(
                f"{what} is in use by another run: {holder} (lock file {self.path}); wait for it to end, or choose "
                f"another {option}"
            ) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S %z")
        os.ftruncate(self.fd, 0)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
        os.write(self.fd, (json.dumps(holder) + "\n").encode())

    def release(self, discard: bool = False) -> None:
        """Unlock. discard=True (a run that stopped in validation): also remove the lock file and the folders this
        lock created, if they are still empty, so a refused run leaves nothing behind."""
        if self.fd is None:
            return
        if discard and self.created is not None:
            self.path.unlink(missing_ok=True)
        else:
            os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None
        if discard and self.created is not None:
            for path in [self.folder, *self.folder.parents]:
                try:
                    path.rmdir()  # only ever an empty folder
                except OSError:
                    break
                if path == self.created:
                    break
