"""eval/lossless_bench.py end to end on a tiny transformers Qwen3 converted to an R2LM target, an untrained drafter
and a real drafter training run: the JSON, the PNG and the results section come from one run, every verified output
is compared with AR's (and a differing one is caught), HumanEval runs through its real harness, and bad input is
refused before anything is written."""

import json
import math

import pytest
import torch
from transformers import AutoTokenizer

from eval import lossless_bench, lossless_speed
from eval.decoders import category_prompts, r2lm_decoder
from eval.drafter_curve import merge_runs
from eval.humaneval import completion_of, score
from eval.lossless_report import BEGIN, END, interval, intervals, noise_floor, per_doubling, render
from r2lm import R2LMForDiffusionLM
from r2lm.checkpoints import read_state, tag_of
from r2lm.convert.from_hf import convert_from_hf
from r2lm.drafter import Drafter, DrafterConfig
from r2lm.ngram import NGramTable
from r2lm.workloads import humaneval_problems, is_heldout
from tests.helpers.models import sharp_hf, tiny_tokenizer
from tests.helpers.training import drafter_overrides, run_inprocess, teacher_records
from train.tracking import read_metrics

# the tiny tokenizer has no chat template: chat prompts go through this one (ChatML with its own specials)
CHAT = ("{% for m in messages %}<|pad|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|pad|>assistant\n{% endif %}")
DOCS = ("# Results\n\nkept\n\n<!-- parallel decoding: begin (eval/parallel_bench.py) -->\nother\n"
        "<!-- parallel decoding: end -->\n")


def chat_target(root):
    """A tiny transformers Qwen3 with a chat template saved in root/hf, converted to an R2LM target in root/target
    (block size 4, no sidecars); returns the target's folder."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT
    # one id above the tokenizer's: convert from-hf adds [MASK] there, the vocabulary's last id
    hf = sharp_hf("qwen3", vocab_size=len(tokenizer) + 1, max_position_embeddings=2048,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    hf.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    return convert_from_hf(root / "hf", root / "target", sidecar_layers=[], block_size=4)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """(root, transformers source, R2LM target, untrained drafter, drafter training run)."""
    root = tmp_path_factory.mktemp("lossless")
    target = chat_target(root)
    target_config = R2LMForDiffusionLM.from_pretrained(target).config
    assert target_config.mask_token_id == target_config.vocab_size - 1
    torch.manual_seed(1)
    Drafter(DrafterConfig.for_target(target_config, block_size=4)).save_pretrained(root / "drafter")
    # a drafter trained for a few steps on the target's own text: two checkpoints for the curve
    ids = [f"sharegpt/t{i}" for i in range(100) if not is_heldout(f"t{i}")][:12]
    train = teacher_records(target, root / "train.jsonl", 12, seed=0, ids=ids)
    heldout = teacher_records(target, root / "heldout.jsonl", 4, seed=1)
    run = root / "run"
    run_inprocess(drafter_overrides((root, target, train, heldout), run))
    return root, root / "hf", target, root / "drafter", run


def common(root, *extra, results_md: bool = True):
    return ["--speed-prompts", "2", "--max-prompt-tokens", "600", "--new-tokens", "8", "--block-size", "3",
            "--humaneval-problems", "2", "--humaneval-new-tokens", "10", "--humaneval-batch-size", "2",
            "--curve-prompts", "1", "--threads", "1", "--out", str(root / "out"),
            *(["--results-md", str(root / "results.md")] if results_md else []), *extra]


def test_the_bench_writes_json_png_and_only_its_section(inputs):
    root, hf, target, drafter, run = inputs
    results_md = root / "results.md"
    results_md.write_text(DOCS + "\n" + BEGIN + "\nplaceholder\n" + END + "\n\nafter\n")
    # window drafts: the same backbone with (untrained) sidecars, the baseline a drafter is compared with
    window = convert_from_hf(hf, root / "window", sidecar_layers=[1], block_size=4)
    vocab = R2LMForDiffusionLM.from_pretrained(target).config.vocab_size  # a table of random text: drafts, often wrong
    NGramTable.build([torch.randint(0, vocab, (500,), generator=torch.Generator().manual_seed(0)).tolist()], vocab,
                     min_count=1).save(root / "table")
    lossless_bench.main(["--target", str(target), "--reference", str(hf), "--drafter", f"untrained={drafter}",
                         "--ngram", f"table={root / 'table'}",
                         "--window", f"sidecars={window}", "--curve", str(run), "--batch-sizes", "1", "2",
                         "--untrained", "--policies", "adaptive", "longest", *common(root)])
    raw = (root / "out" / "lossless.json").read_text()
    assert str(root) not in raw  # models and runs by name, packages by name and version: no path of this machine
    data = json.loads(raw)
    assert set(data["parts"]) == {"speed", "humaneval", "curve"} and data["verify_is_ar"] is True
    assert data["target"] == "target" and data["packages"]["torch"] == torch.__version__
    speed = data["parts"]["speed"]
    assert set(speed["batches"]) == {"1", "2"}
    verified = {"verify:lookup", "verify:untrained", "verify:lookup+untrained", "verify:sidecars", "verify:window",
                "verify:fresh", "verify:lookup+fresh", "verify:table", "verify:lookup+table",
                "verify:lookup+table+untrained", "verify:lookup+table+fresh"}
    verified |= {f"{name}@longest" for name in verified}  # every verified decoder under both policies
    for batch, entries in speed["batches"].items():
        assert set(entries) == {"code", "chat", "prose", "all"}
        for e in entries.values():
            # every output compared with AR's, and AR's with transformers' greedy output of the source checkpoint
            assert e["verify_is_ar"] is True and e["ar_is_transformers"] is True
            assert set(e["tau"]) == verified and all(v >= 1 for v in e["tau"].values())
            # the same text from every lossless decoder: the same token count (threshold decoding is lossy)
            assert len({v for k, v in e["tokens"].items() if k != "threshold"}) == 1
            assert e["differing_rows"]["ar_again"] == 0 and e["vs_ar"]["ar_again"] > 0  # the noise floor's control
            assert ("transformers_lookup" in e["vs_ar"]) == (batch == "1") == ("vs_transformers_lookup" in e)
            rows = e["threshold_rows"]  # default decoding computes no more rows than every row in every forward
            assert 0 < rows["decoding"] <= rows["computed"] <= rows["all_forwards"]
    ones = speed["batches"]["1"]
    assert ones["all"]["tokens"]["ar"] == sum(ones[c]["tokens"]["ar"] for c in ("code", "chat", "prose"))
    assert speed["prompt_ids"]["chat"][0].startswith("sharegpt/") and speed["prompt_ids"]["code"] == \
        ["HumanEval/0", "HumanEval/1"]
    humaneval = data["parts"]["humaneval"]
    assert list(humaneval["decoders"]) == ["ar", "verify:lookup+untrained", "verify:lookup+fresh", "threshold@0.9"]
    assert humaneval["problems"] == 2 and humaneval["verify_is_ar"] is True
    assert humaneval["decoders"]["verify:lookup+untrained"]["same_as_ar"] == 2
    curve = data["parts"]["curve"]["runs"][0]
    assert [p["step"] for p in curve["points"]] == [3, 6]  # every checkpoint, reassembled from its shards
    # the training tokens each checkpoint's trainer state records
    recorded = [read_state(run / "checkpoints" / tag_of(k))["tokens"] for k in (3, 6)]
    assert [p["tokens"] for p in curve["points"]] == recorded
    assert 0 < curve["points"][0]["tokens"] < curve["points"][1]["tokens"]
    assert [e["step"] for e in curve["eval_tau"]] == [0, 3, 6] and curve["eval_tau"][0]["tokens"] == 0
    assert all(set(p["tau"]) == {"code", "chat", "prose"} for p in curve["points"])
    logged = {r["step"]: r["tau"] for r in read_metrics(run, "train")}  # each point beside its run's batches' τ
    assert [p["train_tau"] for p in curve["points"]] == pytest.approx([sum(logged[k] for k in range(1, 4)) / 3,
                                                                       sum(logged[k] for k in range(1, 7)) / 6])
    assert curve["data"] == "train.jsonl, text tokens" and curve["measured"]["commit"] == data["commit"]
    assert curve["recipe"] == "1 drafter layer"
    for part in data["parts"].values():
        assert part["measured"]["machine"] == data["machine"] and "linear_orders" in part["measured"]
    assert (root / "out" / "lossless.png").stat().st_size > 10_000
    assert sorted(p.name for p in (root / "out").iterdir()) == ["lossless.json", "lossless.png"]
    text = results_md.read_text()
    assert text.startswith(DOCS + "\n" + BEGIN + "\n## Lossless decoding\n")
    assert text.endswith(END + "\n\nafter\n") and "placeholder" not in text
    assert "verify:lookup+untrained" in text and "| prose | 2 |" in text and "| run | 3 |" in text
    assert speed["timing"] == "bracketed" and "the AR decodes just before and after it" in text
    for e in speed["batches"]["1"].values():  # every decoder but AR timed against the AR decodes around it each pass
        assert set(e["against_ar"]) == set(e["vs_ar"]) - {"ar"} and all(
            len(passes) == speed["settings"]["repeats"] and min(map(min, passes)) > 0 for passes in e["against_ar"].values())
    # the costs the policy measured, by source: a forward of each width at the call's rows and at one row
    assert set(speed["costs"]) == {"lookup", "window", "untrained", "lookup+untrained", "fresh", "lookup+fresh", "table",
                                   "lookup+table", "lookup+table+untrained", "lookup+table+fresh"}
    lookup = speed["costs"]["lookup"]
    assert set(lookup["verify"]) == {"1", "2"} and set(lookup["verify"]["2"]) == {"1", "2", "3"}
    assert lookup["draft"]["1"] == 0 and speed["costs"]["untrained"]["draft"]["1"] > 0
    assert "| lookup | 2 | " in text and "| lookup+untrained | 1 | " in text
    assert "Window drafts sidecars:" in text and speed["windows"]["sidecars"]["sidecar_layers"] == [1]

    # --update measures the parts given again and keeps the others as they were; without --results-md a run whose
    # --out is not docs/results leaves every markdown as it was (the figures of record among them)
    record = lossless_bench.DEFAULT_RESULTS_MD.read_text()
    lossless_bench.main(["--target", str(target), "--curve", str(run), "--parts", "curve", "--update",
                         "--curve-points", "1", *common(root, results_md=False)])
    again = json.loads((root / "out" / "lossless.json").read_text())
    assert again["parts"]["speed"] == speed and again["parts"]["humaneval"] == humaneval
    assert [[p["step"] for p in r["points"]] for r in again["parts"]["curve"]["runs"]] == [[6]]  # the last always
    assert results_md.read_text() == text and lossless_bench.DEFAULT_RESULTS_MD.read_text() == record


def test_curves_of_other_runs_measured_before_stay_beside_the_new_ones():
    """--update --parts curve replaces the runs it measures again and keeps the others, each with the commit and
    machine it was measured at, only where the settings that change τ match."""
    settings = {"categories": ["code"], "curve_prompts": 2, "max_prompt_tokens": 1024, "new_tokens": 96,
                "curve_points": 8, "threads": 2}
    machine = {"cpu": "Intel(R) Xeon(R) Processor", "capability": "AVX512", "cpus": 2}
    point = {"step": 100, "tokens": 409_600, "tau": {"code": 1.05}}
    old = {"settings": settings, "measured": {"commit": "b40c813", "machine": machine, "linear_orders": {}},
           "runs": [{"run": "teacher", "points": [point], "eval_tau": []},
                    {"run": "text", "points": [point], "eval_tau": []}]}
    now = [{"run": "text", "data": "text.jsonl, target's distributions", "recipe": "3 drafter layers, replay 0.5",
            "points": [{**point, "step": 50}], "eval_tau": [], "measured": {"commit": "c0ffee0", "machine": {**machine, "cpu": "AMD EPYC"}}}]
    merged = merge_runs(old, now, {**settings, "curve_points": 17, "threads": 1})
    assert [r["run"] for r in merged] == ["text", "teacher"]
    assert merged[1]["measured"] == {"commit": "b40c813", "machine": machine} and merged[0] == now[0]
    assert merge_runs(old, now, {**settings, "new_tokens": 64}) == now  # another τ: not one table
    text = render({"target": "t", "parts": {"curve": {"settings": settings, "runs": merged,
                                                      "measured": {"commit": "c0ffee0", "machine": machine}}}})
    assert "- text: text.jsonl, target's distributions; 3 drafter layers, replay 0.5; commit c0ffee0" in text
    assert "- teacher: data not recorded; drafter not recorded; commit b40c813, Intel" in text
    assert "| teacher | 100 | 409,600 | 1.05 | - |" in text and "| text | 50 |" in text
    # what more data buys: τ per doubling of tokens over a run's later checkpoints (here τ = 1 + 0.1 log2(tokens / 1M))
    points = [{"step": i, "tokens": 2 ** i * 1_000_000, "tau": {"code": 1 + 0.1 * i, "chat": 1 + 0.1 * i}}
              for i in range(6)]
    slope, first, last = per_doubling(points, ["code", "chat"])
    assert slope == pytest.approx(0.1) and (first, last) == (8_000_000, 32_000_000)
    assert per_doubling(points[:1], ["code"]) is None


def test_each_decoder_is_timed_between_two_ar_decodes():
    sequence = lossless_speed.bracketed(["x", "ar", "a", "b", "c", "d", "e"])
    assert sequence == ["ar", "x", "a", "b", "ar", "c", "d", "e", "ar"] and lossless_speed.AR_EVERY == 3
    assert lossless_speed.bracketed(["ar"]) == ["ar"]  # AR alone: timed once


def test_a_cell_is_the_median_pass_against_the_ar_decodes_around_it():
    """A pass's × AR is the decoder's seconds against the AR decodes around it; a cell the median over passes, the
    categories together summing each pass's seconds (tokens/s still counts each batch's fastest decode)."""
    def entry(passes):
        return {"prompts": 1, "tokens": {"ar": 100, "x": 100}, "forwards": {"x": 50},
                "seconds": {"ar": 1.0, "x": 2.0}, "differing_rows": {"x": 0}, "against_ar": {"x": passes}}

    one = lossless_speed.with_ratios(entry([[1.0, 1.0], [1.0, 2.0], [3.0, 2.0]]))
    assert one["vs_ar"] == {"ar": 1.0, "x": 1.0} and one["tokens_per_s"]["x"] == 50.0
    assert one["step_cost_vs_ar"]["x"] == 2.0  # τ 2 at 1.0x AR: a step costs two AR steps
    both = lossless_speed.total([entry([[1.0, 1.0], [1.0, 2.0], [3.0, 2.0]]), entry([[3.0, 1.0], [1.0, 2.0], [1.0, 2.0]])])
    assert both["against_ar"]["x"] == [[4.0, 2.0], [2.0, 4.0], [4.0, 4.0]] and both["vs_ar"]["x"] == 1.0


def test_a_run_whose_identical_decoders_differ_is_marked_not_quiet():
    """The report states each run's noise floor (ar_again: AR timed again as a decoder of its own), and marks a run
    where it left 0.97-1.03x as not quiet (the machine's speed moved: its cells do not tell a decoder from AR)."""
    def cell(again):
        return {"vs_ar": {"ar": 1.0, "ar_again": again, "verify:lookup": 1.2}, "tau": {"verify:lookup": 1.4},
                "tokens_per_s": {"ar": 30.0}, "verify_is_ar": True, "ar_is_transformers": True}

    def part(again):
        speed = {"settings": {"max_prompt_tokens": 1024, "new_tokens": 64, "block_size": 8, "repeats": 3},
                 "measured": {"commit": "c0ffee0", "machine": {"cpu": "AMD EPYC", "capability": "AVX2", "cpus": 2}},
                 "reference": "r",
                 "prompt_ids": {"code": [1], "chat": [2]}, "drafters": {},
                 "batches": {"1": {"code": cell(again[0]), "chat": cell(again[1])}}}
        return speed, render({"target": "t", "parts": {"speed": speed}})

    speed, text = part([0.99, 1.02])
    assert noise_floor(speed) == (0.99, 1.02)
    assert "Noise floor: ar_again ran 0.99x-1.02x AR" in text and "Not a quiet run" not in text
    speed, text = part([0.94, 1.01])
    assert noise_floor(speed) == (0.94, 1.01)
    assert "**Not a quiet run**: ar_again, the same AR decoding timed again, ran 0.94x-1.01x AR" in text
    assert "Not a quiet run" in part([1.0, 1.05])[1]
    assert "Noise floor: ar_again ran 0.97x-1.00x AR" in part([0.966, 1.0])[1]  # judged as the cells show it


def test_a_cell_wholly_under_the_floor_is_told_from_one_that_only_reaches_under_it():
    """Each verified cell's 90% interval over its passes (Student's t over the log ratios): passes all near 0.90x
    lie wholly under the 0.97x floor; passes spread around 1.00x reach under it and are not named; "all" pools the
    categories' passes. A single pass gives no interval."""
    assert interval([[1.0, 1.0], [2.0, 2.0]]) == (1.0, 1.0) and interval([[1.0, 1.0]]) is None
    lo, hi = interval([[2.0, 1.0], [1.0, 1.0]])  # log ratios ln 2 and 0: mean ln 2 / 2, its standard error too
    assert math.isclose(lo, math.exp(math.log(2) / 2 * (1 - 6.314))) and math.isclose(hi, math.exp(math.log(2) / 2 * (1 + 6.314)))

    def cell(passes):
        return {"vs_ar": {"ar": 1.0, "verify:lookup": 0.9}, "tau": {"verify:lookup": 1.0}, "tokens_per_s": {"ar": 30.0},
                "verify_is_ar": True, "ar_is_transformers": True, "against_ar": {"verify:lookup": passes}}

    slow, spread = [[0.90, 1.0], [0.91, 1.0], [0.89, 1.0]], [[0.95, 1.0], [1.05, 1.0], [1.0, 1.0]]
    speed = {"settings": {"max_prompt_tokens": 1024, "new_tokens": 64, "block_size": 8, "repeats": 3},
             "measured": {"commit": "c0ffee0", "machine": {"cpu": "AMD EPYC", "capability": "AVX2", "cpus": 2}},
             "reference": "r", "prompt_ids": {"code": [1], "chat": [2]}, "drafters": {},
             "batches": {"1": {"code": cell(slow), "chat": cell(spread), "all": cell([[1.0, 1.0]] * 3)}}}
    pooled = intervals(speed, ["verify:lookup"])[("1", "all")]["verify:lookup"]
    assert pooled == interval(slow + spread)
    text = render({"target": "t", "parts": {"speed": speed}})
    assert "Wholly under it: code at batch 1 lookup; reaching under it: 2 cell(s)." in text
    assert "| code | 1 | 0.88-0.92 |" in text


def test_a_verified_output_that_differs_from_ar_is_reported(inputs):
    """The check is a real comparison: a lossy decoder in the verified rows (threshold decoding, accepting nearly
    every guess) makes verify_is_ar False, and its differing rows are counted."""
    root, _, target, _, _ = inputs
    args = lossless_bench.build_parser().parse_args(["--target", str(target), *common(root)])
    s = lossless_bench.load_setup(args)
    prompts = [ids for _, ids in category_prompts("prose", 2, s.tokenizer, 600)]
    decoders = {"ar": (r2lm_decoder(s.plain, s.eos, s.pad, block_size=1), False),
                "verify:lossy": (r2lm_decoder(s.target, s.eos, s.pad, threshold=0.01), False)}
    e = lossless_speed.speed("prose", prompts, decoders, args, 1, s.pad)
    assert e["verify_is_ar"] is False and e["differing_rows"]["verify:lossy"] == 2


def test_humaneval_scoring_runs_the_harness():
    """pass@1 comes from running each completion against its tests: the canonical body passes, so does a whole
    function after the prompt's stub, a wrong body fails; a reply is scored on its first code block."""
    problems = list(humaneval_problems().values())[:2]
    right = [p["canonical_solution"] for p in problems]
    whole = ["\n" + p["prompt"] + p["canonical_solution"] for p in problems]  # the function a reply defines
    wrong = ["    return None\n"] * 2
    passed = score(problems, {"right": right, "whole": whole, "wrong": wrong}, timeout=5.0)
    assert passed == {"right": [True, True], "whole": [True, True], "wrong": [False, False]}

    class Text:
        def decode(self, row, skip_special_tokens):
            return row[0]

    reply = "Here it is:\n```python\ndef f(x):\n    return 1\n```\nIt returns 1."
    assert completion_of(Text(), [reply]) == "\ndef f(x):\n    return 1"
    assert completion_of(Text(), ["```py\n    return 1"]) == "\n    return 1"  # cut by the budget
    assert completion_of(Text(), ["no code"]) == "\nno code"


@pytest.mark.parametrize("extra, message", [
    (["--drafter", "d=NOWHERE"], "does not exist"),
    (["--categories", "poetry"], "invalid choice: 'poetry'"),
    (["--speed-prompts", "0"], "must be a positive integer, got 0"),
    (["--humaneval-problems", "0"], "must be a positive integer, got 0"),
    (["--drafter", "lookup=DRAFTER"], "not 'lookup'"),
    (["--parts", "curve"], "give at least one --curve RUN_DIR"),
    (["--window", "w=NOWHERE"], "is not a model folder"),
    (["--drafter", "x=DRAFTER", "--window", "x=DRAFTER"], "names must differ"),
    (["--ngram", "t=DRAFTER"], "is not an n-gram table folder"),
    (["--policies", "adaptive", "adaptive"], "lists a policy twice"),
    (["--out", "DRAFTER/config.json"], "is a file, not a folder"),
    (["--results-md", "DRAFTER"], "is a folder, not a file"),
])
def test_bad_input_is_refused_before_anything_is_written(inputs, tmp_path, capsys, extra, message):
    root, _, target, drafter, _ = inputs
    extra = [x.replace("NOWHERE", str(tmp_path / "missing")).replace("DRAFTER", str(drafter)) for x in extra]
    for option, path in (("--out", tmp_path / "out"), ("--results-md", tmp_path / "results.md")):
        if option not in extra:
            extra += [option, str(path)]
    with pytest.raises(SystemExit):  # (issue 40 item 7: the output paths were checked after measuring everything)
        lossless_bench.main(["--target", str(target), *extra])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "results.md").exists()


def test_window_drafts_need_sidecars(inputs, tmp_path):
    """--window takes a model with sidecars on the target's backbone: the target itself (no sidecars) is refused
    when the models load, before anything is measured or written."""
    root, _, target, _, _ = inputs
    with pytest.raises(ValueError, match="through sidecars"):
        lossless_bench.main(["--target", str(target), "--window", f"none={target}", "--out", str(tmp_path / "out"),
                             "--results-md", str(tmp_path / "results.md")])
    assert not (tmp_path / "out").exists() and not (tmp_path / "results.md").exists()


def test_a_drafter_of_another_target_is_refused_before_measuring(inputs, tmp_path):
    """A --drafter folder or a --curve run made for another target is refused when the models load, naming what
    differs, not after the other parts were measured."""
    root, _, target, _, run = inputs
    config = R2LMForDiffusionLM.from_pretrained(target).config
    other = DrafterConfig.for_target(config, block_size=4, target_num_hidden_layers=config.num_hidden_layers + 1)
    Drafter(other).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="made for another target: layer count"):
        lossless_bench.main(["--target", str(target), "--drafter", f"other={tmp_path / 'other'}", "--out",
                             str(tmp_path / "out"), "--results-md", str(tmp_path / "results.md")])
    bigger = tmp_path / "bigger"  # the run's target with a wider vocabulary: its drafter no longer fits
    R2LMForDiffusionLM.from_pretrained(target, vocab_size=config.vocab_size + 2, ignore_mismatched_sizes=True) \
        .save_pretrained(bigger)
    AutoTokenizer.from_pretrained(target).save_pretrained(bigger)
    with pytest.raises(ValueError, match="made for another target: vocabulary"):
        lossless_bench.main(["--target", str(bigger), "--curve", str(run), "--categories", "prose", "--out",
                             str(tmp_path / "out"), "--results-md", str(tmp_path / "results.md")])
    assert not (tmp_path / "out").exists() and not (tmp_path / "results.md").exists()
