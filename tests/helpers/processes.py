"""Subprocesses the tests start: a program in the repository root with it importable (the `tests` package
included), the real deepspeed launcher, a free TCP port for a launch's rendezvous."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from . import REPO

DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")  # this environment's launcher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(args: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """A subprocess in the repository root with it on PYTHONPATH (r2lm is not installed in the test venv; the
    `tests` package is importable too)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", **(env or {})}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)  # an in-process run of this pytest process set them for itself
    return subprocess.run(args, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def python(*args: str) -> list[str]:
    return [sys.executable, *args]
