"""scripts/gpu_check.sh --dry-run: the GPU machine's checks, run on CPU at tiny sizes, print one table of ok rows."""

import json

import pytest

from tests.helpers.processes import run_cli

pytestmark = pytest.mark.slow  # it launches a training run through the deepspeed launcher

ROWS = ["kernel ssd", "kernel conv1d", "flex dual stream L=64", "flex padded prompt grid L=64", "hybrid chunked",
        "train fp32", "decode batch 1", "decode batch 2", "verify == AR (fp32)"]


def test_dry_run_prints_a_table_of_passing_checks(tmp_path):
    out = run_cli(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path)], timeout=600,
                  env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("check"))
    table = {line.split("  ")[0].strip(): line for line in lines[header + 2 :] if line.strip()}
    assert list(table) == ROWS, out.stdout
    for name, line in table.items():
        assert line[len(name):].split()[0] == "ok", line
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [r["check"] for r in rows] == ROWS and all(r["status"] == "ok" for r in rows)
    assert "held-out" in table["train fp32"] and "tok/s AR" in table["decode batch 1"]
