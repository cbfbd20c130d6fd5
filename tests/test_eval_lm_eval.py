"""eval.lm_eval_adapter: the "r2lm" backend runs the local tasks under eval/tasks end to end through lm-eval's own
evaluator (multiple choice, generation, rolling perplexity), offline, and its scores are eval.likelihood's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from conftest import tiny_r2lm, tiny_tokenizer  # noqa: E402

from r2lm import scoring as sc  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
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
