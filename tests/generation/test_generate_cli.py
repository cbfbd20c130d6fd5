"""r2lm-generate (issue 15 item 4): what it prints is what model.generate decodes with the options given, the others
coming from the checkpoint's generation_config.json; one prompt streams, several are a left-padded batch."""

from __future__ import annotations

import fcntl
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from r2lm import R2LMForDiffusionLM
from r2lm.cli.generate import build_parser, decoding_options, main
from r2lm.ngram import NGramTable
from tests.helpers import REPO
from tests.helpers.checkpoints import damage_weights
from tests.helpers.models import make_model_dir, tiny_hf_config, tiny_tokenizer

PROMPTS = ["the quick brown", "a diffusion"]
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny R2LM folder whose generation_config.json sets decoding options unlike generate()'s own defaults."""
    folder = make_model_dir(tmp_path_factory.mktemp("cli") / "model")
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(max_new_tokens=10, block_size=4, threshold=0.3)
    path.write_text(json.dumps(config))
    return folder


def expected(checkpoint, prompts, chat=False, **options) -> tuple[list[str], object]:
    """What model.generate decodes for `prompts` (left-padded) with `options`: (texts, GenerateOutput)."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    if chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)
    model = R2LMForDiffusionLM.from_pretrained(checkpoint).eval()
    out = model.generate(batch.input_ids, batch.attention_mask, return_dict_in_generate=True, tokenizer=tokenizer,
                         **options)
    texts = tokenizer.batch_decode(out.sequences[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    return texts, out


def run(argv, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_one_prompt_streams_its_text_then_the_speed(checkpoint, capsys):
    code, out, err = run([checkpoint, "--prompt", PROMPTS[0]], capsys)
    [text], result = expected(checkpoint, PROMPTS[:1])
    assert code == 0
    assert out == text + "\n"  # streamed (TextStreamer), without the prompt
    assert result.new_tokens == 10  # the checkpoint's max_new_tokens: nothing the CLI passed replaced it
    speed = err.splitlines()[-1]  # after transformers' loading progress
    assert speed.startswith(f"[{result.new_tokens} tokens in ") and speed.endswith(" tokens/s]")
    assert f"{result.nfe} forwards, {result.tokens_per_step:.2f} tokens per denoising step" in speed


def test_several_prompts_are_one_left_padded_batch(checkpoint, capsys):
    code, out, _ = run([checkpoint, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]], capsys)
    texts, _ = expected(checkpoint, PROMPTS)
    assert code == 0
    assert out.splitlines() == [f"{prompt!r} -> {text!r}" for prompt, text in zip(PROMPTS, texts, strict=True)]


OPTIONS = [
    (["--block-size", "2", "--steps", "6", "--confidence", "margin", "--max-new-tokens", "6"],
     dict(block_size=2, steps=6, confidence="margin", max_new_tokens=6)),
    (["--factor", "1.5", "--no-cache"], dict(factor=1.5, use_cache=False)),
    (["--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "3", "--stop", "the", "--stop", "fox"],
     dict(temperature=0.8, top_k=5, top_p=0.9, stop_strings=["the", "fox"])),
    (["--verify", "--block-size", "3", "--temperature", "0"], dict(verify=True, block_size=3, temperature=0.0)),
    (["--verify", "--verify-draft", "lookup", "--temperature", "0"],
     dict(verify=True, verify_draft="lookup", temperature=0.0)),
    (["--verify", "--verify-windows", "2", "--temperature", "0"], dict(verify=True, verify_windows=2, temperature=0.0)),
    (["--verify", "--verify-policy", "longest", "--temperature", "0"],
     dict(verify=True, verify_policy="longest", temperature=0.0)),
]


@pytest.mark.parametrize(("flags", "options"), OPTIONS)
def test_decoding_options_reach_generate(checkpoint, capsys, flags, options):
    args = build_parser().parse_args([str(checkpoint), "--prompt", "x", *flags])
    given = decoding_options(args, torch.device("cpu"))
    generator = given.pop("generator", None)
    assert given == options
    if "--seed" in flags:
        assert torch.equal(generator.get_state(), torch.Generator().manual_seed(3).get_state())
        options["generator"] = torch.Generator().manual_seed(3)
    code, out, _ = run([checkpoint, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], *flags], capsys)
    texts, _ = expected(checkpoint, PROMPTS, **options)
    assert code == 0
    assert out.splitlines() == [f"{prompt!r} -> {text!r}" for prompt, text in zip(PROMPTS, texts, strict=True)]


def test_no_flag_leaves_every_option_to_the_checkpoint(checkpoint):
    assert decoding_options(build_parser().parse_args([str(checkpoint), "--prompt", "x"]), torch.device("cpu")) == {}
    compiled = build_parser().parse_args([str(checkpoint), "--prompt", "x", "--compile"])
    assert decoding_options(compiled, torch.device("cpu")) == {"compile": True}


def test_chat_applies_the_tokenizers_template(checkpoint, tmp_path, capsys):
    chat = make_model_dir(tmp_path / "chat")
    tokenizer = AutoTokenizer.from_pretrained(chat)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(chat)
    code, out, _ = run([chat, "--chat", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]], capsys)
    texts, _ = expected(chat, PROMPTS, chat=True)
    plain, _ = expected(chat, PROMPTS)
    assert code == 0 and texts != plain  # the template changes what the model sees
    assert out.splitlines() == [f"{prompt!r} -> {text!r}" for prompt, text in zip(PROMPTS, texts, strict=True)]
    code, _, err = run([checkpoint, "--chat", "--prompt", PROMPTS[0]], capsys)
    assert code == 2 and f"--chat: the tokenizer of {checkpoint} has no chat template" in err


def test_a_drafter_flag_without_a_usable_drafter_is_named(checkpoint, capsys):
    """Issue 40 item 7: `--drafter ""` decoded without verification, silently. --drafter alone asks for the drafter
    r2lm ships for the checkpoint's model: this tiny model has none."""
    with pytest.raises(SystemExit) as exit_:
        main([str(checkpoint), "--prompt", "x", "--drafter", ""])
    assert exit_.value.code == 2 and "--drafter was given an empty folder name" in capsys.readouterr().err
    code, out, err = run([checkpoint, "--prompt", "x", "--drafter"], capsys)
    assert code == 2 and f"r2lm ships no drafter for {checkpoint}'s model" in err and out == ""


def test_an_ngram_table_drafts_the_models_own_text(checkpoint, tmp_path, capsys):
    """--ngram DIR: verified decoding with the table's drafts beside lookup's prints the model's own greedy text (as
    lookup alone does); --ngram alone asks for the table r2lm ships for the model (none for this tiny one); an empty
    folder name is refused."""
    vocab = R2LMForDiffusionLM.from_pretrained(checkpoint).config.vocab_size
    table = NGramTable.build([torch.randint(0, vocab, (200,), generator=torch.Generator().manual_seed(0)).tolist()],
                             vocab, min_count=1)
    table.save(tmp_path / "table")
    code, out, _ = run([checkpoint, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--ngram", tmp_path / "table"], capsys)
    texts, _ = expected(checkpoint, PROMPTS, verify=True, verify_draft="lookup")
    assert code == 0 and out.splitlines() == [f"{p!r} -> {t!r}" for p, t in zip(PROMPTS, texts, strict=True)]
    code, out, err = run([checkpoint, "--prompt", "x", "--ngram"], capsys)
    assert code == 2 and f"r2lm ships no n-gram table for {checkpoint}'s model" in err and out == ""
    with pytest.raises(SystemExit) as exit_:
        main([str(checkpoint), "--prompt", "x", "--ngram", ""])
    assert exit_.value.code == 2 and "--ngram was given an empty folder name" in capsys.readouterr().err


def test_bad_input_is_named(checkpoint, tmp_path, capsys):
    code, out, err = run([checkpoint, "--prompt", "x", "--threshold", "1.5"], capsys)
    assert code == 2 and "threshold must be in (0, 1], got 1.5" in err and out == ""
    code, out, err = run([checkpoint, "--prompt", "x", "--verify-draft", "lookup"], capsys)
    assert code == 2 and "set how verify=True drafts; pass verify=True" in err and out == ""
    code, out, err = run([checkpoint, "--prompt", "x", "--verify", "--verify-siblings", "2"], capsys)
    assert code == 2 and "verify_siblings counts a drafter's other candidates" in err and out == ""
    with pytest.raises(SystemExit) as exit_:
        main([str(checkpoint), "--prompt", "x", "--threshold", "0.5", "--steps", "4"])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    tok = tiny_tokenizer()
    AutoModelForCausalLM.from_config(tiny_hf_config("qwen3", vocab_size=len(tok))).save_pretrained(tmp_path / "qwen3")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "qwen3"), "--prompt", "x"])
    assert exit_.value.code == 2
    assert "is a 'qwen3' checkpoint, not an R2LM one; convert it first" in capsys.readouterr().err


def test_the_products_are_plain_or_kept_decisions(checkpoint, tmp_path, capsys):
    """--plain-products decodes as the plain model does, bit for bit; --linear-decisions FILE measures the product
    orders once and saves them, a later run loads them (the same text) and adds the orders it had to decide, and a
    file made elsewhere is refused."""
    code, out, _ = run([checkpoint, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--plain-products"], capsys)
    texts, _ = expected(checkpoint, PROMPTS)
    assert code == 0 and out.splitlines() == [f"{p!r} -> {t!r}" for p, t in zip(PROMPTS, texts, strict=True)]
    path = tmp_path / "decisions.json"
    first = run([checkpoint, "--prompt", PROMPTS[0], "--linear-decisions", path], capsys)
    saved = json.loads(path.read_text())
    assert first[0] == 0 and saved["decisions"]  # its classes were decided while it decoded
    assert run([checkpoint, "--prompt", PROMPTS[0], "--linear-decisions", path], capsys)[:2] == first[:2]
    assert json.loads(path.read_text()) == saved  # loaded, not measured again
    assert run([checkpoint, "--prompt", PROMPTS[0], "--verify", "--verify-draft", "lookup", "--linear-decisions", path],
               capsys)[0] == 0  # wider forwards: row counts the file lacks, decided and added to it
    def orders(decisions):
        return {(d["rows"], *d["weight"], d["threads"], d["order"]) for d in decisions}

    assert orders(json.loads(path.read_text())["decisions"]) > orders(saved["decisions"])
    path.write_text(json.dumps({**saved, "machine": "another"}))
    code, out, err = run([checkpoint, "--prompt", PROMPTS[0], "--linear-decisions", path], capsys)
    assert code == 2 and "made on another machine, torch or kernel build" in err and out == ""


def test_verify_costs_are_measured_once_and_kept(checkpoint, tmp_path, capsys, monkeypatch):
    """--verify-costs FILE: the first verified run measures what its forwards cost and saves it, the next run (a new
    model object, as in a new process) loads it, measures nothing and prints the same text; a run without it says
    how long it measured and what keeps that; a file made elsewhere is refused, and so is the flag without verified
    decoding."""
    import weakref

    from r2lm.generation import costs

    monkeypatch.setattr(costs, "_LOADED", {})  # this test's process: no other test's file or tables
    monkeypatch.setattr(costs, "_KEPT", weakref.WeakKeyDictionary())
    path = tmp_path / "costs.json"
    args = [checkpoint, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--verify", "--verify-draft", "lookup",
            "--verify-costs", path]
    code, _, err = run(args[:-2], capsys)  # without the file: the run says what measuring took, and how to keep it
    assert code == 0 and re.search(r"\[\d+\.\d\d s of it measured what verification forwards cost on this machine: "
                                   r"--verify-costs FILE keeps that", err.splitlines()[-1])
    first = run(args, capsys)
    assert "--verify-costs FILE keeps" not in first[2]
    saved = json.loads(path.read_text())
    texts, _ = expected(checkpoint, PROMPTS, verify=True, verify_draft="lookup")
    assert first[0] == 0 and first[1].splitlines() == [f"{p!r} -> {t!r}" for p, t in zip(PROMPTS, texts, strict=True)]
    assert saved["tables"] and all(set(t["verify"]) == {"1", "2"} for t in saved["tables"])  # one row, the batch's
    monkeypatch.setattr(costs.MeasuredCosts, "time_forwards", lambda self, rows: pytest.fail("measured again"))
    monkeypatch.setattr(costs.MeasuredCosts, "remeasure", lambda self, rows, disagreement, decoded: False)  # (steps' own asks)
    assert run(args, capsys)[:2] == first[:2]
    assert json.loads(path.read_text()) == saved
    path.write_text(json.dumps({**saved, "machine": "another"}))
    code, out, err = run(args, capsys)
    assert code == 2 and "measured on another machine, torch or kernel build" in err and out == ""
    with pytest.raises(SystemExit) as exit_:
        main([str(checkpoint), "--prompt", "x", "--verify-costs", str(path)])
    assert exit_.value.code == 2 and "--verify-costs keeps what verified decoding measures" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_unreadable_weights_are_named(checkpoint, tmp_path, capsys, damage):
    """A usage error naming the weights file, as the converters give, not a SafetensorError or OSError traceback."""
    copy = Path(shutil.copytree(checkpoint, tmp_path / "model"))
    message = damage_weights(copy, damage)
    with pytest.raises(SystemExit) as exit_:
        main([str(copy), "--prompt", "x"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_tokenizer_and_a_device_this_machine_lacks_are_named(checkpoint, tmp_path, capsys):
    copy = Path(shutil.copytree(checkpoint, tmp_path / "model"))
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        (copy / name).unlink(missing_ok=True)
    with pytest.raises(SystemExit) as exit_:
        main([str(copy), "--prompt", "x"])
    assert exit_.value.code == 2 and f"{copy} has no tokenizer" in capsys.readouterr().err
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last (cuda:0 on a machine without CUDA)
    for device, message in [(missing, f"--device: device '{missing}': this machine has none (CUDA devices: "
                                      f"{torch.cuda.device_count()})"), ("tpu", "--device: device 'tpu': ")]:
        with pytest.raises(SystemExit) as exit_:
            main([str(checkpoint), "--prompt", "x", "--device", device])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("make,message", [
    (lambda tmp: tmp / "missing", "missing: no such checkpoint folder"),
    (lambda tmp: tmp, "is not a checkpoint folder: it has no config.json"),
])
def test_generate_script_names_a_bad_checkpoint_path(tmp_path, make, message, capsys):
    """Before: transformers' "Repo id must be in the form ..." traceback (exit status 1)."""
    with pytest.raises(SystemExit) as exit_:
        main([str(make(tmp_path)), "--prompt", "The"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_help_lists_the_options():
    result = subprocess.run([sys.executable, "-m", "r2lm.cli.generate", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for option in ("--prompt", "--chat", "--block-size", "--threshold", "--factor", "--steps", "--confidence",
                   "--temperature", "--top-k", "--top-p", "--seed", "--max-new-tokens", "--stop", "--no-cache",
                   "--compile", "--verify", "--verify-draft", "--verify-windows", "--verify-siblings", "--verify-costs",
                   "--linear-decisions", "--plain-products", "generation_config.json"):
        assert option in result.stdout, option


def spawn(checkpoint, stdout: int) -> subprocess.Popen:
    """r2lm-generate in a process of its own, its stdout the pipe end `stdout` (one prompt: its text is streamed)."""
    argv = [sys.executable, "-m", "r2lm.cli.generate", str(checkpoint), "--prompt", PROMPTS[0]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # SIGINT as a terminal's user has it: a suite started in the background (`cmd &` without job control) runs with
    # SIGINT ignored, which its children inherit, and the Ctrl-C test then finds the process finishing at status 0
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_a_closed_stdout_ends_quietly_with_status_141(checkpoint):
    """`r2lm-generate ... | head -c 1`, with the reader gone before the first write (so the write certainly fails: the
    streamer's, inside model.generate). Before: a BrokenPipeError traceback, and another ("Exception ignored ...")
    at exit."""
    read, write = os.pipe()
    os.close(read)
    proc = spawn(checkpoint, write)
    os.close(write)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err


WRITE_SYSCALL = {"x86_64": 1, "aarch64": 64}


def writing_stdout(pid: int) -> bool:
    """Whether the process's main thread is inside write(1, ...) (Linux: /proc/PID/syscall)."""
    fields = Path(f"/proc/{pid}/syscall").read_text().split()
    return fields[:2] == [str(WRITE_SYSCALL[platform.machine()]), "0x1"]


@pytest.mark.skipif(not Path("/proc/self/syscall").exists() or platform.machine() not in WRITE_SYSCALL,
                    reason="finds the process inside its stdout write through Linux's /proc/PID/syscall")
def test_ctrl_c_while_generating_ends_quietly_with_status_130(checkpoint):
    """Ctrl-C while the streamer writes the text, inside model.generate: its stdout is a pipe already full, so the
    process certainly waits in that write when SIGINT comes, however fast the machine. Before: a KeyboardInterrupt
    traceback (and death by the signal)."""
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 4096)
    os.write(write, b"x" * fcntl.fcntl(write, fcntl.F_GETPIPE_SZ))  # full: the process's first write waits
    proc = spawn(checkpoint, write)
    os.close(write)
    deadline = time.monotonic() + 300
    while proc.poll() is None and not writing_stdout(proc.pid):
        assert time.monotonic() < deadline, "r2lm-generate never wrote its text"
        time.sleep(0.05)
    assert proc.returncode is None, proc.stderr.read()  # still running, in its first write of the text
    proc.send_signal(signal.SIGINT)
    with os.fdopen(read, "rb") as out:  # drain it, so that the exit's flush of stdout does not wait as well
        out.read()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
