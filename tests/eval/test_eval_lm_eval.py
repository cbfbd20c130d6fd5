"""eval.lm_eval_adapter: the "r2lm" backend runs the local tasks under eval/tasks end to end through lm-eval's own
evaluator (multiple choice, generation, rolling perplexity), offline, and its scores are eval.likelihood's."""

import json
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")


from r2lm import scoring as sc  # noqa: E402
from tests.helpers import REPO  # noqa: E402
from tests.helpers.models import tiny_hf_config, tiny_r2lm, tiny_tokenizer  # noqa: E402

TASKS = REPO / "eval" / "tasks"


@pytest.fixture
def checkpoint(tmp_path):
    def make(**overrides):
        tok = tiny_tokenizer()
        model = tiny_r2lm(open_gates=True, vocab_size=len(tok) + 1, mask_token_id=len(tok), eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, **overrides)
        model.save_pretrained(tmp_path / "ckpt")
        tok.save_pretrained(tmp_path / "ckpt")
        return tmp_path / "ckpt"
    return make


def evaluate(path, tasks, model_args=""):
    from lm_eval.tasks import TaskManager

    import eval.lm_eval_adapter  # noqa: F401  (registers "r2lm")

    return lm_eval.simple_evaluate(model="r2lm", model_args=f"pretrained={path},device=cpu{model_args}", tasks=tasks,
                                   task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
                                   log_samples=True, batch_size=2)


@pytest.mark.parametrize("overrides,args,mode", [
    (dict(sidecar_layers=[1, 3]), ",mc_num=8,mc_batch_size=4", "block"),
    (dict(attention="bidirectional"), ",mc_num=8", "single"),
    (dict(), ",mode=ar", "ar"),
], ids=["r2lm", "bidirectional", "ar"])
def test_local_multiple_choice_task_end_to_end(checkpoint, overrides, args, mode):
    path = checkpoint(**overrides)
    out = evaluate(path, ["r2lm_tiny_mc"], args)
    res = out["results"]["r2lm_tiny_mc"]
    assert 0 <= res["acc,none"] <= 1 and 0 <= res["acc_norm,none"] <= 1
    samples = out["samples"]["r2lm_tiny_mc"]
    assert len(samples) == 5
    # every loglikelihood lm-eval recorded is eval.likelihood's estimate on the same tokens
    from eval.lm_eval_adapter import R2LMEvalLM

    lm = R2LMEvalLM(pretrained=str(path), device="cpu", **dict(a.split("=") for a in args.strip(",").split(",")))
    assert lm.mode == mode
    for sample in samples[:2]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            ctx, cont = lm._encode_pair(context, continuation)
            want = sc.answer_loglikelihood(lm.model, ctx, cont, mode=mode, mc_num=lm.mc_num, batch_size=lm.mc_batch_size,
                                           block_size=lm.block_size, seed=lm.seed)
            assert float(resp[0][0]) == pytest.approx(want, rel=1e-5, abs=1e-5)
        scores = [float(r[0][0]) for r in sample["resps"]]
        assert sample["acc"] == float(max(range(len(scores)), key=scores.__getitem__) == sample["target"])


def test_generation_and_rolling_tasks_end_to_end(checkpoint):
    path = checkpoint(sidecar_layers=[1, 3])
    out = evaluate(path, ["r2lm_tiny_gen", "r2lm_tiny_ppl"], ",mc_num=4,threshold=0.5")
    assert 0 <= out["results"]["r2lm_tiny_gen"]["exact_match,none"] <= 1
    ppl = out["results"]["r2lm_tiny_ppl"]
    assert ppl["word_perplexity,none"] > 1 and ppl["bits_per_byte,none"] > 0
    for sample in out["samples"]["r2lm_tiny_gen"]:
        text = sample["resps"][0][0]
        assert "\n" not in text and "." not in text  # cut before the stop strings


def test_generate_until_matches_r2lm_generate(checkpoint):
    from lm_eval.api.instance import Instance

    from eval.lm_eval_adapter import R2LMEvalLM
    from r2lm import generate

    path = checkpoint(sidecar_layers=[1, 3])
    lm = R2LMEvalLM(pretrained=str(path), device="cpu", threshold=0.5, batch_size=4)
    contexts = ["the quick brown fox", "a diffusion model decodes many"]
    reqs = [Instance("generate_until", {}, (c, {"until": ["zzz"], "max_gen_toks": 10}), i) for i, c in enumerate(contexts)]
    got = lm.generate_until(reqs)
    for c, text in zip(contexts, got, strict=True):
        ids = torch.tensor([lm.tok_encode(c)])
        out = generate(lm.model, ids, max_new_tokens=10, threshold=0.5, eos_token_id=lm.eot_token_id)
        assert text == lm.tok_decode(out.sequences[0, ids.shape[1] :].tolist())


def test_registration_keeps_lm_evals_own_backends():
    from lm_eval.api.registry import get_model

    import eval.lm_eval_adapter as adapter

    adapter.register()  # idempotent
    assert get_model("r2lm") is adapter.R2LMEvalLM
    assert get_model("dummy").__name__ == "DummyLM"  # lm-eval's lazy registrations were made first


@pytest.mark.slow
def test_cli_entry_point_runs_lm_eval(checkpoint, tmp_path):
    """`python -m eval.lm_eval_adapter ...` registers the backend and runs lm-eval's own CLI (which indexes every
    built-in task: about 25 s here, hence slow)."""
    path = checkpoint(sidecar_layers=[1, 3])
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "eval.lm_eval_adapter", "--model", "r2lm", "--model_args",
         f"pretrained={path},mc_num=4", "--include_path", str(TASKS), "--tasks", "r2lm_tiny_mc", "--device", "cpu",
         "--output_path", str(tmp_path / "out")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = list((tmp_path / "out").rglob("results*.json"))
    assert results and "r2lm_tiny_mc" in json.loads(results[0].read_text())["results"]


# ---------------------------------------------------------------------------------- bad model_args


@pytest.mark.parametrize("args,extra,message", [
    ("greedy_check=maybe", {}, "greedy_check must be true or false, got 'maybe'"),
    ("", {"batch_size": -2}, "batch_size must be a positive integer, got -2"),
    ("", {"batch_size": 0}, "batch_size must be a positive integer, got 0"),
    ("mc_batch_size=0", {}, "mc_batch_size must be a positive integer, got 0"),
    ("mc_num=0", {}, "mc_num must be a positive integer, got 0"),
    ("block_size=0", {}, "block_size must be a positive integer, got 0"),
    ("max_length=0", {}, "max_length must be a positive integer, got 0"),
    ("max_length=513", {}, "max_length=513 is above the model's max_position_embeddings 512"),
    ("mc_nun=8", {}, r"unknown r2lm model_args: mc_nun \(did you mean mc_num\?\); the backend takes .*mc_num"),
    ("mode=diffusio", {}, r"mode must be one of \('auto', 'ar', 'diffusion'\), got 'diffusio'"),
    ("threshold=1.5", {}, r"threshold must be a number in \(0, 1\], got 1.5"),
    ("dtype=bfloat61", {}, "dtype must be auto or a torch dtype name"),
    ("prefix_token_id=1000", {}, r"prefix_token_id=1000 is above the model's last token id \d+"),
    ("seed=-1", {}, "seed must be an integer >= 0, got -1"),
    ("pretrained={path}/missing", {}, "pretrained={path}/missing: no such folder"),
    ("pretrained={path}/config.json", {}, "pretrained={path}/config.json is a file; give the R2LM checkpoint folder"),
], ids=["greedy_check", "batch_size-2", "batch_size0", "mc_batch_size0", "mc_num0", "block_size0", "max_length0",
        "max_length-above", "misspelt", "mode", "threshold", "dtype", "prefix_token_id", "seed", "missing", "file"])
def test_a_bad_model_arg_is_named_before_the_model_loads(checkpoint, monkeypatch, args, extra, message):
    """As lm-eval builds the backend from --model_args (and --batch_size). Before: an unknown greedy_check reported
    is_greedy False for everything, batch_size=-2 returned None for every generation, the zeros became defaults, a
    max_length above the model's was taken, a misspelt argument was only a warning, and a missing or file pretrained
    gave transformers' "Repo id must be in the form"."""
    from lm_eval.api.registry import get_model

    import eval.common
    import eval.lm_eval_adapter  # noqa: F401  (registers "r2lm")

    path = checkpoint(sidecar_layers=[1, 3])
    monkeypatch.setattr(eval.common, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    args = args.format(path=path)
    if not args.startswith("pretrained="):
        args = f"pretrained={path}" + (f",{args}" if args else "")
    with pytest.raises(ValueError, match=message.format(path=path)):
        get_model("r2lm").create_from_arg_string(args, {"device": "cpu", **extra})


def test_good_model_args_in_lm_evals_spellings_are_taken(checkpoint):
    from lm_eval.api.registry import get_model

    import eval.lm_eval_adapter  # noqa: F401  (registers "r2lm")

    path = checkpoint(sidecar_layers=[1, 3])
    lm = get_model("r2lm").create_from_arg_string(
        f"pretrained={path},greedy_check=false,mc_num=4,mc_batch_size=2,block_size=4,max_length=512,threshold=1,seed=3",
        {"device": "cpu", "batch_size": "auto:4", "max_batch_size": 64})
    assert (lm.greedy_check, lm.mc_num, lm.mc_batch_size, lm.block_size, lm.max_length, lm.threshold, lm.seed,
            lm.gen_batch_size) == (False, 4, 2, 4, 512, 1.0, 3, 8)


# ---------------------------------------------------------------------------------- as lm-eval's own hf model


@pytest.fixture
def hf_and_r2lm(tmp_path):
    """A tiny transformers Qwen3 with a tokenizer (with a BOS or not) and its R2LM conversion (same weights)."""
    from transformers import AutoModelForCausalLM

    from r2lm.convert.from_hf import convert_from_hf

    def make(bos: bool):
        tok = tiny_tokenizer()
        if bos:
            tok.add_special_tokens({"bos_token": "<|startoftext|>"})
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(tiny_hf_config("qwen3", vocab_size=len(tok) + 1))
        hf.save_pretrained(tmp_path / "hf")
        tok.save_pretrained(tmp_path / "hf")
        # [MASK] on the spare row: no row is added, so the two models' logits are the same
        return tmp_path / "hf", convert_from_hf(tmp_path / "hf", tmp_path / "r2lm", mask_token_id=len(tok))
    return make


@pytest.mark.parametrize("bos", [True, False], ids=["bos", "no-bos"])
def test_rolling_loglikelihood_matches_lm_evals_hf_model(hf_and_r2lm, bos):
    """Before: the r2lm backend conditioned rolling windows on EOS where lm-eval's HFLM uses BOS (up to 0.95 nat per
    document apart)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from eval.lm_eval_adapter import R2LMEvalLM

    hf_path, r2lm_path = hf_and_r2lm(bos)
    theirs = HFLM(pretrained=str(hf_path), device="cpu", dtype="float32", batch_size=1)
    ours = R2LMEvalLM(pretrained=str(r2lm_path), device="cpu", mode="ar")
    assert ours.prefix_token_id == theirs.prefix_token_id
    assert (ours.prefix_token_id == ours.tokenizer.bos_token_id) if bos else ours.prefix_token_id == ours.eot_token_id
    texts = ["the quick brown fox jumps over the lazy dog", "a diffusion model decodes many tokens at once " * 30]
    requests = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts)]
    assert len(ours.tok_encode(texts[1])) > ours.max_length  # several rolling windows
    assert ours.loglikelihood_rolling(requests) == pytest.approx(theirs.loglikelihood_rolling(requests), abs=1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
def test_lm_evals_default_cuda_device_falls_back_to_cpu(hf_and_r2lm, caplog):
    """lm-eval's CLI passes --device cuda:0 by default. Before: "Torch not compiled with CUDA enabled"."""
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM

    import eval.lm_eval_adapter  # noqa: F401  (registers "r2lm")

    hf_path, r2lm_path = hf_and_r2lm(bos=False)
    assert HFLM(pretrained=str(hf_path), device="cuda:0", dtype="float32").device == torch.device("cpu")
    with caplog.at_level("WARNING", logger="eval.lm_eval_adapter"):  # as simple_evaluate builds it for the CLI
        lm = get_model("r2lm").create_from_arg_string(f"pretrained={r2lm_path},mode=ar", {"device": "cuda:0", "batch_size": 1})
    assert lm.model.device == torch.device("cpu") and lm.model.dtype == torch.float32
    assert "device 'cuda:0' is not available on this machine; using cpu" in caplog.text
