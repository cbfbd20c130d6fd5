"""The machine a CPU benchmark ran on, written beside its figures. Its ratios move with the machine: what a
4-row matrix product costs against a 1-row one (so what a verification forward costs against an AR step)
depends on the CPU, its vector width and its memory bandwidth (eval/linear_cost, SmolLM2-135M's weights, on two
of this project's 2-core machines: one row's products 20 ms on one and 68 ms on the other)."""

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
