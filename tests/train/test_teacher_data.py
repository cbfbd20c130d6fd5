"""train/teacher_data.py: teacher continuations for certainty forcing. Records continue their prompts exactly as
generate() does, are deterministic for a seed, resume after a kill, and bad input stops before the teacher loads."""

import json
import os
import shutil
import socket

import pytest
import torch
from transformers import AutoTokenizer

from r2lm import R2LMForDiffusionLM, generate
from r2lm.text import encode
from tests.helpers.models import make_model_dir, sharp_hf, tiny_tokenizer
from tests.helpers.processes import python, run_cli
from tests.helpers.training import corpus_paragraphs, write_corpus
from train.config import DataConfig
from train.data import load_documents
from train.lock import RunLock
from train.sources import resolve_source
from train.teacher_data import Teacher, build_parser, generate_records

PROMPT_TOKENS = 12


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher")
    model = make_model_dir(root / "model")
    _, heldout = write_corpus(root / "corpus", n_train=10, n_heldout=30)
    return root, model, heldout


def run(*args: str) -> int:
    return generate_records(build_parser().parse_args(list(args)))


def common(teacher, prompts, out, *extra):
    return ["--teacher", str(teacher), "--prompts", str(prompts), "--out", str(out), "--prompt-tokens",
            str(PROMPT_TOKENS), "--max-new-tokens", "16", "--batch-size", "3", *extra]


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_are_prompt_plus_the_teachers_continuation(inputs, tmp_path):
    root, model_dir, heldout = inputs
    out = tmp_path / "greedy.jsonl"
    assert run(*common(model_dir, heldout, out, "--max-prompts", "7", "--student", str(model_dir))) == 7
    got = records(out)
    assert [r["index"] for r in got] == list(range(7))
    # independently: the first PROMPT_TOKENS tokens of the held-out paragraphs, continued by generate() one at a time
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = R2LMForDiffusionLM.from_pretrained(model_dir).eval()
    paragraphs = corpus_paragraphs(30, seed=1)
    for rec, ids in zip(got, [ids for ids in encode(tokenizer, paragraphs) if len(ids) >= PROMPT_TOKENS], strict=False):
        prompt = torch.tensor([ids[:PROMPT_TOKENS]])
        new = generate(model, prompt, max_new_tokens=16, eos_token_id=tokenizer.eos_token_id).sequences[0, PROMPT_TOKENS:]
        new = new.tolist()[: new.tolist().index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in new else new.tolist()
        ended = rec["finished"]
        assert ended == (new[-1] == tokenizer.eos_token_id)
        assert rec["ids"] == ids[:PROMPT_TOKENS] + new  # the tokens as generated, EOS included
        assert rec["text"] == tokenizer.decode(ids[:PROMPT_TOKENS]) + tokenizer.decode(new[: len(new) - ended],
                                                                                         skip_special_tokens=True)
        assert rec["prompt_tokens"] == PROMPT_TOKENS and rec["new_tokens"] == len(new) - ended
    # the training pipeline reads the file as it is: one document per record
    docs = load_documents(resolve_source(str(out)), DataConfig(train=str(out)), streaming=False)
    assert list(docs["text"]) == [r["text"] for r in got]
    assert resolve_source(str(tmp_path)).files == [str(out)]  # the settings file beside it is no data file


CHATML = ("{% for m in messages %}<|pad|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|pad|>assistant\n{% endif %}")


def test_chat_prompts_go_through_the_chat_template(inputs, tmp_path):
    """--chat: each document is a user turn; the record's ids start with the template's tokens (its special tokens
    real ones, not spelled out), and a tokenizer without a template is refused before the teacher loads."""
    root, model_dir, _ = inputs
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"conv{i}", "text": t}) + "\n"
                               for i, t in enumerate(["the quick brown fox", "a lazy dog"])))
    args = ["--teacher", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "8", "--batch-size", "2", "--chat",
            "--id-field", "id"]
    with pytest.raises(ValueError, match="no chat template"):
        run(*args, "--out", str(tmp_path / "none.jsonl"))
    chat_model = tmp_path / "chat_model"
    shutil.copytree(model_dir, chat_model)
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(chat_model)
    args[1] = str(chat_model)
    assert run(*args, "--out", str(tmp_path / "chat.jsonl")) == 2
    for rec, text in zip(records(tmp_path / "chat.jsonl"), ["the quick brown fox", "a lazy dog"], strict=True):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        expected = tokenizer(rendered, add_special_tokens=False).input_ids
        assert rec["ids"][: rec["prompt_tokens"]] == expected and rec["prompt_tokens"] == len(expected)
        assert expected.count(tokenizer.pad_token_id) == 2  # <|pad|> as one special token, twice
    assert [rec["id"] for rec in records(tmp_path / "chat.jsonl")] == ["conv0", "conv1"]  # --id-field, kept


def test_an_ar_teacher_reports_one_token_per_step(inputs, tmp_path, caplog):
    """--block-size 1: a row gains one token a step while it decodes; the steps a stopped row waits while others
    decode do not count. (A second EOS id, the first token one row generates, stops that row at once.)"""
    from transformers import GenerationConfig

    root, model_dir, heldout = inputs
    teacher = tmp_path / "teacher"
    shutil.copytree(model_dir, teacher)
    args = ["--max-prompts", "3", "--block-size", "1"]
    run(*common(teacher, heldout, tmp_path / "first.jsonl", *args))
    first = records(tmp_path / "first.jsonl")
    stop = first[0]["ids"][first[0]["prompt_tokens"]]
    eos = AutoTokenizer.from_pretrained(teacher).eos_token_id
    GenerationConfig(eos_token_id=[eos, stop]).save_pretrained(teacher)
    with caplog.at_level("INFO"):
        run(*common(teacher, heldout, tmp_path / "ar.jsonl", *args))
    lengths = [r["new_tokens"] + r["finished"] for r in records(tmp_path / "ar.jsonl")]
    assert lengths[0] == 1 and max(lengths) > 1  # row 0 stopped at once, another decoded on
    assert "1.00 tokens per denoising step" in caplog.text


def test_sampling_is_deterministic_for_a_seed(inputs, tmp_path):
    root, model_dir, heldout = inputs
    sample = ["--max-prompts", "5", "--temperature", "1.0"]
    run(*common(model_dir, heldout, tmp_path / "a.jsonl", *sample, "--seed", "3"))
    run(*common(model_dir, heldout, tmp_path / "b.jsonl", *sample, "--seed", "3"))
    run(*common(model_dir, heldout, tmp_path / "c.jsonl", *sample, "--seed", "4"))
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert records(tmp_path / "a.jsonl") != records(tmp_path / "c.jsonl")
    greedy = tmp_path / "greedy.jsonl"
    run(*common(model_dir, heldout, greedy, "--max-prompts", "5"))
    assert records(greedy) != records(tmp_path / "a.jsonl")  # it did sample


def test_resume_appends_only_what_is_missing(inputs, tmp_path, caplog):
    root, model_dir, heldout = inputs
    sample = ["--temperature", "1.0", "--seed", "1"]
    full = tmp_path / "full.jsonl"
    assert run(*common(model_dir, heldout, full, "--max-prompts", "8", *sample)) == 8
    reference = full.read_bytes()
    lines = reference.splitlines(keepends=True)

    part = tmp_path / "part.jsonl"
    assert run(*common(model_dir, heldout, part, "--max-prompts", "4", *sample)) == 4  # then extended
    first = part.read_bytes()
    assert run(*common(model_dir, heldout, part, "--max-prompts", "8", *sample)) == 4
    assert part.read_bytes() == reference and reference.startswith(first)  # appended; what was there is untouched
    assert run(*common(model_dir, heldout, part, "--max-prompts", "8", *sample)) == 0  # complete: nothing to do

    # a killed run: 5 records (the middle of the second batch) and half of the sixth
    killed = tmp_path / "killed.jsonl"
    shutil.copy(tmp_path / "part.jsonl.settings", tmp_path / "killed.jsonl.settings")
    killed.write_bytes(b"".join(lines[:5]) + lines[5][: len(lines[5]) // 2])
    with caplog.at_level("WARNING"):
        assert run(*common(model_dir, heldout, killed, "--max-prompts", "8", *sample)) == 3
    assert "ends with a partial record" in caplog.text
    assert killed.read_bytes() == reference  # the same records as the uninterrupted run, sampled ones included


def test_pools_batch_prompts_of_like_length_and_resume_whole(inputs, tmp_path, monkeypatch):
    """--pool-batches K: each pool of K batches is sorted by prompt length before it is cut into batches (as the
    teacher receives them); the records stay in prompt order, and a run extended past a pool or killed inside one
    writes the uninterrupted run's bytes, sampled records included."""
    root, model_dir, heldout = inputs
    batches = []
    continue_batch = Teacher.continue_batch

    def watched(self, prompts, seed):
        batches.append([len(p.ids) for p in prompts])
        return continue_batch(self, prompts, seed)

    monkeypatch.setattr(Teacher, "continue_batch", watched)
    pooled = ["--teacher", str(model_dir), "--prompts", str(heldout), "--max-new-tokens", "8", "--batch-size", "2",
              "--pool-batches", "3", "--temperature", "1.0", "--seed", "2"]
    full = tmp_path / "full.jsonl"
    assert run(*pooled, "--out", str(full), "--max-prompts", "9") == 9
    lengths = [r["prompt_tokens"] for r in records(full)]
    assert [r["index"] for r in records(full)] == list(range(9))
    assert lengths[:6] != sorted(lengths[:6])  # whole paragraphs: the file's order is not the length order
    assert batches[:3] == [sorted(lengths[:6])[i : i + 2] for i in (0, 2, 4)]  # pool 0, sorted, in batches of 2
    second = sum(batches[3:], [])
    assert len(batches) == 6 and second == sorted(second) and all(n in second for n in lengths[6:9])  # pool 1, whole
    reference = full.read_bytes()

    part = tmp_path / "part.jsonl"
    assert run(*pooled, "--out", str(part), "--max-prompts", "4") == 4  # inside pool 0
    assert run(*pooled, "--out", str(part), "--max-prompts", "9") == 5
    assert part.read_bytes() == reference
    lines = reference.splitlines(keepends=True)
    killed = tmp_path / "killed.jsonl"  # 7 records (inside pool 1) and half of the eighth
    shutil.copy(tmp_path / "part.jsonl.settings", tmp_path / "killed.jsonl.settings")
    killed.write_bytes(b"".join(lines[:7]) + lines[7][: len(lines[7]) // 2])
    assert run(*pooled, "--out", str(killed), "--max-prompts", "9") == 2
    assert killed.read_bytes() == reference
    # a file written before pools existed was written in the file's order: it extends with K = 1 only
    old = tmp_path / "old.jsonl"
    run(*common(model_dir, heldout, old, "--max-prompts", "3"))
    settings = json.loads((tmp_path / "old.jsonl.settings").read_text())
    (tmp_path / "old.jsonl.settings").write_text(json.dumps({k: v for k, v in settings.items() if k != "pool_batches"}))
    assert run(*common(model_dir, heldout, old, "--max-prompts", "6")) == 3
    expect_refusal(common(model_dir, heldout, old, "--max-prompts", "9", "--pool-batches", "2"),
                   r"other settings \(pool_batches: 1 in the file, 2 now\)", old)


def expect_refusal(args, message, out):
    before = out.read_bytes() if out.exists() else None
    with pytest.raises(ValueError, match=message):
        run(*args)
    assert (out.read_bytes() if out.exists() else None) == before


def test_other_settings_or_a_foreign_file_are_refused(inputs, tmp_path):
    root, model_dir, heldout = inputs
    out = tmp_path / "t.jsonl"
    run(*common(model_dir, heldout, out, "--max-prompts", "3"))
    expect_refusal(common(model_dir, heldout, out, "--max-prompts", "3", "--temperature", "0.7"),
                   r"was generated with other settings \(temperature: 0.0 in the file, 0.7 now\)", out)
    foreign = tmp_path / "mine.jsonl"
    foreign.write_text('{"text": "someone else\'s data"}\n')
    expect_refusal(common(model_dir, heldout, foreign), "exists but was not written by train/teacher_data.py", foreign)
    changed = tmp_path / "changed.txt"  # the prompts file changed under an existing output
    changed.write_text("\n\n".join(corpus_paragraphs(30, seed=9)) + "\n")
    moved = tmp_path / "moved.jsonl"
    shutil.copy(out, moved)
    settings = json.loads((tmp_path / "t.jsonl.settings").read_text())
    (tmp_path / "moved.jsonl.settings").write_text(json.dumps({**settings, "prompts": str(changed.resolve())}))
    expect_refusal(common(model_dir, changed, moved, "--max-prompts", "3"), "does not continue prompt 0", moved)


def test_settings_of_a_deleted_output_are_replaced(inputs, tmp_path):
    """OUT.settings left by an OUT the user deleted describes the new OUT once it is written: a resume with the
    old settings would mix records made two ways."""
    root, model_dir, heldout = inputs
    out = tmp_path / "t.jsonl"
    run(*common(model_dir, heldout, out, "--max-prompts", "3"))
    out.unlink()
    assert run(*common(model_dir, heldout, out, "--max-prompts", "3", "--temperature", "0.7")) == 3
    assert json.loads((tmp_path / "t.jsonl.settings").read_text())["temperature"] == 0.7
    expect_refusal(common(model_dir, heldout, out, "--max-prompts", "6"),
                   r"other settings \(temperature: 0.7 in the file, 0.0 now\)", out)
    assert run(*common(model_dir, heldout, out, "--max-prompts", "6", "--temperature", "0.7")) == 3


def test_dtype_is_a_setting_with_auto_resolved(inputs, tmp_path):
    root, model_dir, heldout = inputs
    out = tmp_path / "t.jsonl"
    run(*common(model_dir, heldout, out, "--max-prompts", "3"))
    assert json.loads((tmp_path / "t.jsonl.settings").read_text())["dtype"] == "float32"  # auto, on CPU
    assert run(*common(model_dir, heldout, out, "--max-prompts", "6", "--dtype", "float32")) == 3  # the same dtype
    expect_refusal(common(model_dir, heldout, out, "--max-prompts", "9", "--dtype", "bfloat16"),
                   r"other settings \(dtype: 'float32' in the file, 'bfloat16' now\)", out)
    # auto on a GPU is the checkpoint's dtype: a bfloat16 checkpoint's records from the CPU are not extended there
    teacher = tmp_path / "bf16"
    shutil.copytree(model_dir, teacher)
    config = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    from train.teacher_data import checkpoint_dtype

    assert checkpoint_dtype(str(teacher)) == "bfloat16"  # what auto stands for on a GPU
    out = tmp_path / "cpu.jsonl"
    run(*common(teacher, heldout, out, "--max-prompts", "3", "--device", "cpu"))
    refusal = (r"other settings \(dtype: 'float32' in the file, 'bfloat16' now\)" if torch.cuda.is_available() else
               r"--device: device 'cuda': this machine has none")  # (and a machine without one says so first)
    expect_refusal(common(teacher, heldout, out, "--max-prompts", "6", "--device", "cuda"), refusal, out)


@pytest.mark.parametrize("damage,message", [
    ("settings_not_json", r"cannot read the settings file .*t.jsonl.settings: Expecting value"),
    ("settings_not_an_object", r"the settings file .*t.jsonl.settings holds no settings \(a JSON list"),
    ("record_not_an_object", r"--out .*t.jsonl: line 2 is not a JSON record"),
    ("record_not_utf8", r"--out .*t.jsonl: line 3 is not UTF-8 text"),
])
def test_damaged_output_is_refused_naming_file_and_line(inputs, tmp_path, damage, message):
    root, model_dir, heldout = inputs
    out = tmp_path / "t.jsonl"
    run(*common(model_dir, heldout, out, "--max-prompts", "3"))
    settings, lines = tmp_path / "t.jsonl.settings", out.read_bytes().splitlines(keepends=True)
    if damage == "settings_not_json":
        settings.write_text('{"teacher": \n')
    elif damage == "settings_not_an_object":
        settings.write_text("[1, 2]\n")
    elif damage == "record_not_an_object":
        out.write_bytes(lines[0] + b"[1, 2]\n" + lines[2])
    else:
        out.write_bytes(lines[0] + lines[1] + b"\xff" + lines[2])
    expect_refusal(common(model_dir, heldout, out, "--max-prompts", "6"), message, out)


def test_a_failed_write_keeps_whole_records_and_says_so(inputs, tmp_path):
    """A full disk mid-run: the error names the file and what is kept, the file is cut back to whole records, and a
    rerun resumes. A file size limit (RLIMIT_FSIZE) makes the write fail as a full disk would, in a subprocess."""
    root, model_dir, heldout = inputs
    out = tmp_path / "t.jsonl"
    args = common(model_dir, heldout, out, "--max-prompts", "6")
    run(*common(model_dir, heldout, out, "--max-prompts", "3"))
    before = out.read_bytes()
    limited = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               f"resource.setrlimit(resource.RLIMIT_FSIZE, ({len(before) + 100}, resource.RLIM_INFINITY)); "
               "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    result = run_cli(python("-c", limited, "train/teacher_data.py", *args), timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert (f"error: cannot write {out}: File too large. {out} keeps the 3 records written so far, whole: free space "
            "(or fix the error) and rerun the same command to resume") in result.stderr
    assert out.read_bytes() == before  # the part of the batch that did fit is cut off again
    assert run(*args) == 3


@pytest.fixture(scope="module")
def weightless(inputs):
    """The teacher's config and tokenizer without its weights: a check that came after loading the teacher would
    fail on the missing weights instead of giving its own message."""
    root, model_dir, _ = inputs
    folder = root / "weightless"
    shutil.copytree(model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    return folder


def other_student(root):
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["zebra"])  # an ordinary token the teacher does not have
    folder = root / "other-student"
    if not folder.exists():
        make_model_dir(folder)
        tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case,message", [
    ("missing_prompts", "--prompts: no such file: .*nope.txt"),
    ("empty_prompts", "--prompts: data file .*empty.txt is empty"),
    ("binary_prompts", "--prompts: .*binary.txt is not UTF-8 text"),
    ("short_prompts", "--prompts .*heldout.txt holds no prompt of at least 5000 tokens"),
    ("other_student", r"the teacher's tokenizer .* differs from the student's .*'zebra' \(id \d+\) is only in the student"),
    ("not_a_teacher", "--teacher .*corpus is not a checkpoint folder"),
    ("too_long", "exceeds the teacher's max_position_embeddings 512"),
    ("out_extension", "the output is a jsonl file"),
    ("zero_batch", "--batch-size must be positive"),
    ("out_in_a_file", "--out .*empty.txt/out.jsonl: .*empty.txt is not a folder"),
])
def test_bad_input_stops_before_the_teacher_loads(inputs, weightless, tmp_path, case, message):
    root, _, heldout = inputs
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    out = tmp_path / "out.jsonl"
    args = {
        "missing_prompts": common(weightless, tmp_path / "nope.txt", out),
        "empty_prompts": common(weightless, tmp_path / "empty.txt", out),
        "binary_prompts": common(weightless, tmp_path / "binary.txt", out),
        "short_prompts": common(weightless, heldout, out) + ["--prompt-tokens", "5000"],
        "other_student": common(weightless, heldout, out, "--student", str(other_student(root))),
        "not_a_teacher": common(root / "corpus", heldout, out),
        "too_long": common(weightless, heldout, out, "--max-new-tokens", "600"),
        "out_extension": common(weightless, heldout, tmp_path / "out.txt"),
        "zero_batch": common(weightless, heldout, out, "--batch-size", "0"),
        "out_in_a_file": common(weightless, heldout, tmp_path / "empty.txt" / "out.jsonl"),
    }[case]
    with pytest.raises(ValueError, match=message):
        run(*args)
    assert not out.exists() and not (tmp_path / "out.jsonl.settings").exists()
    lock = tmp_path / "out.jsonl.lock"  # a refused run let go of its lock (an empty file: no holder recorded)
    assert not lock.exists() or lock.read_text() == ""


def test_without_a_bad_input_the_weightless_teacher_does_fail_to_load(inputs, weightless, tmp_path):
    """The check above is real: the same arguments that are fine get as far as loading the (missing) weights."""
    _, _, heldout = inputs
    with pytest.raises(ValueError, match="cannot load the teacher .*weightless"):
        run(*common(weightless, heldout, tmp_path / "new" / "out.jsonl"))
    assert not (tmp_path / "new").exists()  # nor the lock's folder: nothing was written


def test_a_run_on_an_out_in_use_is_refused_naming_the_holder(inputs, weightless, tmp_path):
    """Two runs appending to one file would interleave their records: the second is refused at once, before its
    teacher loads (the weightless teacher would fail to load)."""
    _, _, heldout = inputs
    out = tmp_path / "t.jsonl"
    holder = RunLock(tmp_path, "t.jsonl.lock")  # another open of the lock file: flock(2) locks conflict as between runs
    try:
        with pytest.raises(ValueError, match=rf"--out {out} is in use by another run: pid {os.getpid()} on host "
                                             rf"{socket.gethostname()}, started 20\d\d-.*lock file {out}.lock"):
            run(*common(weightless, heldout, out))
    finally:
        holder.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl.lock"]


def test_transformers_teacher_and_its_r2lm_conversion_agree(tmp_path):
    """The original pretrained model as teacher: a transformers causal LM decodes with its own greedy generate(),
    and the R2LM converted from it (gates at 0) with --block-size 1 gives the same records (docs/design.md invariant 3)."""
    from r2lm.convert.__main__ import main as convert_main

    tokenizer = tiny_tokenizer()
    # clear argmaxes: the two implementations agree to float rounding only
    hf = sharp_hf("qwen3", vocab_size=len(tokenizer))
    hf.config.eos_token_id, hf.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    hf.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    assert convert_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "r2lm"), "--sidecar-layers", "1",
                         "--d-state", "8", "--headdim", "16", "--block-size", "8"]) == 0
    _, heldout = write_corpus(tmp_path / "corpus", n_train=5, n_heldout=12)
    args = ["--max-prompts", "6", "--max-new-tokens", "20"]
    run(*common(tmp_path / "hf", heldout, tmp_path / "hf.jsonl", *args, "--student", str(tmp_path / "r2lm")))
    run(*common(tmp_path / "r2lm", heldout, tmp_path / "r2lm.jsonl", *args, "--block-size", "1"))
    converted = records(tmp_path / "r2lm.jsonl")
    assert all("teacher" in r for r in converted) and not any("teacher" in r for r in records(tmp_path / "hf.jsonl"))
    assert records(tmp_path / "hf.jsonl") == [{k: v for k, v in r.items() if k != "teacher"} for r in converted]
    assert len({r["text"] for r in records(tmp_path / "hf.jsonl")}) > 1
    with pytest.raises(ValueError, match="--block-size / --threshold set R2LM .* the teacher is a transformers causal LM"):
        run(*common(tmp_path / "hf", heldout, tmp_path / "x.jsonl", "--block-size", "1"))


def test_cli_help_and_errors(inputs, tmp_path):
    root, model_dir, heldout = inputs
    out = run_cli(python("train/teacher_data.py", "--help"), timeout=60)
    assert out.returncode == 0 and "--teacher" in out.stdout and "objective=certainty" in out.stdout
    bad = run_cli(python("train/teacher_data.py", *common(model_dir, tmp_path / "nope.txt", tmp_path / "o.jsonl")),
                  timeout=120)
    assert bad.returncode == 2 and "error: --prompts: no such file" in bad.stderr and "Traceback" not in bad.stderr
