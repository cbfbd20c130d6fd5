"""eval/first_call.py end to end on a tiny checkpoint: r2lm-generate processes in each state, the files the kept
states load made first, every verified text AR's, the table's JSON and PNG written; bad input is refused."""

import json

import pytest
from transformers import AutoTokenizer

from eval import first_call
from tests.helpers.models import make_model_dir

CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.mark.slow  # eight r2lm-generate processes, each importing torch and transformers: about a minute
def test_the_bench_times_first_calls_in_each_state_and_writes_json_and_png(tmp_path, capsys):
    checkpoint = make_model_dir(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(checkpoint)
    results = first_call.main(["--checkpoint", str(checkpoint), "--batch-sizes", "2", "--runs", "1",
                               "--max-new-tokens", "4", "--out", str(tmp_path / "out")])
    cell = results["batches"]["2"]
    assert list(cell["seconds"]) == list(first_call.STATES)
    for state, row in cell["seconds"].items():
        assert set(row) == {"AR", "lookup"} and all(s > 0 for s in row.values())  # no drafter ships for it
        assert cell["x_ar"][state]["lookup"] == pytest.approx(row["AR"] / row["lookup"])
    assert cell["same_text"] == {"AR": True, "lookup": True}
    assert json.loads((tmp_path / "out" / "first_call.json").read_text()) == json.loads(json.dumps(results))
    assert (tmp_path / "out" / "first_call.png").stat().st_size > 10_000
    assert "costs + orders kept" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        first_call.main(["--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "bad")])
    with pytest.raises(SystemExit):
        first_call.main(["--checkpoint", str(checkpoint), "--runs", "0", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()
