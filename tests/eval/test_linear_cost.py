"""eval/linear_cost.py end to end on a tiny checkpoint's shapes: one run times both products at every row count
and writes the table's JSON and PNG; bad input is refused."""

import json

import pytest

from eval import linear_cost
from tests.helpers.models import make_model_dir


def test_the_bench_times_both_products_and_writes_json_and_png(tmp_path, capsys):
    checkpoint = make_model_dir(tmp_path / "model")
    results = linear_cost.main(["--config", str(checkpoint), "--rows", "1", "9", "--repeats", "1", "--threads", "1",
                                "--out", str(tmp_path / "out")])
    assert set(results["rows"]) == {"1", "9"}
    for cell in results["rows"].values():
        assert cell["ms"]["F.linear"] > 0 and cell["ms"]["r2lm"] > 0
        assert cell["speedup"] == pytest.approx(cell["ms"]["F.linear"] / cell["ms"]["r2lm"])
    assert json.loads((tmp_path / "out" / "linear_cost.json").read_text()) == json.loads(json.dumps(results))
    assert (tmp_path / "out" / "linear_cost.png").stat().st_size > 10_000
    assert "F.linear ms" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        linear_cost.main(["--rows", "0", "--out", str(tmp_path / "bad")])
