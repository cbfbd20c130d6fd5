"""scripts/make_results.py rewrites its own report at the head of docs/results.md and keeps the sections after it
(eval/parallel_bench.py's, hand-written ones) as they were. Before: it rewrote the whole file, deleting them."""

import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

PARALLEL = "<!-- parallel decoding: begin (eval/parallel_bench.py) -->\n## Parallel decoding\n\n| a | b |\n<!-- parallel decoding: end -->\n"
BY_HAND = "<!-- measured figures: begin (by hand) -->\n## Measured\n\nkept byte for byte: 0.07 s\n<!-- measured figures: end -->\n"


def make_results(run: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "make_results.py"), str(run), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_sections_after_the_report_are_kept(tmp_path):
    run, out = tmp_path / "run", tmp_path / "docs" / "results.md"
    run.mkdir()
    out.parent.mkdir()
    out.write_text("# An old report\n\nold numbers\n\n" + PARALLEL + "\n" + BY_HAND)
    done = make_results(run, out)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.startswith("# Small-scale reproduction") and "old numbers" not in text
    assert text.endswith("```\n\n" + PARALLEL + "\n" + BY_HAND)
    assert not list(out.parent.glob(".*.tmp"))


def test_a_file_without_sections_gets_the_report_alone(tmp_path):
    run, out = tmp_path / "run", tmp_path / "results.md"
    run.mkdir()
    assert make_results(run, out).returncode == 0
    assert out.read_text().startswith("# Small-scale reproduction") and "<!--" not in out.read_text()
