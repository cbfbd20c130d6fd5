"""eval/parallel_bench.py end to end on tiny checkpoints: the JSON, the PNG and the results section come from one
run, and the lossless checks it reports (verify == AR, AR == transformers) are the real comparisons."""

import json

import pytest
import torch

from eval import parallel_bench
from tests.helpers.models import make_model_dir
from tests.helpers.training import write_corpus


def test_the_bench_writes_json_png_and_the_results_section(tmp_path):
    before = make_model_dir(tmp_path / "before")
    after = make_model_dir(tmp_path / "after")
    _, heldout = write_corpus(tmp_path / "corpus", n_train=4, n_heldout=40)
    results_md = tmp_path / "results.md"
    results_md.write_text("# Results\n\nkept\n")
    common = ["--text", str(heldout), "--prompts", "2", "--prompt-tokens", "8", "--block-size", "4",
              "--batch-sizes", "1", "2", "--speed-prompts", "2", "--repeats", "1", "--nll-seq-len", "32",
              "--nll-sequences", "2", "--threads", "1", "--out", str(tmp_path / "out"), "--results-md", str(results_md)]
    parallel_bench.main(["--model", f"tiny={before},{after}", "--new-tokens", "8", "--verify", "2", "3:2", "3:lookup",
                         *common])
    data = json.loads((tmp_path / "out" / "parallel.json").read_text())
    speed = data["models"]["tiny"]["after"]["speed"]
    assert set(speed) == {"1", "2"} and speed["1"]["prompts"] == speed["2"]["prompts"] == 2  # batch 1: two prompts
    for v in speed.values():
        assert v["verify_is_ar"] is True and v["ar_is_transformers"] is True
        assert set(v["verify_tokens_per_forward"]) == {"verify@2", "verify@3:2", "verify@3:lookup"}
    # transformers' own prompt lookup beside ours, where it runs (one row); its output checked against AR too
    assert "transformers_lookup" in speed["1"]["vs_ar"] and "transformers_lookup" not in speed["2"]["vs_ar"]
    assert (tmp_path / "out" / "parallel.png").stat().st_size > 10_000
    text = results_md.read_text()
    assert text.startswith("# Results\n\nkept\n") and "verify@2, 3:2, 3:lookup / AR" in text and text.count(parallel_bench.BEGIN) == 1

    # --update measures one model again and keeps the others as they were, under the same settings only
    kept = data["models"]["tiny"]
    with pytest.raises(ValueError, match="new_tokens"):
        parallel_bench.main(["--model", f"again={after},{before}", "--new-tokens", "6", "--update", *common])
    parallel_bench.main(["--model", f"again={after},{before}", "--new-tokens", "8", "--verify", "3", "--update",
                         *common])
    data = json.loads((tmp_path / "out" / "parallel.json").read_text())
    assert list(data["models"]) == ["tiny", "again"] and data["models"]["tiny"] == kept
    assert data["measured"]["tiny"]["verify"] == ["2", "3:2", "3:lookup"] and data["measured"]["again"]["verify"] == ["3"]
    assert "verify@2, 3:2, 3:lookup, 3 / AR" in results_md.read_text()
    with pytest.raises(SystemExit):  # a --verify entry that is not B, B:W or B:lookup: argparse's usage error
        parallel_bench.main(["--model", f"tiny={before},{after}", "--verify", "3:ngram", *common])
    with pytest.raises(SystemExit):  # more prompts to time than --prompts gives
        parallel_bench.main(["--model", f"tiny={before},{after}", *common, "--speed-prompts", "3"])


def test_speed_batches_time_the_same_prompts_a_batch_at_a_time():
    prompts = torch.arange(12).view(6, 2)
    one = parallel_bench.speed_batches(prompts, 4, 1)
    assert [b.tolist() for b in one] == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    assert torch.equal(torch.cat(parallel_bench.speed_batches(prompts, 4, 2)), prompts[:4])
    eight = parallel_bench.speed_batches(prompts, 4, 8)  # one batch, the prompts repeated to fill it
    assert len(eight) == 1 and torch.equal(eight[0], torch.cat([prompts, prompts[:2]]))
    assert [b.shape[0] for b in parallel_bench.speed_batches(prompts, 5, 2)] == [2, 2, 2]  # whole batches


def test_the_results_section_names_each_models_machine():
    """CPU ratios move with the machine: the section says where the run and each kept model were measured."""
    here = {"cpu": "Some CPU", "capability": "AVX2", "cpus": 2, "torch": "2.13.0"}
    results = {"settings": {"prompts": 2, "prompt_tokens": 8, "new_tokens": 8, "block_size": 4, "speed_threshold": 0.9},
               "commit": "abc",
               "machine": here, "models": {},
               "measured": {"new": {"commit": "abc", "machine": here}, "old": {"commit": "def"},
                            "elsewhere": {"commit": "abc", "machine": {**here, "cpu": "Other CPU"}}}}
    intro = parallel_bench.render(results).splitlines()[2]
    assert "(commit abc, Some CPU, AVX2, 2 cores; kept from earlier runs (`--update`): old at def, machine not " \
           "recorded, elsewhere at abc, Other CPU, AVX2, 2 cores)" in intro
    assert "new at" not in intro
