"""The one decode loop and its transformers surface: model.generate and generation_config, hooks (stopping
criteria, step callback), LLaDA's sampler reproduced, the lean step (one host sync per step, compile == eager),
forward's arguments, the composable forward, and bad generate() arguments."""

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, GenerationConfig, MaxLengthCriteria, StoppingCriteria

from r2lm import Layout, R2LMForDiffusionLM, R2LMModel, generate
from r2lm.generation.sampling import propose
from r2lm.prefix import PrefixCache
from r2lm.unmasking import schedule
from tests.helpers.decoding import left_padded
from tests.helpers.models import MASK_ID, VOCAB, peaky, tiny_r2lm

R2LM = dict(sidecar_layers=[1, 3])
HYBRID = dict(sidecar_layers=[1], hybrid_layers=[0, 2], hybrid_feature_dim=8)


# ---------------------------------------------------------------------------------------------- transformers surface


def test_model_generate_reads_the_generation_config(tmp_path):
    model = peaky(**R2LM)
    model.generation_config.threshold, model.generation_config.block_size = 0.5, 4
    model.generation_config.max_new_tokens = 10
    model.save_pretrained(tmp_path / "m")
    loaded = R2LMForDiffusionLM.from_pretrained(tmp_path / "m")
    saved = GenerationConfig.from_pretrained(tmp_path / "m")
    assert (saved.threshold, saved.block_size, saved.max_new_tokens) == (0.5, 4, 10)
    ids, mask = left_padded(pads=(0, 3))
    want = generate(model, ids, mask, threshold=0.5, block_size=4, max_new_tokens=10).sequences
    assert torch.equal(loaded.generate(ids, attention_mask=mask), want)
    # keyword arguments override the file, a generation_config argument overrides the model's
    assert torch.equal(loaded.generate(ids, mask, factor=1.0), generate(model, ids, mask, factor=1.0, block_size=4,
                                                                       max_new_tokens=10).sequences)
    other = GenerationConfig(block_size=8, steps=4, max_new_tokens=16)
    out = loaded.generate(ids, mask, generation_config=other, return_dict_in_generate=True)
    assert torch.equal(out.sequences, generate(model, ids, mask, block_size=8, steps=4, max_new_tokens=16).sequences)
    assert out.steps == 4 and out.nfe == 4  # LLaDA's schedule: 2 steps per block; prompt and commits fused


def test_do_sample_follows_transformers():
    model = peaky(**R2LM)
    ids, mask = left_padded(pads=(0, 3))
    greedy = generate(model, ids, mask, max_new_tokens=8).sequences
    assert torch.equal(generate(model, ids, mask, max_new_tokens=8, do_sample=False, temperature=0.7).sequences, greedy)
    sampled = [generate(model, ids, mask, max_new_tokens=8, do_sample=True, temperature=5.0,
                        generator=torch.Generator().manual_seed(s)).sequences for s in (0, 0, 1)]
    assert torch.equal(sampled[0], sampled[1]) and not torch.equal(sampled[0], sampled[2])


def test_auto_classes(tmp_path):
    tiny_r2lm(**R2LM).save_pretrained(tmp_path / "m")
    assert type(AutoModel.from_pretrained(tmp_path / "m")) is R2LMModel
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "m")) is R2LMForDiffusionLM


def test_forward_refuses_what_it_does_not_use():
    model = tiny_r2lm()
    ids = torch.randint(0, MASK_ID, (2, 5))
    for name in ("past_key_values", "position_ids", "use_cache", "inputs_embeds"):
        with pytest.raises(TypeError, match=name):
            model(ids, **{name: None})
    with pytest.raises(ValueError, match="labels need a plain sequence"):
        model(ids, labels=ids, layout=Layout.span(torch.ones_like(ids)))


def test_labels_give_the_transformers_causal_lm_loss(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from r2lm.convert.from_hf import convert_from_hf

    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
    hf.save_pretrained(tmp_path / "hf")
    r2lm = R2LMForDiffusionLM.from_pretrained(convert_from_hf(tmp_path / "hf", tmp_path / "r2lm", mask_token_id=MASK_ID))
    ids = torch.randint(0, MASK_ID, (2, 11))
    labels = ids.clone()
    labels[0, :4] = -100
    with torch.no_grad():
        torch.testing.assert_close(r2lm(ids, labels=labels).loss, hf(ids, labels=labels).loss, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- hooks


class StopRowAfter(StoppingCriteria):
    def __init__(self, row, length):
        self.row, self.length = row, length

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[self.row] = input_ids.shape[1] >= self.length
        return done


def test_stopping_criteria_end_rows():
    model = peaky(**R2LM)
    ids, mask = left_padded(pads=(0, 3))
    free = generate(model, ids, mask, max_new_tokens=24, block_size=8, eos_token_id=[], pad_token_id=0)
    out = generate(model, ids, mask, max_new_tokens=24, block_size=8, eos_token_id=[], pad_token_id=0,
                   stopping_criteria=[StopRowAfter(row=2, length=9 + 8)])
    assert torch.equal(out.sequences[:2], free.sequences[:2])  # the other rows run on
    assert torch.equal(out.sequences[2, : 9 + 8], free.sequences[2, : 9 + 8]) and (out.sequences[2, 9 + 8 :] == 0).all()
    assert out.new_tokens == 24 + 24 + 8
    # transformers' own criterion ends every row, after the block in which the length is reached
    out = generate(model, ids, mask, max_new_tokens=24, block_size=8, stopping_criteria=[MaxLengthCriteria(9 + 10)])
    assert out.sequences.shape[1] == 9 + 16 and out.new_tokens == 3 * 16


def test_the_step_callback_sees_every_step():
    model = peaky(**R2LM)
    ids, mask = left_padded(pads=(0, 3))
    seen = []
    out = generate(model, ids, mask, max_new_tokens=20, block_size=8, threshold=0.6, eos_token_id=[],
                   step_callback=seen.append)
    assert len(seen) == out.steps and [s.step for s in seen] == list(range(out.steps))
    new = out.sequences[:, 9:]
    accepted = torch.zeros_like(new, dtype=torch.bool)
    for s in seen:
        start = int(s.start[0])
        assert (s.start == start).all()  # the block's: every row's
        cols = slice(start, start + s.masked.shape[1])
        assert not (s.accepted & ~s.masked).any() and (s.accepted.sum(1) >= s.masked.any(1)).all()
        assert not (accepted[:, cols] & s.accepted).any()  # a position is unmasked once
        assert torch.equal(s.proposals[s.accepted], new[:, cols][s.accepted])  # with the token it keeps
        assert s.logits.shape == (*s.masked.shape, VOCAB)
        accepted[:, cols] |= s.accepted
    assert accepted.all()


# ---------------------------------------------------------------------------------------------- LLaDA's rule


def test_llada_schedule_spreads_the_remainder_over_the_first_steps():
    masked = torch.ones(2, 16, dtype=torch.bool)
    masked[1, 10:] = False
    assert schedule(masked, 3).tolist() == [[6, 5, 5], [4, 3, 3]]


def test_confidence_is_the_unmodified_probability():
    logits = torch.tensor([[[2.0, 1.0, 3.0]]])  # [MASK] = 2 is the most likely token
    tokens, conf = propose(logits, mask_id=2)
    assert tokens.item() == 0 and conf.item() == pytest.approx(logits.softmax(-1)[0, 0, 0].item())


def llada_generate(model, prompt, steps, gen_length, block_length, mask_id):
    """LLaDA's sampler (ML-GSAI/LLaDA generate.py: greedy, low-confidence remasking, no cache), written from its
    description. One deviation: [MASK] is excluded from the argmax (a trained LLaDA never ranks it first; a random
    tiny model can), its probability still counting in the softmax the confidence is read from."""
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id)
    x[:, : prompt.shape[1]] = prompt
    num_blocks = gen_length // block_length
    for b in range(num_blocks):
        start, end = prompt.shape[1] + b * block_length, prompt.shape[1] + (b + 1) * block_length
        block_masked = x[:, start:end] == mask_id
        per_step = steps // num_blocks
        base, rem = block_masked.sum(1, keepdim=True) // per_step, block_masked.sum(1, keepdim=True) % per_step
        transfer_counts = base.expand(-1, per_step).clone()
        for row in range(x.shape[0]):
            transfer_counts[row, : rem[row]] += 1
        for i in range(per_step):
            mask_index = x == mask_id
            logits = model(x).logits
            p = torch.softmax(logits.double(), dim=-1)
            x0 = logits.masked_fill(torch.arange(logits.shape[-1]) == mask_id, float("-inf")).argmax(-1)
            x0_p = torch.gather(p, -1, x0[..., None])[..., 0]
            x0_p[:, end:] = float("-inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, float("-inf"))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for row in range(x.shape[0]):
                _, index = torch.topk(confidence[row], k=int(transfer_counts[row, i]))
                transfer[row, index] = True
            x[transfer] = x0[transfer]
    return x


@pytest.mark.parametrize("steps,gen_length,block_length", [(16, 16, 16), (6, 16, 16), (12, 24, 8), (9, 24, 8)])
def test_bidirectional_decoding_with_steps_is_lladas_sampler(steps, gen_length, block_length):
    torch.manual_seed(3)
    model = tiny_r2lm(attention="bidirectional", prediction="inplace", sidecar_layers=[])
    prompt = torch.randint(0, MASK_ID, (2, 7))
    want = llada_generate(model, prompt, steps, gen_length, block_length, MASK_ID)
    got = generate(model, prompt, max_new_tokens=gen_length, block_size=block_length, steps=steps, eos_token_id=[])
    assert torch.equal(got.sequences, want)


# ---------------------------------------------------------------------------------------------- the lean step


@pytest.mark.parametrize("kind", [R2LM, HYBRID, dict(attention="block_causal", sidecar_layers=[2])],
                         ids=["r2lm", "hybrid", "block_causal"])
def test_one_host_sync_per_denoising_step(kind):
    from eval.step_cost import syncs_per_step

    ids, mask = left_padded(pads=(0, 3))
    syncs = syncs_per_step(peaky(**kind), ids, max_new_tokens=24, block_size=8, threshold=0.9)
    assert syncs["steady_state"] == 1


@pytest.mark.slow
def test_compiled_step_equals_eager():
    model = peaky(**R2LM)
    ids, mask = left_padded(pads=(0, 3))
    eager = generate(model, ids, mask, max_new_tokens=12, block_size=6, threshold=0.6)
    compiled = generate(model, ids, mask, max_new_tokens=12, block_size=6, threshold=0.6, compile=True)
    assert torch.equal(compiled.sequences, eager.sequences) and compiled.nfe == eager.nfe
    whole = dict(verify=True, verify_policy="longest")  # (the same choices in both: forwards are counted)
    eager = generate(model, ids, mask, max_new_tokens=12, block_size=3, **whole)  # its own forward shapes
    compiled = generate(model, ids, mask, max_new_tokens=12, block_size=3, compile=True, **whole)
    assert torch.equal(compiled.sequences, eager.sequences) and compiled.nfe == eager.nfe
    eager = generate(model, ids, mask, max_new_tokens=12, block_size=3, verify_draft="lookup", **whole)
    compiled = generate(model, ids, mask, max_new_tokens=12, block_size=3, verify_draft="lookup", compile=True,
                        **whole)
    assert torch.equal(compiled.sequences, eager.sequences) and compiled.nfe == eager.nfe


# ---------------------------------------------------------------------------------------------- the forward


def test_the_forward_composes_over_layer_ranges():
    model = tiny_r2lm(open_gates=True, **R2LM)
    ids = torch.randint(0, MASK_ID, (2, 13))
    layout = Layout.cat(Layout.span(torch.ones(2, 5)), Layout.span(torch.ones(2, 8), start=5, noisy=True, chunk=1))
    inner = model.model
    with torch.no_grad():
        full = inner(ids, layout=layout).last_hidden_state
        plan = inner.plan(layout)
        h = inner(ids, plan, layers=range(0, 2), norm=False).last_hidden_state
        split = inner(hidden_states=h, plan=plan, layers=range(2, 4)).last_hidden_state
    assert torch.equal(split, full)


def test_attention_transfer_losses_are_counted_once_under_gradient_checkpointing():
    model = tiny_r2lm(open_gates=True, **HYBRID).train()
    ids = torch.randint(0, MASK_ID, (2, 20))
    layout = model.prompt_layout(torch.ones_like(ids))  # chunks of 8 columns: later chunks read earlier ones linearly
    plain = model.attention_transfer(ids, layout=layout)
    model.gradient_checkpointing_enable()
    checkpointed = model.attention_transfer(ids, layout=layout)
    assert plain.shape == checkpointed.shape == (2,)
    torch.testing.assert_close(checkpointed, plain)
    checkpointed.sum().backward()
    assert model.model.layers[0].self_attn.linear_attention.hedgehog_weights.grad.abs().sum() > 0


def test_the_reverse_mixer_is_the_flipped_causal_mixer():
    sidecar = tiny_r2lm(sidecar_layers=[1]).model.layers[1].sidecar
    for length in (5, 8, 21):  # within one chunk (8) and across chunks
        u = torch.randn(2, length, 64)
        with torch.no_grad():
            torch.testing.assert_close(sidecar.mixer(u, reverse=True), sidecar.mixer(u.flip(1)).flip(1),
                                       atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("args,message", [
    (dict(input_ids=torch.tensor([[5, VOCAB + 3, 6]])), "outside the vocabulary"),
    (dict(input_ids=torch.tensor([[5, -1, 6]])), "id -1 at a prompt token .row 0, column 1., outside the vocabulary"),
    (dict(input_ids=torch.tensor([[-1, 5, 6]]), attention_mask=torch.tensor([[0, 1, 1]])),
     "id -1 at a padding position .row 0, column 0., outside the vocabulary"),
    (dict(eos_token_id=[3, MASK_ID]), f"eos_token_id includes the mask token id {MASK_ID}"),
    (dict(input_ids=torch.tensor([[5.0, 6.0]])), "integer token ids"),
    (dict(max_new_tokens=4.0), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=True), "max_new_tokens must be a positive integer"),
    (dict(block_size="16"), "block_size must be a positive integer"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(stop_strings=[""], tokenizer=object()), "stop_strings must be non-empty strings"),
    (dict(prefix_cache={}), "prefix_cache must be an r2lm.prefix.PrefixCache"),
    (dict(attention_mask=torch.tensor([[0.5, 1.0, 1.0]])), "attention_mask must hold only 0"),
    (dict(steps=3, max_new_tokens=8, block_size=4), "steps .3. must be a multiple of the number of blocks .2"),
    (dict(eos_token_id=VOCAB), "eos_token_id .* is not a token id"),
    (dict(suffix_ids=torch.tensor([[MASK_ID]])), "suffix_ids must hold token ids"),
    (dict(nonsense=1), "unknown generate.. option"),
    (dict(compile=True, use_cache=False), "compile=True compiles the cached decode step"),
])
def test_bad_generate_arguments(args, message):
    model = tiny_r2lm(**R2LM)
    args = {"input_ids": torch.tensor([[5, 6, 7]]), **args}
    with pytest.raises(ValueError, match=message):
        generate(model, **args)


def test_a_verify_draft_longer_than_max_new_tokens_is_cut_to_it():
    """Its forwards would hold (block_size + 1) windows of block_size columns: a block_size of 600 for 5 tokens
    is cut to 5 (same output: verify's is the greedy AR text whatever the draft)."""
    model = peaky(**R2LM)
    ids, mask = left_padded(pads=(0, 3))
    want = generate(model, ids, mask, max_new_tokens=5, block_size=5, verify=True, verify_policy="longest")
    got = generate(model, ids, mask, max_new_tokens=5, block_size=600, verify=True, verify_windows=601,
                   verify_policy="longest")
    assert torch.equal(got.sequences, want.sequences) and got.nfe == want.nfe


def test_int32_ids_work():
    model = peaky(**R2LM)
    ids, mask = left_padded(pads=(0, 3))
    want = generate(model, ids, mask, max_new_tokens=6).sequences
    assert torch.equal(generate(model, ids.int(), mask.int(), max_new_tokens=6).sequences, want)
    assert isinstance(PrefixCache(64), PrefixCache)


def test_converters_write_the_decoding_options(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from r2lm.convert.from_hf import convert_from_hf
    from r2lm.convert.to_hybrid import convert_to_hybrid

    hf = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=3))
    hf.generation_config.eos_token_id, hf.generation_config.max_new_tokens = 3, 40
    hf.save_pretrained(tmp_path / "hf")
    r2lm = convert_from_hf(tmp_path / "hf", tmp_path / "r2lm", sidecar_layers=[1], mask_token_id=MASK_ID, block_size=8,
                           sidecar_headdim=16, sidecar_d_state=8)
    saved = GenerationConfig.from_pretrained(r2lm)
    assert (saved.block_size, saved.threshold, saved.eos_token_id, saved.max_new_tokens) == (8, 0.9, 3, 40)
    hybrid = convert_to_hybrid(r2lm, tmp_path / "hybrid", layers=[0], feature_dim=8)  # R2LM to R2LM keeps them
    assert GenerationConfig.from_pretrained(hybrid).to_diff_dict() == saved.to_diff_dict()


# ---------------------------------------------------------------------------------------------- fused commit


def unfused_generate(model, ids, mask, n, b, threshold):
    """The block decoder of docs/design.md 4 written with the public three uses of the forward and a separate commit
    forward per finished block: prefill, denoise until the block is clean, commit, next block."""
    from r2lm.unmasking import select

    shift = model.config.prediction == "shift"
    cache = model.new_cache(ids.shape[0], ids.shape[1] + n)
    head, head_mask = (ids[:, :-1], mask[:, :-1]) if shift else (ids, mask)
    model.prefill(head, cache, attention_mask=head_mask)
    opener, blocks = ids[:, -1:], []
    for start in range(0, n, b):
        block = torch.full((ids.shape[0], min(b, n - start)), MASK_ID)
        while (block == MASK_ID).any():
            window = torch.cat([opener, block[:, :-1]], 1) if shift else block
            tokens, conf = propose(model.denoise(window, cache), MASK_ID)
            block = torch.where(select(conf, block == MASK_ID, threshold), tokens, block)
        model.commit(torch.cat([opener, block[:, :-1]], 1) if shift else block, cache)
        opener = block[:, -1:]
        blocks.append(block)
    return torch.cat([ids, *blocks], 1)


@pytest.mark.parametrize("kind", [R2LM, dict(attention="block_causal", sidecar_layers=[2]), HYBRID,
                                  dict(prediction="inplace", sidecar_layers=[0])],
                         ids=["r2lm", "block_causal", "hybrid", "inplace"])
def test_fused_commits_equal_separate_commits_and_recompute(kind):
    model = peaky(**kind)
    ids, mask = left_padded(pads=(0, 3))
    fused = generate(model, ids, mask, max_new_tokens=21, block_size=8, threshold=0.6, eos_token_id=[])
    assert torch.equal(fused.sequences, unfused_generate(model, ids, mask, 21, 8, 0.6))
    recompute = generate(model, ids, mask, max_new_tokens=21, block_size=8, threshold=0.6, eos_token_id=[],
                         use_cache=False)
    assert torch.equal(fused.sequences, recompute.sequences)
    # no separate commit forwards; under causal softmax attention the prompt goes in with the first step too
    prefill = int(model.config.attention != "causal" or bool(model.config.hybrid_layers))
    assert fused.nfe <= fused.steps + prefill


@pytest.mark.parametrize("kind", [dict(attention="block_causal"), dict(hybrid_layers=[0, 2], hybrid_feature_dim=8)],
                         ids=["block_causal", "hybrid"])
@pytest.mark.parametrize("n, block_size", [(13, 4), (6, 5), (11, 5)])
def test_a_one_token_last_block_equals_recompute(n, block_size, kind):
    """A last block of one token has a clean window (under shift: the token before it). Only plain causal
    attention may commit it as it is read: read in the same forward as the previous block's clean columns it
    would share their chunk (block_causal attention would let them see it, block-hybrid layers fold chunks)."""
    model = peaky(sidecar_layers=[], block_size=block_size, **kind)
    ids, mask = left_padded(batch=16, length=7, pads=(0, 3))
    options = dict(max_new_tokens=n, block_size=block_size, threshold=0.9, eos_token_id=[])
    cached = generate(model, ids, mask, **options)
    assert torch.equal(cached.sequences, generate(model, ids, mask, use_cache=False, **options).sequences)


def test_the_parallelism_meter_bounds_accepted_by_oracle():
    from r2lm.generation import ParallelismMeter

    model = peaky(**R2LM)
    ids, mask = left_padded(pads=(0, 3))
    meter = ParallelismMeter()
    out = generate(model, ids, mask, max_new_tokens=20, block_size=8, threshold=0.6, eos_token_id=[], step_callback=meter)
    summary = meter.summary(out.sequences[:, ids.shape[1] :])
    assert summary["steps"] == out.steps
    assert summary["accepted_tpf"] == pytest.approx(out.new_tokens / summary["row_steps"])
    assert summary["oracle_tpf"] >= summary["accepted_tpf"]  # what was accepted was, by definition, right
    one = ParallelismMeter()
    out = generate(model, ids, mask, max_new_tokens=8, block_size=8, threshold=1.0, eos_token_id=[], step_callback=one)
    assert one.summary(out.sequences[:, ids.shape[1] :])["accepted_tpf"] == 1.0
