"""The generator: cache exactness (invariant 2), AR equivalence (3), batch invariance (4), rules and errors."""

import pytest
import torch
from transformers import TextStreamer

from r2lm import generate
from r2lm.generation import contexts
from r2lm.unmasking import select
from tests.helpers.decoding import left_padded
from tests.helpers.models import MASK_ID, peaky, sharp_hf, tiny_conversion, tiny_r2lm, tiny_tokenizer

R2LM = dict(sidecar_layers=[1, 3])
BLOCK_CAUSAL = dict(attention="block_causal", sidecar_layers=[2])


RULES = [dict(threshold=0.6), dict(factor=1.0), dict(steps=9), dict(threshold=0.5, confidence="margin"),
         dict(threshold=0.5, confidence="entropy")]


HYBRID = dict(sidecar_layers=[1], hybrid_layers=[0, 2], hybrid_feature_dim=8)


@pytest.mark.parametrize("kind", [R2LM, BLOCK_CAUSAL, dict(prediction="inplace", sidecar_layers=[0]), HYBRID,
                                  dict(attention="block_causal", hybrid_layers=[1, 3], hybrid_feature_dim=8),
                                  dict(HYBRID, hybrid_tie_feature_maps=False)],
                         ids=["r2lm", "block_causal", "inplace", "r2lm+hybrid", "block_causal+hybrid", "r2lm+untied hybrid"])
@pytest.mark.parametrize("rule", RULES, ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items()))
def test_cached_equals_recompute(kind, rule):
    model = peaky(**kind)
    ids, mask = left_padded()
    cached = generate(model, ids, mask, max_new_tokens=21, block_size=8, **rule)
    recomputed = generate(model, ids, mask, max_new_tokens=21, block_size=8, use_cache=False, **rule)
    assert torch.equal(cached.sequences, recomputed.sequences)
    assert cached.steps == recomputed.steps
    assert cached.steps < 21  # several tokens per step: the parallel path is exercised


@pytest.mark.parametrize("clean", [False, True], ids=["window", "clean window"])
def test_the_prompt_read_with_the_first_window_is_the_full_forward(clean):
    """Invariant 2 for the first read of a causal model, which appends the left-padded prompt and reads the first
    window in one forward: its logits are the recompute oracle's (1e-5), and the cache it leaves holds a
    prefill's keys and values."""
    from r2lm.cache import KVCache
    from r2lm.generation.options import make_request

    model = peaky(**(R2LM if not clean else dict(sidecar_layers=[])))
    ids, mask = left_padded()
    block = 1 if clean else 4
    r = make_request(model, ids, mask, max_new_tokens=8, block_size=block)
    window = ids[:, -1:] if clean else torch.cat([ids[:, -1:], torch.full((3, block - 1), MASK_ID)], 1)
    exact, oracle = contexts.ExactCache(model, r.prompt, r.max_new_tokens, r.caching), contexts.Recompute(model, r.prompt)
    got = exact.read(0, window, block, clean=clean)
    torch.testing.assert_close(got, oracle.read(0, window, block, clean=clean), atol=1e-5, rtol=1e-5)
    assert exact.forwards == 1
    cache = exact.reader.cache
    reference = KVCache(model.config, 3, cache.max_length, model.dtype, "cpu")
    model.prefill(ids if clean else ids[:, :-1], reference, attention_mask=mask if clean else mask[:, :-1])
    assert cache.length == reference.length and torch.equal(cache.valid, reference.valid)
    for layer in range(model.config.num_hidden_layers):
        valid = cache.valid[:, None, : cache.length, None]
        for mine, theirs in ((cache.key[layer], reference.key[layer]), (cache.value[layer], reference.value[layer])):
            torch.testing.assert_close((mine[:, :, : cache.length] * valid), (theirs[:, :, : cache.length] * valid),
                                       atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", [dict(attention="block_causal", sidecar_layers=[]),
                                  dict(sidecar_layers=[], hybrid_layers=[0, 2], hybrid_feature_dim=8)],
                         ids=["block_causal", "hybrid"])
def test_fused_read_and_commit_equals_recompute(kind):
    """With no active sidecar a window without [MASK] is read and committed in one forward (block size 1 under
    shift: every window), which must give what the separate denoise of the recompute path gives."""
    model = peaky(**kind)
    ids, mask = left_padded()
    fused = generate(model, ids, mask, max_new_tokens=21, block_size=1)
    assert fused.nfe == 1 + 21  # prefill, then one forward per token
    assert torch.equal(fused.sequences, generate(model, ids, mask, max_new_tokens=21, block_size=1, use_cache=False).sequences)


@pytest.mark.parametrize("kind", [R2LM, BLOCK_CAUSAL, HYBRID], ids=["r2lm", "block_causal", "r2lm+hybrid"])
def test_rows_of_a_padded_batch_equal_rows_alone(kind):
    model = peaky(**kind)
    ids, mask = left_padded()
    batch = generate(model, ids, mask, max_new_tokens=20, block_size=8, threshold=0.6)
    for row in range(ids.shape[0]):
        n = int(mask[row].sum())
        alone = generate(model, ids[row : row + 1, -n:], max_new_tokens=20, block_size=8, threshold=0.6)
        assert torch.equal(alone.sequences[0, -20:], batch.sequences[row, -20:]), row


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_block_size_one_is_transformers_greedy(arch, tmp_path):
    """Invariant 3: gates at 0, shift, block size 1, greedy == the backbone's own generate(), with padding and EOS."""
    hf, r2lm = tiny_conversion(tmp_path, arch, sidecar_layers=[1], sidecar_headdim=16, sidecar_d_state=8)
    ids, mask = left_padded()
    greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    ours = generate(r2lm, ids, mask, max_new_tokens=24, block_size=1, eos_token_id=[], pad_token_id=0)
    assert torch.equal(ours.sequences, greedy)
    assert ours.nfe == 24  # one forward (read + commit) per token, the first with the prompt
    eos = int(greedy[0, ids.shape[1] + 5])  # a token the first row emits: an EOS that must stop rows identically
    greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=eos)
    ours = generate(r2lm, ids, mask, max_new_tokens=24, block_size=1, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ours.sequences, greedy)


def test_threshold_takes_at_least_one_token_per_row():
    conf = torch.rand(64, 16) * 0.5
    masked = torch.rand(64, 16) < 0.5
    masked[0] = False
    take = select(conf, masked, 0.9)  # the default rule: threshold
    assert torch.equal(take.sum(1) >= 1, masked.any(1))
    assert not (take & ~masked).any()
    top = conf.masked_fill(~masked, -1).argmax(1)
    assert take[torch.arange(64), top][masked.any(1)].all()


def test_nfe_is_bounded_by_new_tokens_plus_commits():
    model = peaky(**R2LM)
    ids, mask = left_padded()
    out = generate(model, ids, mask, max_new_tokens=21, block_size=8, threshold=1.0)
    commits = 1 + 3  # prompt prefill and one per block (the last block's commit is skipped at the end)
    assert out.steps == 21 and out.nfe <= 21 + commits  # threshold 1.0: exactly one token per step
    out = generate(model, ids, mask, max_new_tokens=21, block_size=8, threshold=0.6)
    assert out.steps < 21 and out.nfe <= 21 + commits and out.tokens_per_step > 1


def test_cache_is_allocated_once_and_never_moves(monkeypatch):
    caches = []

    class Recorded(contexts.KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.pointers = [t.data_ptr() for t in self.key + self.value]
            caches.append(self)

    monkeypatch.setattr(contexts, "KVCache", Recorded)
    model = peaky(**R2LM)
    ids, mask = left_padded()
    generate(model, ids, mask, max_new_tokens=21, block_size=8)
    assert len(caches) == 1
    cache = caches[0]
    assert [t.data_ptr() for t in cache.key + cache.value] == cache.pointers
    assert cache.length == ids.shape[1] - 1 + 16  # prompt (but its last token) + two committed blocks


def test_eos_stops_a_row_and_pads_after_it():
    model = peaky(**R2LM)
    ids, mask = left_padded()
    free = generate(model, ids, mask, max_new_tokens=16, block_size=8, threshold=0.6, eos_token_id=[])
    new = free.sequences[:, ids.shape[1] :]
    eos = int(new[1, 3])
    out = generate(model, ids, mask, max_new_tokens=16, block_size=8, threshold=0.6, eos_token_id=eos, pad_token_id=MASK_ID - 1)
    got = out.sequences[:, ids.shape[1] :]
    for row in range(3):
        hits = (new[row] == eos).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else 16
        assert torch.equal(got[row, :stop], new[row, :stop])
        assert (got[row, stop:] == MASK_ID - 1).all()


@pytest.mark.parametrize("verify", [False, True])
def test_a_row_that_stops_early_does_not_dilute_tokens_per_step(verify):
    """AR decoding takes one token per step and row, whatever the batch: a row that stopped (EOS) while the others
    go on is not counted in the steps after its stop."""
    model = tiny_r2lm(seed=0)  # closed gates: verify=True decodes what AR does
    ids, mask = left_padded()
    options = dict(max_new_tokens=12, block_size=1) if not verify else dict(max_new_tokens=12, block_size=4, verify=True)
    free = generate(model, ids, mask, eos_token_id=[], **options).sequences[:, ids.shape[1] :]
    eos = int(free[0, 1])
    assert not (free[1:] == eos).any() and not (free[0, :1] == eos).any()  # only row 0 stops, after its 2nd token
    out = generate(model, ids, mask, eos_token_id=eos, pad_token_id=MASK_ID - 1, **options)
    assert out.new_tokens == 2 + 12 + 12
    if verify:  # the rows still decoding are each counted per iteration
        assert out.row_steps < out.steps * 3
    else:
        assert out.row_steps == out.new_tokens and out.tokens_per_step == 1.0
        assert out.nfe == out.steps and out.tokens_per_forward == 1.0  # the prompt goes in with the first step

def stopping_token(new: torch.Tensor, block_size: int):
    """A token that, taken as EOS, stops the rows of `new` [B, n] (their EOS-free generation) in at least two
    different blocks, with one row still running after the first block that holds a stop; and each row's stop
    (its first occurrence, + 1; n where it has none). A search over the tokens generated, asserted to succeed, so
    the case under test occurs whatever the float rounding of the machine."""
    n = new.shape[1]
    for token in new.unique().tolist():
        stops = [int(hits[0]) + 1 if len(hits := (row == token).nonzero()) else n for row in new]
        blocks = [(s - 1) // block_size for s in stops]
        if len(set(blocks)) > 1 and min(blocks) < (n - 1) // block_size:
            return token, stops
    raise AssertionError("no generated token stops the rows in different blocks")


EVICTING = [(dict(R2LM), dict(threshold=0.6)), (dict(R2LM), dict(factor=1.0)), (dict(R2LM), dict(steps=24)),
            (dict(R2LM), dict(threshold=0.6, use_cache=False)), (dict(BLOCK_CAUSAL), dict(threshold=0.6)),
            (dict(HYBRID), dict(threshold=0.6)),
            (dict(attention="bidirectional", sidecar_layers=[]), dict(steps=24)),
            (dict(attention="bidirectional", sidecar_layers=[]), dict(steps=24, approximate_cache="dual")),
            (dict(R2LM), dict(threshold=0.6, prefix_cache=True))]


@pytest.mark.parametrize("kind, options", EVICTING, ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()))
def test_finished_rows_leave_every_decoders_forwards(kind, options):
    """Once a row has stopped (EOS) it leaves the forwards at the end of that block, in every decoder: each forward
    computes only the rows still decoding, and every row's text is what it decodes alone."""
    from r2lm.prefix import PrefixCache

    model = peaky(**kind)
    ids, mask = left_padded(batch=4, pads=(0, 3, 6, 1))
    b, n = 4, 16

    def run(ids, mask, **extra):
        if options.get("prefix_cache"):  # a fresh prefix cache per call: every row misses, then fills it
            extra["prefix_cache"] = PrefixCache(capacity_tokens=256)
        return generate(model, ids, mask, max_new_tokens=n, block_size=b, pad_token_id=MASK_ID - 1,
                        **{k: v for k, v in options.items() if k != "prefix_cache"}, **extra)

    eos, stops = stopping_token(run(ids, mask, eos_token_id=[]).sequences[:, ids.shape[1]:], b)
    rows, starts = [], []
    hook = model.model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(
        (args[0] if args and args[0] is not None else kwargs["hidden_states"]).shape[0]), with_kwargs=True)
    try:
        out = run(ids, mask, eos_token_id=eos, step_callback=lambda info: starts.append(int(info.start[0])))
    finally:
        hook.remove()
    alone = [run(ids[i : i + 1, mask[i].bool()], None, eos_token_id=eos).sequences[0, int(mask[i].sum()):]
             for i in range(4)]
    for row, stop in enumerate(stops):
        assert torch.equal(out.sequences[row, ids.shape[1]:][:stop], alone[row][:stop]), row
    running = [sum(stop > start for stop in stops) for start in starts]  # rows whose stop is not before the block
    assert rows[-len(starts):] == running, (rows, running)
    assert running[-1] < 4  # the case under test: rows left


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    model = peaky(**R2LM)
    ids, mask = left_padded()
    runs = [generate(model, ids, mask, max_new_tokens=12, temperature=0.8, top_p=0.9,
                     generator=torch.Generator().manual_seed(7)).sequences for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    greedy = generate(model, ids, mask, max_new_tokens=12).sequences
    sampled_top1 = generate(model, ids, mask, max_new_tokens=12, temperature=1.3, top_k=1, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sampled_top1.sequences, greedy)


def test_streamer_and_stop_strings(capsys):
    tok = tiny_tokenizer()
    model = peaky(vocab_size=len(tok) + 1, mask_token_id=len(tok), **R2LM)
    prompt = tok("the quick brown", return_tensors="pt").input_ids
    free = generate(model, prompt, max_new_tokens=16, block_size=4, eos_token_id=[])
    text = tok.decode(free.sequences[0, prompt.shape[1] :])
    stop = text[3:6]
    out = generate(model, prompt, max_new_tokens=16, block_size=4, eos_token_id=[], tokenizer=tok, stop_strings=[stop],
                   streamer=TextStreamer(tok, skip_prompt=True))
    got = tok.decode(out.sequences[0, prompt.shape[1] :][: out.new_tokens])
    assert stop in got and got.endswith(stop[-1]) and len(got) < len(text)
    assert capsys.readouterr().out.strip() == got.strip()


def test_a_stop_string_before_an_eos_of_the_same_block_stops_the_row():
    """The earlier stop wins (as in transformers' generate): a stop string complete after 2 tokens, an EOS that the
    same block produces later."""
    tok = tiny_tokenizer()
    model = peaky(vocab_size=len(tok) + 1, mask_token_id=len(tok), **R2LM)
    prompt = tok("the quick brown", return_tensors="pt").input_ids
    free = generate(model, prompt, max_new_tokens=8, block_size=8, eos_token_id=[]).sequences[0, prompt.shape[1] :]
    eos = next(int(t) for j, t in enumerate(free.tolist()) if j >= 3 and t not in free[:j].tolist())
    stop = tok.decode(free[:2])
    k = next(k for k in range(1, 9) if stop in tok.decode(free[:k]))
    out = generate(model, prompt, max_new_tokens=8, block_size=8, eos_token_id=eos, tokenizer=tok, stop_strings=[stop])
    assert out.new_tokens == k and torch.equal(out.sequences[0, prompt.shape[1] :][:k], free[:k])


def test_the_stopper_searches_the_text_before_an_eos_it_has_not_seen_yet():
    """verify=True checks stop strings on the text every row has (the slowest row's length): a row that an EOS
    stopped further on is still searched up to that EOS as the text arrives."""
    from types import SimpleNamespace

    from r2lm.generation.stopping import Stopper

    tok = tiny_tokenizer()
    tokens = tok("one two three four five six", return_tensors="pt").input_ids[:, :6]
    eos = int(tokens[0, 5])
    r = SimpleNamespace(eos_ids=[eos], pad_id=0, mask_id=MASK_ID, stop_strings=[tok.decode(tokens[0, 2:4])],
                        tokenizer=tok, streamer=None, stopping_criteria=[])
    empty = tokens.new_zeros(1, 0)  # the prompt: none
    stopper = Stopper(r, empty, empty)
    stopper.check_eos(tokens.clone(), 0)
    assert stopper.stop_at.tolist() == [6]  # the EOS
    stopper.end_block(tokens, 0, 2)  # the text every row has: two tokens, the stop string is not complete
    assert stopper.stop_at.tolist() == [6]
    stopper.end_block(tokens, 0, 5)
    assert stopper.stop_at.tolist() == [4]


@pytest.mark.parametrize("options", [dict(block_size=1), dict(verify=True, block_size=4),
                                     dict(verify=True, block_size=4, verify_draft="lookup")])
def test_a_stop_string_that_begins_in_the_prompt_stops_as_in_transformers(tmp_path, options):
    """transformers' StopStringCriteria reads the whole sequence: a stop string that begins in the prompt and ends
    in the generated text stops generation, and r2lm stops at the same token."""
    from r2lm import R2LMForDiffusionLM
    from r2lm.convert.from_hf import convert_from_hf

    tok = tiny_tokenizer()
    hf = sharp_hf("qwen3", vocab_size=len(tok) + 1)  # the tokenizer's ids, and [MASK]
    hf.save_pretrained(tmp_path / "hf")
    model = R2LMForDiffusionLM.from_pretrained(convert_from_hf(tmp_path / "hf", tmp_path / "r2lm", sidecar_layers=[],
                                                               mask_token_id=len(tok))).eval()
    prompt = tok("the quick brown fox", return_tensors="pt").input_ids
    free = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    text, generated = tok.decode(prompt[0]), tok.decode(free[0, prompt.shape[1]:])
    stop = text[-2:] + generated[:2]  # spans the prompt's end
    assert stop not in text and stop not in generated[:-1]  # the case under test: it exists only across the boundary
    theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None,
                         stop_strings=[stop], tokenizer=tok)
    ours = generate(model, prompt, max_new_tokens=12, eos_token_id=[], pad_token_id=0, tokenizer=tok,
                    stop_strings=[stop], **options)
    assert ours.new_tokens == theirs.shape[1] - prompt.shape[1] < 12
    assert torch.equal(ours.sequences[:, : theirs.shape[1]], theirs)


@pytest.mark.parametrize("cache", [None, "prefix", "dual"])
@pytest.mark.parametrize("prediction", ["inplace", "shift"])
def test_bidirectional_baselines(cache, prediction):
    model = peaky(attention="bidirectional", prediction=prediction, sidecar_layers=[])
    ids, mask = left_padded()
    out = generate(model, ids, mask, max_new_tokens=20, block_size=8, steps=12, approximate_cache=cache)
    assert out.sequences.shape == (3, ids.shape[1] + 20) and not (out.sequences == MASK_ID).any()
    assert out.nfe == out.steps == 4 + 4 + 4  # four steps per block (LLaDA's schedule): blocks of 8, 8 and 4 tokens
    if cache == "prefix":  # one-block canvas: the prefix cache starts from the same full forward as no cache
        exact = generate(model, ids, mask, max_new_tokens=8, block_size=8, steps=1)
        approx = generate(model, ids, mask, max_new_tokens=8, block_size=8, steps=1, approximate_cache=cache)
        assert torch.equal(exact.sequences, approx.sequences)


def test_model_method_is_the_same_generator():
    model = peaky(**R2LM)
    ids, mask = left_padded()
    assert torch.equal(model.generate(ids, mask, max_new_tokens=9), generate(model, ids, mask, max_new_tokens=9).sequences)


@pytest.mark.parametrize(
    "args,message",
    [
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "empty prompt"),
        (dict(input_ids=torch.tensor([[5, MASK_ID, 6]])), f"row 0 contains the mask token id {MASK_ID}"),
        (dict(max_new_tokens=510), r"prompt \(3 tokens\) \+ max_new_tokens \(510\) exceeds the model's maximum length 512"),
        (dict(attention_mask=torch.tensor([[0, 0, 0]])), "row 0 of the batch is all padding"),
        (dict(attention_mask=torch.tensor([[1, 1, 0]])), "must be left-padded"),
        (dict(block_size=0), "block_size must be a positive integer"),
        (dict(threshold=0.0), r"threshold must be in \(0, 1\]"),
        (dict(threshold=1.5), r"threshold must be in \(0, 1\]"),
        (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
        (dict(stop_strings=["x"]), "stop_strings need the tokenizer"),
        (dict(approximate_cache="dual"), "approximate_cache is for bidirectional models"),
        (dict(factor=1.0, steps=2), "at most one unmasking rule"),
        (dict(confidence="vibes"), "unknown confidence"),
    ],
)
def test_bad_input(args, message):
    model = tiny_r2lm(**R2LM)
    args = {"input_ids": torch.tensor([[5, 6, 7]]), **args}
    with pytest.raises(ValueError, match=message):
        generate(model, **args)
