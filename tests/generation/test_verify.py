"""Verified decoding (invariant 8): generate(verify=True) is, token for token, the model's greedy AR decoding with
sidecars off: transformers' greedy generate of the source checkpoint, for an R2LM converted from it with its sidecar
gates open; and several tokens per forward once the drafter is good."""

import math

import pytest
import torch
from transformers import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList, TextStreamer

from r2lm import generate
from r2lm.convert.to_hf import without_sidecars
from r2lm.diffusion import compute_loss
from r2lm.generation.lookup import MAX_NGRAM
from r2lm.layout import Layout
from r2lm.prefix import PrefixCache
from tests.generation.test_lookup import FILL, brute_force
from tests.helpers.decoding import ar_greedy, left_padded
from tests.helpers.models import MASK_ID, tiny_conversion, tiny_r2lm, tiny_tokenizer


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def converted(request, tmp_path_factory):
    """(transformers model, its R2LM conversion with open sidecar gates)."""
    hf, r2lm = tiny_conversion(tmp_path_factory.mktemp(request.param), request.param, sidecar_layers=[0, 2],
                               sidecar_headdim=16, sidecar_d_state=8)
    with torch.no_grad():
        for layer in r2lm.model.layers:
            if layer.sidecar is not None:
                layer.sidecar.gate.fill_(0.7)  # the drafter differs from the backbone; the output must not
    return hf, r2lm


LOOKUP = dict(verify_draft="lookup")
# every draft submitted whole (r2lm.generation.policy.Longest): what the tests of the verification mechanics count
# forwards and accepted lengths under; the default policy may submit less, never changing the output
WHOLE = dict(verify_policy="longest")


@pytest.mark.parametrize("block_size,new_tokens,options", [(4, 24, {}), (5, 23, {}), (8, 13, {}), (1, 6, {}),
                                                         (8, 21, dict(verify_windows=2)), (5, 14, dict(verify_windows=4)),
                                                         (4, 24, LOOKUP), (5, 23, LOOKUP), (1, 6, LOOKUP)])
def test_verify_is_transformers_greedy(converted, block_size, new_tokens, options):
    hf, r2lm = converted
    ids, mask = left_padded()
    ids[:, -4:] = ids[:, 2:6]  # a repeated span: prompt lookup has drafts to offer (and its rows' padding differs)
    greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    out = generate(r2lm, ids, mask, max_new_tokens=new_tokens, block_size=block_size, verify=True, eos_token_id=[],
                   pad_token_id=0, **options)
    assert torch.equal(out.sequences, greedy)
    # window drafts: the prompt with the first draft, then at least one token per forward; lookup drafts: the
    # prompt with the first verification
    assert out.nfe <= (0 if options == LOOKUP else 1) + new_tokens


@pytest.mark.parametrize("options", [{}, LOOKUP])
def test_verify_stops_rows_at_eos_as_transformers(converted, options):
    hf, r2lm = converted
    ids, mask = left_padded()
    free = hf.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 4])
    greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=eos)
    out = generate(r2lm, ids, mask, max_new_tokens=20, block_size=4, verify=True, eos_token_id=eos, pad_token_id=0,
                   **options)
    assert torch.equal(out.sequences, greedy)


@pytest.mark.parametrize("options", [{}, LOOKUP])
def test_verify_with_stop_strings_streamer_and_prefix_cache(capsys, options):
    tok = tiny_tokenizer()
    model = tiny_r2lm(vocab_size=len(tok) + 1, mask_token_id=len(tok), open_gates=True, sidecar_layers=[1, 3])
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    prompt = tok("the quick brown", return_tensors="pt").input_ids
    ar = ar_greedy(model, prompt, 16)
    text = tok.decode(ar.sequences[0, prompt.shape[1] :])
    stop = text[4:7]
    out = generate(model, prompt, max_new_tokens=16, block_size=4, verify=True, eos_token_id=[], tokenizer=tok,
                   stop_strings=[stop], streamer=TextStreamer(tok, skip_prompt=True), **options)
    got = tok.decode(out.sequences[0, prompt.shape[1] :][: out.new_tokens])
    assert text.startswith(got) and stop in got and got.endswith(stop[-1])
    assert capsys.readouterr().out.strip() == got.strip()
    cache = PrefixCache(256, block_tokens=2)
    for _ in range(2):  # the second request resumes from the cached prompt
        cached = generate(model, prompt, max_new_tokens=16, block_size=4, verify=True, eos_token_id=[], prefix_cache=cache,
                          **options)
        assert torch.equal(cached.sequences, ar.sequences)
    assert cache.stats.hit_tokens > 0


def window_proposals(model, text, opener_at, b):
    """Oracle, a full recompute: the proposals of the ordinary decoding window [text[opener_at], [MASK] * (b-1)]
    read after the clean text before it."""
    context, window = text[:, :opener_at], torch.cat([text[:, opener_at : opener_at + 1],
                                                      text.new_full((1, b - 1), MASK_ID)], 1)
    layout = Layout.cat(Layout.span(torch.ones_like(context)),
                        Layout.span(torch.ones_like(window), start=opener_at, noisy=True, chunk=1))
    logits = model(torch.cat([context, window], 1), layout=layout, logits_to_keep=slice(opener_at, None)).logits
    logits[..., MASK_ID] = float("-inf")
    return logits.argmax(-1)


PATTERN = torch.tensor([7, 3, 11, 29, 5, 17, 23, 2, 13, 31, 19, 37])


def candidate_prompts(length: int, count: int = 60):
    """Prompts on the cycle, near it (one token replaced) and off it, in turn: what a drafter trained on the cycle
    accepts whole, in part, or not at all. Tests search them for the outcomes they need, up to `count`, and assert
    the search succeeded: which prompt gives which outcome rests on the float rounding of the drafter's training on
    this CPU, that the outcomes occur does not."""
    g = torch.Generator().manual_seed(7)
    for i in range(count):
        prompt = PATTERN[(torch.arange(length) + i) % 12]
        if i % 3 == 1:
            prompt[int(torch.randint(0, length, (1,), generator=g))] = int(torch.randint(0, MASK_ID - 1, (1,), generator=g))
        elif i % 3 == 2:
            prompt = torch.randint(0, MASK_ID - 1, (length,), generator=g)
        yield prompt[None]


def accepted_lengths(model, prompt, **options) -> tuple[torch.Tensor, list[int]]:
    """verify=True's output for `prompt`, and each verification forward's accepted draft length."""
    seen = []
    out = generate(model, prompt, verify=True, eos_token_id=[], step_callback=lambda info: seen.append(
        int(info.accepted.sum())), **WHOLE, **options)
    return out, seen


@pytest.mark.parametrize("b,windows", [(3, None), (4, None), (4, 2), (5, 3)])
def test_every_draft_is_the_window_read_at_the_committed_text(cycle_drafter, b, windows):
    """One forward verifies a draft and pre-drafts the outcomes it has windows for: after k accepted tokens the next
    draft is the window opened by the k-th committed token (every outcome drafted), else by the latest drafted one
    before it, read from the first uncommitted position on, then [MASK]. So every draft is conditioned on the
    committed text only, never on rejected tokens. Checked on prompts until drafts were accepted whole, in part
    and not at all, and (with fewer windows) after outcomes with no window of their own."""
    outcomes = list(range(b + 1)) if windows is None else [*range(windows - 1), b - 1]
    accepted = set()

    def covered():  # the cases under test
        return {0, b} <= accepted and accepted - {0, b} and (windows is None or accepted - set(outcomes))

    for prompt in candidate_prompts(7):
        seen = []

        def note(info, seen=seen):
            seen.append((int(info.start[0]), info.proposals.clone(), int(info.accepted.sum())))

        with torch.no_grad():
            out = generate(cycle_drafter, prompt, max_new_tokens=20, block_size=b, verify=True,
                           verify_windows=windows, eos_token_id=[], step_callback=note, **WHOLE)
            text, p = out.sequences, prompt.shape[1]
            expected = window_proposals(cycle_drafter, text, p - 1, b)  # the first draft: opened by the prompt
            for i, (start, draft, k) in enumerate(seen):
                assert torch.equal(draft, expected), i
                j, length = max(o for o in outcomes if o <= k), min(k + 1, b)
                proposals = window_proposals(cycle_drafter, text, p + start - 1 + j, b)[:, length - j :]
                expected = torch.cat([proposals, proposals.new_full((1, b - proposals.shape[1]), MASK_ID)], 1)
        accepted |= {k for *_, k in seen}
        if covered():
            break
    assert covered(), accepted


@pytest.fixture(scope="module")
def cycle_drafter():
    """A tiny R2LM after a little block-diffusion training on a repeating cycle: its window drafts what its AR
    decoding produces on the cycle (and not on other text)."""
    torch.manual_seed(0)
    model = tiny_r2lm(sidecar_layers=[1, 3], block_size=4).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(120):
        starts = torch.randint(0, 12, (8,), generator=g)
        x0 = torch.stack([PATTERN[(int(s) + torch.arange(32)) % 12] for s in starts])
        loss = compute_loss("block", model, x0, generator=g).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def paced(cycle_drafter):
    """(good, poor): two prompts whose rows take different numbers of verification forwards alone, under window
    drafts and under lookup drafts alike (24 new tokens, drafts of 4), found by a bounded search."""
    seen = []
    for prompt in candidate_prompts(10):
        steps = [generate(cycle_drafter, prompt, max_new_tokens=24, block_size=4, verify=True, eos_token_id=[],
                          **WHOLE, **options).steps for options in ({}, LOOKUP)]
        for other, other_steps in seen:
            if all(a < b for a, b in zip(steps, other_steps, strict=True)):
                return prompt, other
            if all(a > b for a, b in zip(steps, other_steps, strict=True)):
                return other, prompt
        seen.append((prompt, steps))
    raise AssertionError(f"no two prompts decode at different paces: {[steps for _, steps in seen]}")


def test_a_good_drafter_commits_several_tokens_per_forward(cycle_drafter):
    """Whole drafts are accepted (and the next draft is the window's), and the output is still exactly AR's."""
    for prompt in candidate_prompts(10):
        ar = ar_greedy(cycle_drafter, prompt, 24)
        out, seen = accepted_lengths(cycle_drafter, prompt, max_new_tokens=24, block_size=4)
        assert torch.equal(out.sequences, ar.sequences)
        if 4 in seen:
            break
    assert 4 in seen  # the case under test: a whole draft accepted
    assert out.tokens_per_forward > 1 and out.nfe < 24


def test_each_row_commits_its_own_accepted_length(cycle_drafter, paced):
    """In a batch, a row whose drafts are accepted is not held to the pace of one whose drafts are rejected: each
    row takes as many verification forwards as it takes alone, and the batch as many as its slowest row."""
    good, poor = paced
    alone = [generate(cycle_drafter, p, max_new_tokens=24, block_size=4, verify=True, eos_token_id=[], **WHOLE)
             for p in (good, poor)]
    both = generate(cycle_drafter, torch.cat([good, poor]), max_new_tokens=24, block_size=4, verify=True,
                    eos_token_id=[], **WHOLE)
    assert alone[0].steps < alone[1].steps  # the case under test: the rows accept at different rates
    assert torch.equal(both.sequences, torch.cat([run.sequences for run in alone]))
    assert both.row_steps == alone[0].steps + alone[1].steps
    assert both.steps == max(run.steps for run in alone)


def test_finished_rows_leave_the_forward(cycle_drafter, paced):
    """Once a row has all its tokens it leaves the cache and the forwards (they compute only the rows still
    decoding), and the rows that stay decode exactly as before."""
    good, poor = paced
    alone = [generate(cycle_drafter, p, max_new_tokens=24, block_size=4, verify=True, eos_token_id=[], **WHOLE)
             for p in (poor, good)]
    rows = []
    hook = cycle_drafter.model.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    try:
        both = generate(cycle_drafter, torch.cat([poor, good]), max_new_tokens=24, block_size=4, verify=True,
                        eos_token_id=[], **WHOLE)
    finally:
        hook.remove()
    assert torch.equal(both.sequences, torch.cat([run.sequences for run in alone]))
    fast, slow = alone[1].steps, alone[0].steps
    assert rows == [2] + [2] * fast + [1] * (slow - fast)  # the prompt with the first draft, then verifications


def bigram_cycle():
    """A tiny R2LM whose greedy AR decoding follows PATTERN by construction, whatever the float rounding: no layer
    adds anything to the residual stream (zero output projections), cycle token t is a basis vector of the hidden
    space, and the LM head row of the token after t is that vector, scaled."""
    model = tiny_r2lm(sidecar_layers=[1, 3], open_gates=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for i, t in enumerate(PATTERN.tolist()):
            embed[t] = torch.nn.functional.one_hot(torch.tensor(i), embed.shape[1]).float()
            head[int(PATTERN[(i + 1) % 12]), i] = 50.0
    return model


def test_lookup_drafts_commit_repeated_text_several_tokens_per_forward():
    """verify_draft="lookup": text that repeats what came before is drafted from it, and each forward reads only the
    draft's clean columns (no drafting window): after the prompt, forwards of exactly block_size columns."""
    model = bigram_cycle()
    prompt = torch.stack([PATTERN[(torch.arange(14) + s) % 12] for s in (3, 7)])  # the cycle, seen once whole
    ar = ar_greedy(model, prompt, 24)
    assert torch.equal(ar.sequences[:, 14:], torch.stack([PATTERN[(torch.arange(14, 38) + s) % 12] for s in (3, 7)]))
    widths = []
    hook = model.model.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    try:
        out = generate(model, prompt, max_new_tokens=24, block_size=4, verify=True, eos_token_id=[], **LOOKUP, **WHOLE)
    finally:
        hook.remove()
    assert torch.equal(out.sequences, ar.sequences)
    assert out.nfe == 24 // 4  # every draft of 4 accepted whole (the text continues as it did 12 tokens before)
    assert widths == [prompt.shape[1] - 1 + 4] + [4] * (out.nfe - 1)


def has_lookup_draft(text: list[int]) -> bool:
    """Brute force: the text's last token occurs earlier with a token after it (so a 1- or 2-token suffix recurs)."""
    return text[-1] in text[:-1]


def test_a_lookup_forward_without_drafts_is_one_column():
    """Where no row still decoding has a lookup draft, the verification forward is an AR step (one clean column,
    not b columns that cannot be accepted); where one has, b columns. Output: AR's."""
    model = tiny_r2lm(open_gates=True, sidecar_layers=[1, 3])
    ids = torch.stack([torch.randperm(MASK_ID - 1, generator=torch.Generator().manual_seed(s))[:8] for s in (0, 1)])
    ar = ar_greedy(model, ids, 24)
    widths, starts = [], []
    hook = model.model.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    try:
        out = generate(model, ids, max_new_tokens=24, block_size=4, verify=True, eos_token_id=[], **LOOKUP, **WHOLE,
                       step_callback=lambda info: starts.append(info.start.tolist()))
    finally:
        hook.remove()
    assert torch.equal(out.sequences, ar.sequences)
    text = ar.sequences.tolist()
    expected = [4 if any(has_lookup_draft(row[: 8 + at]) for row, at in zip(text, at_rows, strict=True) if at < 24)
                else 1 for at_rows in starts]
    assert widths[0] == 7 + expected[0] and widths[1:] == expected[1:]
    assert {1, 4} <= set(expected), expected  # both kinds of forward were seen


def test_a_lookup_draft_is_as_confident_as_the_suffix_it_matched_is_long():
    """Each step's lookup draft is the brute-force search's over the row's text so far, and its confidence (what the
    policy's acceptance cells read) is the matched suffix's length over MAX_NGRAM: a draft after the last two tokens
    is right far more often than one after the last token alone."""
    model = tiny_r2lm(open_gates=True, sidecar_layers=[1, 3])
    ids = torch.stack([torch.randperm(MASK_ID - 1, generator=torch.Generator().manual_seed(s))[:8] for s in (0, 1)])
    steps = []
    out = generate(model, ids, max_new_tokens=24, block_size=4, verify=True, eos_token_id=[], **LOOKUP, **WHOLE,
                   step_callback=lambda info: steps.append((info.start.tolist(), info.proposals, info.confidence)))
    text, seen = out.sequences.tolist(), set()
    for start, proposals, confidence in steps:
        for row, at in enumerate(start):
            if at >= 24:
                continue
            draft, n = brute_force(text[row][: 8 + at], 4, MAX_NGRAM)
            width = proposals.shape[1]
            assert proposals[row].tolist() == [MASK_ID if t == FILL else t for t in draft[:width]]
            assert confidence[row].tolist() == [0.0 if t == FILL else n / MAX_NGRAM for t in draft[:width]]
            seen.add(n)
    assert {1, 2} <= seen, seen  # both lengths were matched


@pytest.mark.parametrize("options", [{}, LOOKUP])
def test_only_committed_tokens_are_valid_in_the_cache(cycle_drafter, paced, monkeypatch, options):
    """After verify=True the cache's valid columns of a row hold, in order, exactly the keys and values a prefill
    of its committed text computes: every rejected draft token's column is invalid (here for the slow row of a
    batch whose fast row committed more per forward, then left)."""
    import r2lm.generation.verify as verify
    from r2lm.cache import KVCache

    contexts = []

    class Recorded(verify.ExactCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            contexts.append(self)

    monkeypatch.setattr(verify, "ExactCache", Recorded)
    good, poor = paced
    out = generate(cycle_drafter, torch.cat([poor, good]), max_new_tokens=24, block_size=4, verify=True,
                   eos_token_id=[], **WHOLE, **options)
    cache = contexts[0].reader.cache
    assert cache.batch_size == 1  # the fast row left
    text = out.sequences[:1, :-1]  # every committed token but the last has been fed back
    reference = KVCache(cycle_drafter.config, 1, text.shape[1], cycle_drafter.dtype, "cpu")
    cycle_drafter.prefill(text, reference)
    valid = cache.valid[0]
    assert valid.sum() >= text.shape[1] and not valid[: cache.length].all()  # rejected columns were kept, invalid
    for layer in range(cycle_drafter.config.num_hidden_layers):
        for mine, theirs in ((cache.key[layer], reference.key[layer]), (cache.value[layer], reference.value[layer])):
            torch.testing.assert_close(mine[0][:, valid][:, : text.shape[1]], theirs[0], atol=1e-5, rtol=1e-5)


def test_the_cache_grows_as_rows_drift_apart(cycle_drafter, paced, monkeypatch):
    """The verifier's cache starts at what AR steps need (the prompt, the new tokens and one forward's columns) and
    grows when rows commit at different paces (each forward keeps as many columns as the row that committed most:
    here under lookup drafts, the good row 4 a forward, the poor one fewer); every row's text is still the one it
    decodes alone."""
    import r2lm.generation.verify as verify

    contexts, opened = [], verify.ExactCache
    monkeypatch.setattr(verify, "ExactCache", lambda *a, **k: contexts.append(opened(*a, **k)) or contexts[-1])
    good, poor = paced
    alone = [generate(cycle_drafter, p, max_new_tokens=24, block_size=4, verify=True, eos_token_id=[], **WHOLE,
                      **LOOKUP) for p in (poor, good)]
    sizes = [c.reader.cache.max_length for c in contexts]
    both = generate(cycle_drafter, torch.cat([poor, good]), max_new_tokens=24, block_size=4, verify=True,
                    eos_token_id=[], **WHOLE, **LOOKUP)
    assert torch.equal(both.sequences, torch.cat([run.sequences for run in alone]))
    assert sizes == [poor.shape[1] + 24 + 4 + 4] * 2  # the prompt, the new tokens, one forward (a draft of 4)
    assert contexts[-1].reader.cache.max_length > sizes[0]  # it grew


def test_verify_refuses_what_it_cannot_verify():
    ids = torch.tensor([[5, 6, 7]])
    cases = [(dict(attention="block_causal"), {}, "attention='causal'"),
             (dict(hybrid_layers=[1], hybrid_feature_dim=8), {}, "softmax attention layers"),
             ({}, dict(temperature=0.8), "does not sample"),
             ({}, dict(use_cache=False), "exact cache"),
             ({}, dict(verify_windows=1), "verify_windows must be an int in"),
             ({}, dict(verify_windows=3, block_size=1), "verify_windows must be an int in"),
             ({}, dict(verify_draft="suffix"), "verify_draft must be one of"),
             ({}, dict(verify_draft="lookup", verify_windows=2), "drafts without any")]
    for overrides, options, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(tiny_r2lm(**overrides), ids, verify=True, **options)
    for options in (dict(verify_windows=2), LOOKUP):
        with pytest.raises(ValueError, match="pass verify=True"):
            generate(tiny_r2lm(), ids, **options)


@pytest.mark.parametrize("policy", ["longest", "adaptive"])
@pytest.mark.parametrize("options", [{}, dict(verify_windows=2), LOOKUP])
def test_an_iteration_synchronises_with_the_host_once(options, policy, monkeypatch):
    """Beyond the one planned read of an iteration's outcome (`tolist`, which the counter does not see, and which
    also brings the policy what it decides from), nothing in a verification iteration waits for the device: the
    counted synchronisations do not grow with the iterations (a sidecar reading several windows used to select
    their columns with a boolean mask, four per forward here)."""
    from eval.step_cost import OpCounter
    from r2lm.generation import costs
    from r2lm.generation.costs import REMEASURES, measured_tables

    model = tiny_r2lm(open_gates=True, sidecar_layers=[1, 3])
    ids = torch.randint(0, MASK_ID - 1, (1, 12), generator=torch.Generator().manual_seed(0))
    options = dict(options, verify_policy=policy)
    # costs measured, and measured again while steps disagree with them (a tiny model's steps are mostly host work):
    # a few times at most, here as soon as the steps ask (the budget lifted: not inside the counted calls)
    monkeypatch.setattr(costs, "REMEASURE_BUDGET", math.inf)
    for _ in range(REMEASURES + 1):
        generate(model, ids, max_new_tokens=36, block_size=4, verify=True, eos_token_id=[], **options)
        if policy == "longest" or all(table["final"] for table in measured_tables(model).values()):
            break
    counted = []
    for n in (12, 36):
        counter = OpCounter()
        with counter:
            out = generate(model, ids, max_new_tokens=n, block_size=4, verify=True, eos_token_id=[], **options)
        counted.append((counter.syncs, out.steps))
    (short, short_steps), (long, long_steps) = counted
    # a call's set-up reads the host a few times, more where the policy first uses a forward shape in it (the window
    # probed in one call and not the other): per iteration, nothing
    assert long_steps > short_steps + 10 and long - short < (long_steps - short_steps) / 2, counted


class LastTokenIs(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("options", [{}, LOOKUP])
def test_a_stop_inside_an_accepted_draft_is_ars(cycle_drafter, options):
    """A row that stops inside the tokens one verification commits (its EOS, or a stopping criterion that AR decoding
    checks after every token) stops where AR stops, and the output is as wide as AR's."""
    prompt = torch.stack([PATTERN[(torch.arange(14) + s) % 12] for s in (3, 7)])  # whole drafts accepted
    reference = without_sidecars(cycle_drafter)
    free = generate(reference, prompt, max_new_tokens=12, block_size=1, eos_token_id=[]).sequences[:, 14:]
    assert len(set(free[0, :3].tolist())) == 3  # (the cycle: no token repeats within it)
    cases = [dict(eos_token_id=int(free[0, 1])),
             dict(eos_token_id=[], stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(max_length=14 + 3)])),
             dict(eos_token_id=[], stopping_criteria=StoppingCriteriaList([LastTokenIs(int(free[0, 1]))]))]
    for case in cases:
        ar = generate(reference, prompt, max_new_tokens=12, block_size=1, pad_token_id=0, **case)
        out = generate(cycle_drafter, prompt, max_new_tokens=12, block_size=4, verify=True, pad_token_id=0,
                       **options, **case)
        assert torch.equal(out.sequences, ar.sequences), case
        assert out.new_tokens == ar.new_tokens
