"""A drafter for a frozen target (r2lm.drafter) behind verify=True: whatever it drafts, the output is transformers'
greedy generate of the source checkpoint (left-padded batches, EOS, stop strings, prompts shorter than a block);
it never changes the target; it saves and loads beside its target; a drafter made for another target is refused."""

import pytest
import torch

from r2lm import R2LMForDiffusionLM, generate
from r2lm.drafter import Drafter, DrafterConfig
from tests.helpers.decoding import left_padded
from tests.helpers.models import MASK_ID, tiny_conversion, tiny_tokenizer

DRAFTS = [dict(verify_draft="drafter"), dict(verify_draft="lookup+drafter")]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers model, its R2LM conversion without sidecars): the frozen target."""
    return tiny_conversion(tmp_path_factory.mktemp("drafter"), "qwen3", sidecar_layers=[])


def untrained(target, **choices) -> Drafter:
    torch.manual_seed(1)
    return Drafter(DrafterConfig.for_target(target.config, block_size=4, **choices)).eval()


def trained(target, steps: int = 60) -> Drafter:
    """A drafter trained for a few dozen steps on the target's own greedy text (its loss: r2lm.drafter): it guesses
    part of what the target writes, so drafts are accepted whole, in part and not at all."""
    drafter = untrained(target, draft_vocab_size=64).train()
    text = generate(target, torch.randint(0, MASK_ID - 1, (16, 6), generator=torch.Generator().manual_seed(2)),
                    max_new_tokens=40, block_size=1, eos_token_id=[]).sequences
    drafter.draft_ids.copy_(text.flatten().bincount(minlength=MASK_ID + 1).topk(64).indices.sort().values)
    drafter.bind(target)
    layers = tuple(drafter.config.feature_layers)
    with torch.no_grad():
        captured = target.model(text, capture=layers).captured
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(0)
    valid, reply = torch.ones_like(text), torch.arange(text.shape[1]).expand_as(text) >= 6  # after the prompt
    for _ in range(steps):
        out = drafter.loss(captured, text, valid, reply, blocks=8, generator=g)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return drafter.eval()


@pytest.mark.parametrize("drafts", DRAFTS, ids=lambda d: d["verify_draft"])
@pytest.mark.parametrize("training", ["untrained", "trained"])
def test_verify_with_a_drafter_is_transformers_greedy(converted, training, drafts):
    hf, target = converted
    drafter = untrained(target) if training == "untrained" else trained(target)
    ids, mask = left_padded()
    ids[:, -4:] = ids[:, 2:6]  # a repeated span: lookup has something to copy
    for new_tokens in (3, 23):  # fewer tokens than a draft, and several drafts
        greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
        out = generate(target, ids, mask, max_new_tokens=new_tokens, verify=True, drafter=drafter, eos_token_id=[],
                       pad_token_id=0, **drafts)
        assert torch.equal(out.sequences, greedy)
    free = greedy[:, ids.shape[1]:]
    eos = int(free[0, 5])  # EOS: a token row 0 writes (its 6th)
    stopped = hf.generate(ids, attention_mask=mask, max_new_tokens=23, do_sample=False, pad_token_id=0, eos_token_id=eos)
    out = generate(target, ids, mask, max_new_tokens=23, verify=True, drafter=drafter, eos_token_id=eos, pad_token_id=0,
                   **drafts)
    assert torch.equal(out.sequences, stopped[:, : out.sequences.shape[1]])
    for short in (ids[:1, -1:], ids[:1, -2:]):  # prompts shorter than a block
        greedy = hf.generate(short, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
        out = generate(target, short, max_new_tokens=10, verify=True, drafter=drafter, eos_token_id=[], **drafts)
        assert torch.equal(out.sequences, greedy)


def test_a_trained_drafter_is_accepted_whole_in_part_and_not_at_all(converted):
    """The cases verification must get right all occur (searched over prompts, within a bound), and each
    verification commits the accepted guesses plus the target's own next token."""
    hf, target = converted
    drafter = trained(target)
    seen = set()
    for seed in range(20):
        prompt = torch.randint(0, MASK_ID - 1, (1, 6), generator=torch.Generator().manual_seed(100 + seed))
        accepted = []
        out = generate(target, prompt, max_new_tokens=24, verify=True, drafter=drafter, verify_draft="drafter",
                       verify_policy="longest", eos_token_id=[],
                       step_callback=lambda info, seen=accepted: seen.append(int(info.accepted.sum())))
        greedy = hf.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert torch.equal(out.sequences, greedy)
        assert out.nfe == len(accepted)
        seen |= set(accepted[1:])  # (the first forward has no draft: it appends the prompt)
        if {0, 4} <= seen and seen - {0, 4}:
            break
    assert {0, 4} <= seen and seen - {0, 4}, seen


def test_the_drafter_never_changes_the_target(converted):
    hf, target = converted
    before = {k: v.clone() for k, v in target.state_dict().items()}
    drafter = trained(target, steps=3)
    generate(target, left_padded()[0], max_new_tokens=12, verify=True, drafter=drafter, eos_token_id=[])
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert not any(p.requires_grad and p.grad is not None for p in target.parameters())


def test_a_drafter_saves_and_loads_beside_its_target(converted, tmp_path):
    hf, target = converted
    drafter = trained(target, steps=3)
    drafter.save_pretrained(tmp_path / "drafter")
    files = {p.name for p in (tmp_path / "drafter").iterdir()}
    assert "config.json" in files and "model.safetensors" in files
    loaded = Drafter.from_pretrained(tmp_path / "drafter").eval()
    assert loaded.config.to_diff_dict() | {"_name_or_path": ""} == drafter.config.to_diff_dict() | {"_name_or_path": ""}
    assert torch.equal(loaded.draft_ids, drafter.draft_ids)
    target_weights = {k for k in target.state_dict()}
    assert not target_weights & set(loaded.state_dict())  # the target's weights are not in the drafter's folder
    ids = left_padded()[0]
    runs = [generate(target, ids, max_new_tokens=16, verify=True, drafter=d, verify_draft="drafter", eos_token_id=[])
            for d in (drafter, loaded)]
    assert torch.equal(runs[0].sequences, runs[1].sequences) and runs[0].nfe == runs[1].nfe


@pytest.mark.parametrize("change, message", [(dict(hidden_size=32, head_dim=8), "hidden size 64"),
                                             (dict(vocab_size=MASK_ID + 5), "vocabulary"),
                                             (dict(num_hidden_layers=4), "layer count 3")])
def test_a_drafter_for_another_target_is_refused(converted, change, message):
    hf, target = converted
    drafter = untrained(target)
    config = target.config.to_dict()
    config.update(change)
    other = R2LMForDiffusionLM(type(target.config).from_dict(config)).eval()
    with pytest.raises(ValueError, match=f"made for another target: .*{message}"):
        generate(other, torch.tensor([[5, 6, 7]]), max_new_tokens=4, verify=True, drafter=drafter)
    with pytest.raises(ValueError, match="made for another target"):
        drafter.bind(other)


def test_drafter_options_are_checked(converted):
    hf, target = converted
    ids = torch.tensor([[5, 6, 7]])
    drafter = untrained(target)
    cases = [(dict(verify=True, verify_draft="drafter"), "needs a drafter"),
             (dict(verify=True, drafter=drafter, verify_draft="lookup"), "does not use the drafter"),
             (dict(drafter=drafter), "pass verify=True"),
             (dict(verify=True, drafter="a folder"), "must be an r2lm.drafter.Drafter"),
             (dict(verify=True, drafter=drafter, verify_windows=2), "drafts without any")]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(target, ids, max_new_tokens=4, **options)


def test_drafter_config_is_checked():
    with pytest.raises(ValueError, match="feature_layers"):
        DrafterConfig(target_num_hidden_layers=4, feature_layers=[4])
    with pytest.raises(ValueError, match="in_block"):
        DrafterConfig(in_block="sideways")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DrafterConfig(target_vocab_size=10, draft_vocab_size=11)


def test_verify_with_a_drafter_and_stop_strings(converted):
    tok = tiny_tokenizer()
    target = R2LMForDiffusionLM(type(converted[1].config).from_dict(
        {**converted[1].config.to_dict(), "vocab_size": len(tok) + 1, "mask_token_id": len(tok)})).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(30)
    drafter = untrained(target)
    prompt = tok("the quick brown", return_tensors="pt").input_ids
    ar = generate(target, prompt, max_new_tokens=16, block_size=1, eos_token_id=[])
    text = tok.decode(ar.sequences[0, prompt.shape[1]:])
    stop = text[4:7]
    out = generate(target, prompt, max_new_tokens=16, verify=True, drafter=drafter, eos_token_id=[], tokenizer=tok,
                   stop_strings=[stop])
    ids = out.sequences[0, prompt.shape[1]:][: out.new_tokens]
    got, said = tok.decode(ids), tok.decode(prompt[0])

    def stops(new: str) -> bool:  # a stop string ending in the new text (it may begin in the prompt, as transformers')
        return stop in (said + new)[len(said) - len(stop) + 1:]

    assert text.startswith(got) and stops(got) and not stops(tok.decode(ids[:-1]))  # at the first token that can


def test_a_drafter_bound_to_another_model_of_the_same_shapes_warns(converted):
    """Issue 40 item 3: a drafter records the target it was trained for (`target_digest`); bound to a model of the
    same shapes and other weights it warns, naming both (before: silent, 21 forwards for 24 tokens instead of 8).
    The same weights with sidecars added share the digest: verification runs without them."""
    import warnings

    from r2lm.drafter import target_digest

    hf, target = converted
    drafter = untrained(target, target_digest=target_digest(target))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(target, torch.tensor([[5, 6, 7]]), max_new_tokens=4, verify=True, drafter=drafter)
    other = R2LMForDiffusionLM(target.config).eval()  # the same shapes, other weights
    with pytest.warns(UserWarning, match=r"trained for another target \(digest [0-9a-f]+\), not for .*\(digest [0-9a-f]+\)"):
        out = generate(other, torch.tensor([[5, 6, 7]]), max_new_tokens=4, verify=True, drafter=drafter)
    assert torch.equal(out.sequences, generate(other, torch.tensor([[5, 6, 7]]), max_new_tokens=4, block_size=1).sequences)


@pytest.mark.parametrize("edit", ["feature_layers", "in_block", "rms_norm_eps"])
def test_an_edited_drafter_config_is_refused_by_its_manifest(converted, tmp_path, edit):
    """Issue 40 item 3: a drafter folder whose config.json was edited (layers reordered, in-block attention
    flipped, a norm eps changed) loaded silently; its checksums.sha256 covers config.json too."""
    import json

    from r2lm.checkpoints.manifest import seal

    hf, target = converted
    untrained(target).save_pretrained(tmp_path / "d")
    seal(tmp_path / "d")
    Drafter.from_pretrained(tmp_path / "d")  # unedited: loads
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config[edit] = {"feature_layers": config["feature_layers"][::-1], "in_block": "causal",
                    "rms_norm_eps": 1e-3}[edit]
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json is damaged: its sha256 differs"):
        Drafter.from_pretrained(tmp_path / "d")


def test_impossible_drafter_values_are_refused(converted, tmp_path):
    """Issue 40 item 4: each was accepted (a draft id outside the vocabulary failed later with a bare IndexError
    inside the forward)."""
    from safetensors.torch import load_file, save_file

    hf, target = converted
    cases = [(dict(rope_parameters={"rope_type": "default", "rope_theta": 0.0}), "rope_theta must be a positive"),
             (dict(initializer_range=-0.1), "initializer_range must be a non-negative"),
             (dict(max_position_embeddings=2), "max_position_embeddings 2 is below the block size 4")]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            DrafterConfig.for_target(target.config, block_size=4, **change)
    untrained(target, draft_vocab_size=8).save_pretrained(tmp_path / "d")
    weights = load_file(tmp_path / "d" / "model.safetensors")
    weights["draft_ids"][3] = target.config.vocab_size + 7
    save_file(weights, tmp_path / "d" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"draft vocabulary holds token id {target.config.vocab_size + 7}, outside"):
        Drafter.from_pretrained(tmp_path / "d")
