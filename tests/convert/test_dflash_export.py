"""r2lm-convert drafter-to-dflash: a drafter of layout "dflash" written as vLLM's DFlash drafter computes exactly what
r2lm drafts. The oracle reads the exported folder alone and computes a block as vLLM 0.32's qwen3_dflash.py does
(written from that description, sharing no code with r2lm): the raw target layers concatenated, `fc`, `hidden_norm`,
each layer's k/v projections with k_norm and RoPE for the context; [bonus, mask x (b-1)] through the target's
embeddings and `mask_embedding.pt`; Qwen3 layers attending non-causally over context + block; `norm`, `lm_head`, d2t."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from r2lm import R2LMForDiffusionLM, generate
from r2lm.convert.__main__ import main
from r2lm.drafter import Drafter, DrafterConfig
from tests.helpers.models import make_model_dir


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta):
    """NeoX rotate-half RoPE over the last dim of x [..., T, d] at `positions` [T]."""
    d = x.shape[-1]
    freqs = positions[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
    cos, sin = torch.cat([freqs, freqs], -1).cos().float(), torch.cat([freqs, freqs], -1).sin().float()
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


def vllm_dflash_block(folder, embed, captured, bonus):
    """Target token ids and logits [b - 1, draft vocab] of one DFlash block after a context of T tokens: `captured` maps a
    target layer id to its output [T, hidden]; `bonus` the last committed token."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}
    mask = torch.load(folder / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == cfg["dflash_config"]["mask_token_id"]
    eps, heads, kv_heads, d = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta, b = cfg["rope_parameters"]["rope_theta"], cfg["block_size"]
    context = torch.cat([captured[i] for i in cfg["dflash_config"]["target_layer_ids"]], -1)
    x = rms(context @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    T = x.shape[0]
    ctx_pos, blk_pos = torch.arange(T), torch.arange(T, T + b)
    h = torch.cat([embed[bonus][None], mask["embedding"].float()[None].expand(b - 1, -1)])

    def split(t, n):
        return t.view(t.shape[0], n, d).transpose(0, 1)  # [n, T, d]

    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        k_ctx = rope(rms(split(x @ w[p + "self_attn.k_proj.weight"].T, kv_heads), w[p + "self_attn.k_norm.weight"], eps),
                     ctx_pos, theta)
        v_ctx = split(x @ w[p + "self_attn.v_proj.weight"].T, kv_heads)
        a = rms(h, w[p + "input_layernorm.weight"], eps)
        q = rope(rms(split(a @ w[p + "self_attn.q_proj.weight"].T, heads), w[p + "self_attn.q_norm.weight"], eps),
                 blk_pos, theta)
        k = rope(rms(split(a @ w[p + "self_attn.k_proj.weight"].T, kv_heads), w[p + "self_attn.k_norm.weight"], eps),
                 blk_pos, theta)
        v = split(a @ w[p + "self_attn.v_proj.weight"].T, kv_heads)
        keys = torch.cat([k_ctx, k], 1).repeat_interleave(heads // kv_heads, 0)
        values = torch.cat([v_ctx, v], 1).repeat_interleave(heads // kv_heads, 0)
        attn = ((q @ keys.transpose(1, 2)) / math.sqrt(d)).softmax(-1) @ values  # non-causal: every key
        h = h + attn.transpose(0, 1).reshape(b, heads * d) @ w[p + "self_attn.o_proj.weight"].T
        m = rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    logits = (rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T)[1:]  # vLLM samples the [MASK] columns alone
    draft_to_target = torch.arange(logits.shape[-1]) + w["d2t"].long()
    return draft_to_target[logits.argmax(-1)], logits


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    model = make_model_dir(root / "target", sidecar_layers=[])
    target = R2LMForDiffusionLM.from_pretrained(model).eval()
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.for_target(target.config, block_size=4, draft_vocab_size=48, layout="dflash",
                                               num_hidden_layers=2))
    with torch.no_grad():  # every weight away from its initial value, norms included: a skipped one shows
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        drafter.draft_ids.copy_(torch.randperm(target.config.vocab_size)[:48].sort().values)
    drafter.save_pretrained(root / "trained")
    return root, model, target


def test_vllm_dflash_computes_what_r2lm_drafts(made):
    root, model, target = made
    assert main(["drafter-to-dflash", str(root / "trained"), str(root / "dflash"), "--target", str(model)]) == 0
    assert sorted(p.name for p in (root / "dflash").iterdir()) == ["checksums.sha256", "config.json",
                                                                    "mask_embedding.pt", "model.safetensors"]
    config = json.loads((root / "dflash" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["causal"] is False
    drafter = Drafter.from_pretrained(root / "trained").bind(target).eval()
    layers = tuple(drafter.config.feature_layers)
    ids = torch.randint(0, target.config.vocab_size - 1, (1, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        captured = target.model(ids, capture=layers).captured
        for T in (1, 5, 12):  # contexts of several lengths, each appended at once and one column at a time
            context = drafter.new_context(1, 32)
            drafter.append(context, [c[:, :T] for c in captured])
            guess, p = drafter.draft(context, ids[:, T], confidence=True)
            expected, logits = vllm_dflash_block(root / "dflash", target.model.embed_tokens.weight.float(),
                                                 dict(zip(layers, (c[0, :T] for c in captured), strict=True)), ids[0, T])
            assert torch.equal(guess[0], expected)
            torch.testing.assert_close(p[0], logits.softmax(-1).amax(-1), rtol=1e-4, atol=1e-5)
            stepwise = drafter.new_context(1, 32)
            for t in range(T):
                drafter.append(stepwise, [c[:, t : t + 1] for c in captured])
            assert torch.equal(drafter.draft(stepwise, ids[:, T]), guess)


def test_only_a_dflash_drafter_for_this_target_is_exported(made, tmp_path, capsys):
    root, model, target = made
    torch.manual_seed(0)
    Drafter(DrafterConfig.for_target(target.config, block_size=4)).save_pretrained(tmp_path / "r2lm_layout")
    assert main(["drafter-to-dflash", str(tmp_path / "r2lm_layout"), str(tmp_path / "out"), "--target", str(model)]) == 2
    assert "has layout 'r2lm': vLLM's DFlash computes otherwise" in capsys.readouterr().err
    other = Drafter.from_pretrained(root / "trained")
    other.config.target_digest = "0123456789abcdef"
    other.save_pretrained(tmp_path / "other_target")
    assert main(["drafter-to-dflash", str(tmp_path / "other_target"), str(tmp_path / "out"), "--target", str(model)]) == 2
    assert "was made for another target (digest 0123456789abcdef)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("choices", [dict(qk_norm=False), dict(sidecar=True)])
def test_a_dflash_drafter_has_qwen3_layers(made, choices):
    _, _, target = made
    with pytest.raises(ValueError, match="layout 'dflash' is vLLM's DFlash drafter, whose layers are Qwen3's"):
        DrafterConfig.for_target(target.config, layout="dflash", **choices)


def test_a_dflash_drafter_trains(made):
    """On the target's own greedy text its loss (the same recipe as r2lm's layout) falls and its τ rises from ~1 to
    what r2lm's layout reaches there (about 3 of a block of 4): every weight vLLM reads gets a gradient."""
    _, _, target = made
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.for_target(target.config, block_size=4, layout="dflash")).bind(target).train()
    drafter.start_from(target)
    prompts = torch.randint(0, target.config.vocab_size - 1, (4, 4), generator=torch.Generator().manual_seed(4))
    ids = generate(target, prompts, max_new_tokens=20, block_size=1, eos_token_id=[]).sequences  # its greedy text
    with torch.no_grad():
        captured = target.model(ids, capture=tuple(drafter.config.feature_layers)).captured
    valid, reply = torch.ones_like(ids), torch.arange(ids.shape[1]).expand_as(ids) >= 4
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses, taus = [], []
    for step in range(60):
        out = drafter.loss(captured, ids, valid, reply, blocks=4, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        out.loss.backward()
        if not losses:
            assert all(p.grad is not None for p in drafter.parameters() if p.requires_grad), "a weight unused"
        opt.step()
        losses.append(float(out.loss.detach()))
        taus.append(float(out.tau))
    assert losses[-1] < losses[0] and taus[0] < 1.5 and min(taus[-5:]) >= 2.0, (losses[::10], taus[::10])


def test_verify_with_a_dflash_drafter_is_ar(made):
    """It drafts block_size - 1 tokens (its [MASK] columns) into a verification of block_size columns (as vLLM: the
    last one's token is the target's own), and verification keeps the target's greedy text."""
    root, _, target = made
    drafter = Drafter.from_pretrained(root / "trained").eval()
    assert drafter.config.draft_length == drafter.config.block_size - 1
    ids = torch.randint(0, target.config.vocab_size - 1, (2, 7), generator=torch.Generator().manual_seed(5))
    for policy in ("adaptive", "longest"):
        out = generate(target, ids, max_new_tokens=11, verify=True, drafter=drafter, verify_policy=policy,
                       eos_token_id=[])
        assert torch.equal(out.sequences, generate(target, ids, max_new_tokens=11, block_size=1,
                                                   eos_token_id=[]).sequences)
