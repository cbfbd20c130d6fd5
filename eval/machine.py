"""The machine a CPU benchmark ran on, written beside its figures. Its ratios move with the machine: what a
4-row matrix product costs against a 1-row one (so what a verification forward costs against an AR step)
depends on the CPU, its vector width and its memory bandwidth (eval/linear_cost has the figures per machine in
docs/results.md); and so does which order r2lm.ops.linear multiplies few rows in (`linear_orders`)."""

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


def linear_orders() -> dict:
    """r2lm.ops.linear's decisions so far in this process, per row count: the weight shapes multiplied in each
    order ({"1": {"F.linear": ["576x576", ...], "kernel": [...]}}); r2lm.ops.linear.decisions() has the timings."""
    from r2lm.ops.linear import decisions

    by_rows: dict = {}
    for d in decisions():
        orders = by_rows.setdefault(str(d["rows"]), {})
        orders.setdefault(d["order"], []).append("x".join(map(str, d["weight"])))
    return by_rows
