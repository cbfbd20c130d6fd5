"""eval.likelihood: the held-out masked NLL equals a direct per-block computation through the cache, the Monte-Carlo
answer estimator matches the exact expectation over every mask subset, AR scoring is the exact next-token sum,
and scores rank the right choice first on models trained for a few dozen steps."""

import itertools
import json

import pytest
import torch
import torch.nn.functional as F

from eval import likelihood as lk
from r2lm import generate
from r2lm import scoring as sc
from r2lm.diffusion import compute_loss
from tests.helpers.models import MASK_ID, tiny_r2lm, tiny_tokenizer

KINDS = {
    "r2lm": dict(sidecar_layers=[1, 3]),
    "causal_dllm": dict(),
    "block_causal": dict(attention="block_causal", sidecar_layers=[2]),
    "inplace": dict(prediction="inplace", sidecar_layers=[0]),
    "hybrid": dict(sidecar_layers=[1], hybrid_layers=[0, 2], hybrid_feature_dim=8),
}


def data(batch=2, length=24, seed=1):
    return torch.randint(0, MASK_ID - 1, (batch, length), generator=torch.Generator().manual_seed(seed))


def ce(logits, target):
    return float(F.cross_entropy(logits.float(), target, reduction="sum"))


@torch.no_grad()
def direct_block_ce(model, x0, masked, b):
    """Sum of masked CE, block by block as decoding reads it: prefill the clean prefix, one denoise of the window."""
    o = int(model.config.prediction == "shift")
    total = 0.0
    for row in range(x0.shape[0]):
        x = x0[row : row + 1]
        for s in range(b, x.shape[1], b):
            e = min(s + b, x.shape[1])
            cache = model.new_cache(1, x.shape[1] + 1)
            model.prefill(x[:, : s - o], cache)
            xt = torch.where(masked[row : row + 1], MASK_ID, x)
            window = torch.cat([x[:, s - 1 : s], xt[:, s : e - 1]], 1) if o else xt[:, s:e]
            logits = model.denoise(window, cache)[0]
            m = masked[row, s:e]
            total += ce(logits[m], x[0, s:e][m])
    return total


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("ratio", [0.15, 0.5, 0.9])
def test_block_masked_nll_equals_per_block_decoding(kind, ratio):
    model = tiny_r2lm(open_gates=True, **KINDS[kind])
    x0, b = data(), 8
    scored = lk.scored_positions(x0, b, separator_id=None)
    masked = scored & (lk.position_uniforms(2, x0.shape[1], seed=0) < ratio)
    with torch.no_grad():
        got = sc.masked_token_ce(model, x0, masked, "block", b)
    assert torch.all(got[~masked] == 0)
    assert float(got.sum()) == pytest.approx(direct_block_ce(model, x0, masked, b), rel=1e-4)


@pytest.mark.parametrize("prediction", ["shift", "inplace"])
def test_single_stream_masked_nll_is_the_noisy_forward(prediction):
    model = tiny_r2lm(attention="bidirectional", prediction=prediction)
    x0, b = data(), 8
    masked = lk.scored_positions(x0, b, None) & (lk.position_uniforms(2, 24, seed=3) < 0.5)
    with torch.no_grad():
        logits = model(torch.where(masked, MASK_ID, x0)).logits
    o = int(prediction == "shift")
    want = sum(ce(logits[r, j - o][None], x0[r, j][None]) for r, j in torch.nonzero(masked).tolist())
    assert float(sc.masked_token_ce(model, x0, masked, "single").sum()) == pytest.approx(want, rel=1e-4)


def test_heldout_nll_aggregates_and_shares_masks_across_models():
    x0 = data(batch=3, length=32)
    x0[0, 20] = 7  # a separator: never masked, never scored
    r2lm, bidir = tiny_r2lm(open_gates=True, sidecar_layers=[1, 3]), tiny_r2lm(attention="bidirectional")
    a = lk.heldout_nll(r2lm, x0, ratios=(0.5,), block_size=8, batch_size=2, separator_id=7, elbo_points=4, progress=False)
    c = lk.heldout_nll(bidir, x0, ratios=(0.5,), block_size=8, batch_size=3, separator_id=7, progress=False)
    scored = lk.scored_positions(x0, 8, 7)
    masked = scored & (lk.position_uniforms(3, 32, seed=0) < 0.5)
    assert a["scored_tokens"] == c["scored_tokens"] == int(scored.sum())
    assert a["masked"]["0.5"]["masked_tokens"] == c["masked"]["0.5"]["masked_tokens"] == int(masked.sum())
    direct = direct_block_ce(r2lm, x0, masked, 8)
    assert a["masked"]["0.5"]["nll"] == pytest.approx(direct / int(masked.sum()), rel=1e-4)
    assert a["masked"]["0.5"]["elbo_term"] == pytest.approx(direct / (0.5 * int(scored.sum())), rel=1e-4)
    assert a["next_token_nll"] is not None and c["next_token_nll"] is None
    assert a["elbo"] is not None and a["mode"] == "block" and c["mode"] == "single"
    json.dumps(a), json.dumps(c)


def test_ar_mode_uses_the_block_layout_and_reports_next_token_nll():
    model, x0 = tiny_r2lm(), data(length=24)
    out = lk.heldout_nll(model, x0, ratios=(0.5,), mode="ar", block_size=8, progress=False)
    scored = lk.scored_positions(x0, 8, None)
    masked = scored & (lk.position_uniforms(2, 24, seed=0) < 0.5)
    assert out["masked"]["0.5"]["nll"] == pytest.approx(direct_block_ce(model, x0, masked, 8) / int(masked.sum()), rel=1e-4)
    with torch.no_grad():
        logits = model(x0).logits[:, :-1]
    want = F.cross_entropy(logits.flatten(0, 1), x0[:, 1:].flatten(), reduction="none").view(2, -1)[scored[:, 1:]].mean()
    assert out["next_token_nll"] == pytest.approx(float(want), rel=1e-5)
    with pytest.raises(ValueError, match="causal model with shift"):
        sc.eval_mode(tiny_r2lm(attention="bidirectional"), "ar")


@torch.no_grad()
def test_next_token_nll_with_open_sidecars_is_block_size_one_decoding():
    model, x0 = tiny_r2lm(open_gates=True, sidecar_layers=[1, 3]), data(batch=1, length=12)
    got = sc.next_token_ce(model, x0)
    for p in range(1, 12):
        cache = model.new_cache(1, 16)
        if p > 1:
            model.prefill(x0[:, : p - 1], cache)
        logits = model.denoise(x0[:, p - 1 : p], cache)[0]
        assert float(got[0, p]) == pytest.approx(ce(logits, x0[0, p : p + 1]), rel=1e-4)
    assert float(got[0, 0]) == 0
    plain = sc.next_token_ce(tiny_r2lm(sidecar_layers=[1, 3]), x0)  # closed gates: the plain causal forward
    assert not torch.allclose(plain, got)


# ---------------------------------------------------------------------------------------------- answers


@torch.no_grad()
def exact_answer_elbo(model, context, answer, b, mode):
    """E over x ~ U{1..n_j} and subsets |S| = x of (n_j / x) sum_{i in S} log p(a_i | ...), per block, summed; every
    subset computed directly (cache for block models, the noisy stream for single-stream ones)."""
    o = int(model.config.prediction == "shift")
    P, n = len(context), len(answer)
    z = torch.cat([context, answer])
    blocks = [(s, min(s + b, n)) for s in range(0, n, b)] if mode == "block" else [(0, n)]
    total = 0.0
    for s, e in blocks:
        k = e - s
        for x in range(1, k + 1):
            subsets = list(itertools.combinations(range(s, e), x))
            acc = 0.0
            for S in subsets:
                masked = torch.zeros(P + n, dtype=torch.bool)
                masked[[P + i for i in S]] = True
                zt = torch.where(masked, MASK_ID, z)
                if mode == "block":
                    cache = model.new_cache(1, P + n + 1)
                    model.prefill(z[None, : P + s - o], cache)
                    lp = torch.log_softmax(model.denoise(zt[None, P + s - o : P + e - o], cache)[0].float(), -1)
                    acc += sum(float(lp[i - s, answer[i]]) for i in S)
                else:
                    lp = torch.log_softmax(model(zt[None]).logits[0].float(), -1)
                    acc += sum(float(lp[P + i - o, answer[i]]) for i in S)
            total += (k / x) * acc / len(subsets) / k
    return total


@pytest.mark.parametrize("kind,block_size,n", [
    ("r2lm", 8, 3), ("r2lm", 2, 3), ("inplace", 8, 2), ("causal_dllm", 2, 3), ("bidirectional", 8, 3),
    ("bidirectional_inplace", 8, 3),
])
def test_monte_carlo_matches_the_exact_sum_over_mask_subsets(kind, block_size, n):
    overrides = {"bidirectional": dict(attention="bidirectional"),
                 "bidirectional_inplace": dict(attention="bidirectional", prediction="inplace")}.get(kind, KINDS.get(kind))
    model = tiny_r2lm(open_gates=True, **overrides)
    g = torch.Generator().manual_seed(5)
    context, answer = torch.randint(0, MASK_ID - 1, (6,), generator=g), torch.randint(0, MASK_ID - 1, (n,), generator=g)
    mode = sc.eval_mode(model)
    exact = exact_answer_elbo(model, context, answer, block_size, mode)
    estimates = [sc.answer_loglikelihood(model, context, answer, mc_num=768, batch_size=128, block_size=block_size, seed=s)
                 for s in range(2)]
    for est in estimates:
        assert est == pytest.approx(exact, abs=0.08 + 0.005 * abs(exact))
    assert estimates[0] == sc.answer_loglikelihood(model, context, answer, mc_num=768, batch_size=128,
                                                   block_size=block_size, seed=0)  # seeded: deterministic


@torch.no_grad()
def test_one_token_answers_are_exact_with_one_sample():
    model = tiny_r2lm(open_gates=True, sidecar_layers=[1, 3])
    context, answer = torch.arange(3, 9), torch.tensor([11])
    cache = model.new_cache(1, 8)
    model.prefill(context[None, :-1], cache)
    want = float(torch.log_softmax(model.denoise(torch.tensor([[8]]), cache)[0, 0].float(), -1)[11])
    assert sc.answer_loglikelihood(model, context, answer, mc_num=64) == pytest.approx(want, rel=1e-5)


def test_ar_scoring_is_the_exact_next_token_log_likelihood():
    model = tiny_r2lm()
    context, choices = [5, 6, 7, 8], [[9, 10, 11], [12], [13, 14]]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([context + choices[0]])).logits[0].float(), -1)
    want = sum(float(logp[3 + i, t]) for i, t in enumerate(choices[0]))
    scores = sc.score_choices(model, context, choices, mode="ar")
    assert scores[0] == pytest.approx(want, rel=1e-5) and len(scores) == 3
    greedy = generate(model, torch.tensor([context]), max_new_tokens=3, block_size=1, eos_token_id=[]).sequences[0, 4:].tolist()
    assert sc.greedy_reproduces(model, context, greedy, mode="ar")
    assert not sc.greedy_reproduces(model, context, [(greedy[0] + 1) % 90] + greedy[1:], mode="ar")


# ---------------------------------------------------------------------------------------------- trained models

PATTERN = torch.randperm(90, generator=torch.Generator().manual_seed(3))[:12] + 2  # a 12-token cycle


def cycle(start, length):
    return PATTERN[(start + torch.arange(length)) % 12]


def train(objective, steps=80, **overrides):
    """A tiny model trained on the repeating cycle with r2lm.diffusion's objective (a plain torch loop)."""
    model = tiny_r2lm(**overrides).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x0 = torch.stack([cycle(int(s), 32) for s in torch.randint(0, 12, (8,), generator=g)])
        loss = compute_loss(objective, model, x0, generator=g).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("name,objective,overrides,mode", [
    ("r2lm", "block", dict(sidecar_layers=[1, 3]), "auto"),
    ("causal_dllm", "block", dict(), "auto"),
    ("bidirectional", "mdlm", dict(attention="bidirectional"), "auto"),
    ("ar", "ar", dict(), "ar"),
])
def test_scores_rank_the_right_choice_first_after_training(name, objective, overrides, mode):
    model = train(objective, **overrides)
    context, right = cycle(5, 10), cycle(15, 3)
    wrong = [cycle(16, 3), right.flip(0), cycle(7, 3)]
    scores = sc.score_choices(model, context, [right, *wrong], mode=mode, mc_num=32)
    assert scores[0] > max(scores[1:]), scores
    assert sc.greedy_reproduces(model, context, right, mode)
    assert not sc.greedy_reproduces(model, context, wrong[0], mode)


def test_cli_writes_json(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_r2lm(open_gates=True, sidecar_layers=[1, 3], vocab_size=len(tok) + 1, mask_token_id=len(tok))
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    text = tmp_path / "heldout.txt"
    text.write_text("\n\n".join(["the quick brown fox jumps over the lazy dog"] * 6 + ["a diffusion model decodes many tokens"] * 6))
    out = tmp_path / "nll.json"
    result = lk.main([str(tmp_path / "m"), "--data", str(text), "--seq-len", "32", "--block-size", "8", "--out", str(out),
                      "--elbo-points", "2", "--device", "cpu"])
    saved = json.loads(out.read_text())
    assert saved["masked"].keys() == {"0.15", "0.5", "0.9"} and saved == json.loads(json.dumps(result))
    assert saved["num_sequences"] >= 2 and saved["mode"] == "block" and saved["next_token_nll"] > 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_context_cache_gives_the_full_layout_numbers(kind):
    model = tiny_r2lm(open_gates=True, **KINDS[kind])
    g = torch.Generator().manual_seed(2)
    context = torch.randint(0, MASK_ID - 1, (11,), generator=g)
    choices = [torch.randint(0, MASK_ID - 1, (n,), generator=g) for n in (3, 9, 1, 20)]
    cached = sc.score_choices(model, context, choices, mc_num=12, batch_size=5, block_size=4)
    full = sc.score_choices(model, context, choices, mc_num=12, batch_size=5, block_size=4, use_cache=False)
    assert cached == pytest.approx(full, rel=1e-4, abs=1e-4)


def teacher_forced_greedy(model, context, answer, block_size):
    """is_greedy the other way round (LLaDA's suffix_greedy_prediction): the answer fully masked, each step unmasks
    the most confident position of every block with its argmax, each block reading the clean *answer* blocks before
    it (all blocks checked in parallel through the full scoring layout); false at the first miss."""
    n = len(answer)
    masked = torch.ones(1, n, dtype=torch.bool)
    blocks = sc.answer_blocks(n, "block", block_size)
    while bool(masked.any()):
        logits = sc.answer_logprobs(model, context, answer, masked, "block", block_size, logits_only=True)[0].float()
        probs = logits.softmax(-1)
        probs[:, model.config.mask_token_id] = 0
        conf, tokens = probs.max(-1)
        for s, e in blocks:
            if bool(masked[0, s:e].any()):
                i = s + int(conf[s:e].masked_fill(~masked[0, s:e], -1.0).argmax())
                if int(tokens[i]) != int(answer[i]):
                    return False
                masked[0, i] = False
    return True


@pytest.mark.parametrize("kind", ["r2lm", "block_causal", "hybrid"])
def test_greedy_reproduction_through_generate_equals_teacher_forcing(kind):
    model = tiny_r2lm(open_gates=True, **KINDS[kind])
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    context = torch.randint(0, MASK_ID - 1, (7,), generator=torch.Generator().manual_seed(3))
    greedy = generate(model, context[None], max_new_tokens=9, block_size=4, steps=12, eos_token_id=[]).sequences[0, 7:]
    answers = [greedy, torch.cat([greedy[:5], (greedy[5:6] + 1) % (MASK_ID - 1), greedy[6:]]), greedy[:6]]
    for answer in answers:
        want = teacher_forced_greedy(model, context, answer, 4)
        assert sc.greedy_reproduces(model, context, answer, block_size=4) == want
    assert sc.greedy_reproduces(model, context, greedy, block_size=4)
