"""Served by vLLM (issue 38): SmolLM2-135M-Instruct converted as the quickstart converts it (sidecars on its top
layers) and a drafter of layout "dflash" trained briefly on its own greedy replies, exported (to-hf --drop-sidecars,
drafter-to-dflash) and run by vLLM 0.32 on CPU in its own environment (scripts/serve_env.sh, built on first use):
offline and through `vllm serve` on 127.0.0.1. vLLM's greedy text is r2lm's verify=True text on every prompt, and its
mean acceptance length is r2lm's τ for the same drafter and prompts within 2%."""

import json
import socket
import subprocess
import time
import urllib.request

import pytest
import torch

from eval.vllm_peer import export, mean_acceptance, run_engine, serve_argv, serve_python
from r2lm import R2LMForDiffusionLM, generate
from r2lm.drafter import Drafter, DrafterConfig

pytestmark = pytest.mark.slow

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.", "Name three primary colours.",
           "Explain in two sentences why the sky is blue.", "List the days of the week.",
           "Write a haiku about the sea.", "What is 12 times 7? Show your working."]
NEW = 64


def greedy_replies(target, prompts):
    return [generate(target, torch.tensor([ids]), max_new_tokens=NEW, block_size=1, eos_token_id=[]).sequences[0]
            for ids in prompts]


def train_dflash_drafter(target, texts, prompt_lens, steps=150) -> Drafter:
    """A DFlash-layout drafter fitted to the target's replies (r2lm.drafter's loss, a few hundred blocks): it guesses
    much of that text, so vLLM's acceptance has something to equal."""
    torch.manual_seed(0)
    vocab = torch.cat(texts).unique()
    drafter = Drafter(DrafterConfig.for_target(target.config, block_size=8, layout="dflash",
                                               draft_vocab_size=len(vocab)))
    drafter.draft_ids.copy_(vocab.sort().values)
    drafter.bind(target).start_from(target)
    drafter.train()
    length = max(len(t) for t in texts)
    ids = torch.stack([torch.cat([t, t.new_zeros(length - len(t))]) for t in texts])
    valid = torch.stack([torch.arange(length) < len(t) for t in texts]).long()
    reply = torch.stack([(torch.arange(length) >= n) & (torch.arange(length) < len(t))
                         for t, n in zip(texts, prompt_lens, strict=True)])
    with torch.no_grad():
        captured = target.model(ids, capture=tuple(drafter.config.feature_layers)).captured  # right-padded: causal
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    for step in range(steps):
        out = drafter.loss(captured, ids, valid, reply, blocks=16, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory, request):
    from transformers import AutoTokenizer

    python = serve_python()  # first: a machine that cannot build it fails here, before minutes of work
    smollm2 = request.getfixturevalue("smollm2")  # the quickstart's conversion (tests/conftest.py)
    root = tmp_path_factory.mktemp("vllm")
    target = R2LMForDiffusionLM.from_pretrained(smollm2).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for p in PROMPTS]
    texts = greedy_replies(target, prompts)
    drafter = train_dflash_drafter(target, texts, [len(p) for p in prompts])
    drafter.save_pretrained(root / "drafter")
    exported = export(smollm2, root / "served", root / "drafter")
    return python, root, target, Drafter.from_pretrained(root / "drafter").eval(), prompts, exported


def r2lm_verified(target, drafter, prompts):
    """Each prompt alone, drafted by the drafter alone, every block in full (as vLLM drafts): (new tokens, τ over the
    forwards after the prompt's: what vLLM's mean acceptance length counts)."""
    outputs, committed, forwards = [], 0, 0
    for ids in prompts:
        out = generate(target, torch.tensor([ids]), max_new_tokens=NEW, verify=True, drafter=drafter,
                       verify_draft="drafter", verify_policy="longest", eos_token_id=[])
        outputs.append(out.sequences[0, len(ids):].tolist())
        committed, forwards = committed + out.new_tokens - 1, forwards + out.nfe - 1
    return outputs, committed / forwards


def test_vllm_offline_writes_r2lm_verified_text_at_r2lm_acceptance(served):
    _, _, target, drafter, prompts, exported = served
    ours, tau = r2lm_verified(target, drafter, prompts)
    assert tau > 1.5, f"the drafter barely drafts ({tau:.2f}): the comparison would say little"
    answer = run_engine({"model": str(exported.base), "speculative_config": exported.speculative_config(),
                         "batches": [[ids] for ids in prompts], "max_tokens": NEW, "stop_token_ids": None,
                         "repeats": 1, "max_model_len": 1024})
    assert [b["outputs"][0] for b in answer["batches"]] == ours
    spec = {k: sum(b["spec"][k] for b in answer["batches"]) for k in ("drafts", "accepted")}
    assert mean_acceptance(spec) == pytest.approx(tau, rel=0.02), (spec, tau)


def test_vllm_serve_answers_through_the_openai_api(served):
    python, root, target, drafter, prompts, exported = served
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "serve.log", "w")
    server = subprocess.Popen(serve_argv(python, exported, port=port, max_model_len=1024), stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (root / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vllm serve did not come up within 10 minutes"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                time.sleep(2)
        body = json.dumps({"model": str(exported.base), "prompt": prompts[0], "max_tokens": NEW, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        choice = json.loads(urllib.request.urlopen(request, timeout=300).read())["choices"][0]
    finally:
        server.terminate()
        server.wait(timeout=60)
    ours, _ = r2lm_verified(target, drafter, prompts[:1])
    assert choice["token_ids"] == ours[0]
