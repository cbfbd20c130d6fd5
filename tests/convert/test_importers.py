"""`python -m convert from-llada / from-dream / from-llada2`: imported models compute what the originals compute.

Each test builds a tiny synthetic checkpoint with the exact tensor names, shapes and config.json fields of the
source layout, imports it, and compares R2LM's logits with an independent plain-torch forward written from the
source layout's own tensors (no r2lm module is used in the oracle)."""

import json
import logging
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from r2lm import R2LMForDiffusionLM
from r2lm.convert.__main__ import build_parser, main
from r2lm.convert.importers import import_checkpoint, llada2_config, llada_config
from tests.helpers.checkpoints import SOURCE_VOCAB, dream_checkpoint, llada2_checkpoint, llada_checkpoint
from tests.helpers.models import tiny_tokenizer


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ------------------------------------------------------------------------------------- the independent oracle


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, theta, rotary_dim):
    """NeoX RoPE on the first `rotary_dim` dims of x [B, H, T, D]: pairs (j, j + rotary_dim/2) rotate by pos * f_j.
    The frequencies f_j are float32 as the sources compute them; the angles are in x's dtype."""
    T, half = x.shape[2], rotary_dim // 2
    freqs = 1.0 / theta ** (torch.arange(half, dtype=torch.float32) * 2 / rotary_dim)
    angle = torch.arange(T, dtype=x.dtype)[:, None] * freqs.to(x.dtype)[None]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def full_attention(q, k, v):
    """q [B, H, T, D], k/v [B, Hkv, T, D]; query head h reads key/value head h // (H / Hkv); no mask."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.softmax(-1) @ v


def heads(x, n, d):
    return x.unflatten(-1, (n, d)).transpose(1, 2)


def merge(x):
    return x.transpose(1, 2).flatten(2)


def llada_reference(sd, cfg, ids):
    n, nkv, d = cfg["n_heads"], cfg["n_kv_heads"], cfg["d_model"] // cfg["n_heads"]
    eps, theta, p = cfg["rms_norm_eps"], cfg["rope_theta"], "model.transformer."
    bias = cfg["include_qkv_bias"]
    x = sd[p + "wte.weight"][ids]
    for i in range(cfg["n_layers"]):
        b = f"{p}blocks.{i}."
        h = rms_norm(x, sd[b + "attn_norm.weight"], eps)
        q, k, v = (F.linear(h, sd[b + f"{t}_proj.weight"], sd[b + f"{t}_proj.bias"] if bias else None) for t in "qkv")
        q, k, v = heads(q, n, d), heads(k, nkv, d), heads(v, nkv, d)
        x = x + F.linear(merge(full_attention(rope(q, theta, d), rope(k, theta, d), v)), sd[b + "attn_out.weight"])
        h = rms_norm(x, sd[b + "ff_norm.weight"], eps)
        gated = F.silu(F.linear(h, sd[b + "ff_proj.weight"])) * F.linear(h, sd[b + "up_proj.weight"])
        x = x + F.linear(gated, sd[b + "ff_out.weight"])
    x = rms_norm(x, sd[p + "ln_f.weight"], eps)
    return F.linear(x, sd[p + "wte.weight"] if cfg["weight_tying"] else sd[p + "ff_out.weight"])


def dream_reference(sd, cfg, ids):
    n, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, eps, theta = cfg["hidden_size"] // n, cfg["rms_norm_eps"], cfg["rope_theta"]
    x = sd["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}."
        h = rms_norm(x, sd[b + "input_layernorm.weight"], eps)
        q, k, v = (F.linear(h, sd[b + f"self_attn.{t}_proj.weight"], sd[b + f"self_attn.{t}_proj.bias"]) for t in "qkv")
        q, k, v = heads(q, n, d), heads(k, nkv, d), heads(v, nkv, d)
        x = x + F.linear(merge(full_attention(rope(q, theta, d), rope(k, theta, d), v)), sd[b + "self_attn.o_proj.weight"])
        h = rms_norm(x, sd[b + "post_attention_layernorm.weight"], eps)
        gated = F.silu(F.linear(h, sd[b + "mlp.gate_proj.weight"])) * F.linear(h, sd[b + "mlp.up_proj.weight"])
        x = x + F.linear(gated, sd[b + "mlp.down_proj.weight"])
    x = rms_norm(x, sd["model.norm.weight"], eps)
    head = sd["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else sd["lm_head.weight"]
    return F.linear(x, head)  # unshifted: Dream's sampler shifts these by one position


def llada2_reference(sd, cfg, ids):
    """One block covering the whole input, i.e. full attention."""
    n, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta, rot = cfg["rms_norm_eps"], cfg["rope_theta"], int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    x = sd["model.word_embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}."
        h = rms_norm(x, sd[b + "input_layernorm.weight"], eps)
        qkv = F.linear(h, sd[b + "attention.query_key_value.weight"], sd.get(b + "attention.query_key_value.bias"))
        qkv = qkv.unflatten(-1, (n + 2 * nkv, d))
        q, k, v = qkv[:, :, :n], qkv[:, :, n : n + nkv], qkv[:, :, n + nkv :]
        q = rms_norm(q, sd[b + "attention.query_layernorm.weight"], eps).transpose(1, 2)
        k = rms_norm(k, sd[b + "attention.key_layernorm.weight"], eps).transpose(1, 2)
        out = full_attention(rope(q, theta, rot), rope(k, theta, rot), v.transpose(1, 2))
        x = x + F.linear(merge(out), sd[b + "attention.dense.weight"], sd.get(b + "attention.dense.bias"))
        h = rms_norm(x, sd[b + "post_attention_layernorm.weight"], eps)
        gated = F.silu(F.linear(h, sd[b + "mlp.gate_proj.weight"])) * F.linear(h, sd[b + "mlp.up_proj.weight"])
        x = x + F.linear(gated, sd[b + "mlp.down_proj.weight"])
    x = rms_norm(x, sd["model.norm.weight"], eps)
    return F.linear(x, sd["model.word_embeddings.weight"] if cfg["tie_word_embeddings"] else sd["lm_head.weight"])


def _logits(dst, ids):
    """The imported model's logits in float64, as the oracle computes them: float32 would compare two summation
    orders (which differ by kernel family, hence by CPU) at a tolerance that rounding alone can exceed."""
    model = R2LMForDiffusionLM.from_pretrained(dst).eval().double()
    with torch.no_grad():
        return model, model(ids).logits


def f64(sd):
    return {name: t.double() for name, t in sd.items()}


EXACT = dict(atol=1e-10, rtol=1e-10)  # float64 on both sides: any real difference is many orders larger


IDS = torch.randint(0, SOURCE_VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------- parity with the originals


@pytest.mark.parametrize("variant", [dict(), dict(n_kv_heads=2, weight_tying=True, qkv_bias=True, embedding_size=SOURCE_VOCAB)],
                         ids=["mha-untied-padded-vocab", "gqa-tied-qkv-bias"])
def test_llada_import_matches_the_llada_forward(tmp_path, variant):
    src, cfg, sd = llada_checkpoint(tmp_path / "llada", **variant)
    before = _snapshot(src)
    assert main(["from-llada", str(src), str(tmp_path / "out")]) == 0
    assert _snapshot(src) == before  # the source is never modified
    model, logits = _logits(tmp_path / "out", IDS)
    c = model.config
    assert (c.attention, c.prediction, c.mask_token_id) == ("bidirectional", "inplace", 97)
    assert c.vocab_size == cfg["embedding_size"] and logits.shape == (2, 11, cfg["embedding_size"])
    assert c.tie_word_embeddings == cfg["weight_tying"] and c.num_key_value_heads == cfg["n_kv_heads"]
    with torch.no_grad():
        expected = llada_reference(f64(sd), cfg, IDS)
        torch.testing.assert_close(logits, expected, **EXACT)
        # the oracle discriminates: reading up_proj as the gated projection gives other logits
        b = "model.transformer.blocks.0."
        swapped = dict(sd) | {b + "ff_proj.weight": sd[b + "up_proj.weight"], b + "up_proj.weight": sd[b + "ff_proj.weight"]}
        assert (llada_reference(f64(swapped), cfg, IDS) - logits).abs().max() > 1e-3


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_dream_import_matches_the_dream_forward(tmp_path, tie):
    src, cfg, sd = dream_checkpoint(tmp_path / "dream", tie=tie)
    assert main(["from-dream", str(src), str(tmp_path / "out"), "--block-size", "16"]) == 0
    model, logits = _logits(tmp_path / "out", IDS)
    c = model.config
    assert (c.attention, c.prediction, c.mask_token_id, c.block_size) == ("bidirectional", "shift", 97, 16)
    assert (c.attention_bias, c.o_proj_bias, c.qk_norm, c.tie_word_embeddings) == (True, False, False, tie)
    with torch.no_grad():
        torch.testing.assert_close(logits, dream_reference(f64(sd), cfg, IDS), **EXACT)


@pytest.mark.parametrize("variant", [dict(), dict(qkv_bias=True, dense_bias=True, num_experts=None, tie=True)],
                         ids=["dense-by-first_k", "no-experts-biases-tied"])
def test_llada2_import_matches_the_llada2_forward(tmp_path, variant):
    src, cfg, sd = llada2_checkpoint(tmp_path / "llada2", **variant)
    assert main(["from-llada2", str(src), str(tmp_path / "out"), "--mask-token-id", "98"]) == 0
    model, logits = _logits(tmp_path / "out", IDS)
    c = model.config
    assert (c.attention, c.prediction, c.mask_token_id, c.block_size) == ("block_causal", "inplace", 98, 32)
    assert c.qk_norm and c.head_dim == 16 and c.rope_parameters["partial_rotary_factor"] == 0.5
    assert (c.attention_bias, c.o_proj_bias) == (cfg["use_qkv_bias"], cfg["use_bias"])
    with torch.no_grad():
        torch.testing.assert_close(logits, llada2_reference(f64(sd), cfg, IDS), **EXACT)


def test_llada2_sidecars_start_closed(tmp_path):
    src, cfg, sd = llada2_checkpoint(tmp_path / "llada2")
    argv = ["from-llada2", str(src), str(tmp_path / "out"), "--mask-token-id", "98", "--sidecar-layers", "0,2",
            "--headdim", "16", "--d-state", "8", "--chunk-size", "8", "--block-size", "8"]
    assert main(argv) == 0
    model, logits = _logits(tmp_path / "out", IDS)
    assert model.config.sidecar_layers == [0, 2] and model.config.block_size == 8
    assert all(float(model.model.layers[i].sidecar.gate.detach()) == 0.0 for i in (0, 2))
    with torch.no_grad():
        torch.testing.assert_close(logits, llada2_reference(f64(sd), cfg, IDS), **EXACT)


def test_layout_defaults_for_mask_ids():
    src_llada = {"model_type": "llada", "d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 126464,
                 "embedding_size": 126464, "mlp_hidden_size": 128}
    assert llada_config(src_llada)["mask_token_id"] == 126336
    src_llada2 = {"model_type": "llada2_moe", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                  "vocab_size": 157184, "intermediate_size": 128, "num_experts": None}
    fields = llada2_config(src_llada2)
    assert fields["mask_token_id"] == 156895 and fields["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert fields["o_proj_bias"] is True  # LLaDA2MoeConfig's use_bias defaults to True


def test_dream_default_mask_id(tmp_path):
    cfg = dream_checkpoint(tmp_path / "dream")[1]
    del cfg["mask_token_id"]
    (tmp_path / "dream" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mask_token_id 151666 is outside the vocabulary"):
        import_checkpoint("dream", tmp_path / "dream", tmp_path / "out")
    import_checkpoint("dream", tmp_path / "dream", tmp_path / "out", mask_token_id=99)
    assert R2LMForDiffusionLM.from_pretrained(tmp_path / "out").config.mask_token_id == 99


# ------------------------------------------------------------------------------------- refusals


def test_llada2_moe_is_refused_with_no_dst(tmp_path, capsys):
    src = llada2_checkpoint(tmp_path / "llada2", moe=True)[0]
    with pytest.raises(ValueError, match=r"LLaDA 2 MoE layers 1\.\.2 \(num_experts=4\) are not supported"):
        import_checkpoint("llada2", src, tmp_path / "out")
    assert main(["from-llada2", str(src), str(tmp_path / "out")]) == 2
    assert "only dense checkpoints import" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "layout, make, tensor",
    [
        ("llada", llada_checkpoint, "model.transformer.blocks.1.q_proj.weight"),
        ("dream", dream_checkpoint, "model.layers.2.self_attn.k_proj.bias"),
        ("llada2", llada2_checkpoint, "model.layers.0.attention.query_key_value.weight"),
    ],
)
def test_wrong_shape_names_the_tensor_and_leaves_dst_untouched(tmp_path, layout, make, tensor):
    src = make(tmp_path / "src")[0]
    state = load_file(src / "model.safetensors")
    state[tensor] = torch.zeros(3, 5)
    save_file(state, src / "model.safetensors")
    earlier = make(tmp_path / "earlier")[0]
    import_checkpoint(layout, earlier, tmp_path / "out", mask_token_id=98)  # an output --overwrite may replace
    before = _snapshot(tmp_path / "out")
    with pytest.raises(ValueError, match=rf"{tensor} has shape \(3, 5\) but the config implies"):
        import_checkpoint(layout, src, tmp_path / "out", mask_token_id=98, overwrite=True)
    assert _snapshot(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier", "out", "src"]  # no temporaries left


def test_missing_and_extra_tensors_are_named(tmp_path):
    src = llada_checkpoint(tmp_path / "src")[0]
    state = load_file(src / "model.safetensors")
    state["model.transformer.blocks.0.extra.weight"] = torch.zeros(2)
    save_file(state, src / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensors the config does not describe: \['model.transformer.blocks.0.extra.weight'\]"):
        import_checkpoint("llada", src, tmp_path / "out")
    del state["model.transformer.blocks.0.extra.weight"], state["model.transformer.blocks.2.up_proj.weight"]
    save_file(state, src / "model.safetensors")
    with pytest.raises(ValueError, match="LLaDA checkpoint is missing tensor model.transformer.blocks.2.up_proj.weight"):
        import_checkpoint("llada", src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_dst_needs_overwrite(tmp_path, capsys):
    src = dream_checkpoint(tmp_path / "dream")[0]
    dst = tmp_path / "out"
    assert main(["from-dream", str(src), str(dst), "--block-size", "4"]) == 0
    assert main(["from-dream", str(src), str(dst)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert R2LMForDiffusionLM.from_pretrained(dst).config.block_size == 4
    assert main(["from-dream", str(src), str(dst), "--overwrite"]) == 0
    assert R2LMForDiffusionLM.from_pretrained(dst).config.block_size == 32


def test_unsupported_options_and_wrong_layouts_are_refused(tmp_path):
    src = llada_checkpoint(tmp_path / "llada", attention_layer_norm=True)[0]
    with pytest.raises(ValueError, match="attention_layer_norm"):
        import_checkpoint("llada", src, tmp_path / "out")
    with pytest.raises(ValueError, match="expected a Dream checkpoint"):
        import_checkpoint("dream", src, tmp_path / "out")
    src = llada_checkpoint(tmp_path / "llada2", block_type="sequential")[0]
    with pytest.raises(ValueError, match="block_type 'sequential'"):
        import_checkpoint("llada", src, tmp_path / "out")
    src = llada_checkpoint(tmp_path / "llada3")[0]
    with pytest.raises(ValueError, match="sidecar_layers need a causal or block_causal model"):
        import_checkpoint("llada", src, tmp_path / "out", sidecar_layers=[1])
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_is_carried_with_its_mask_token(tmp_path):
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|mask|>"]})  # in the vocabulary, not yet the mask token
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    src = dream_checkpoint(tmp_path / "dream", vocab=len(tok), mask_token_id=mask_id)[0]
    tok.save_pretrained(src)
    # the real CLI, with no terminal: config.json's auto_map must not make transformers ask to run remote code
    result = subprocess.run([sys.executable, "-m", "convert", "from-dream", str(src), str(tmp_path / "out")],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "custom code" not in result.stdout + result.stderr
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert out("the lazy fox").input_ids == tok("the lazy fox").input_ids
    assert out.mask_token == "<|mask|>" and out.mask_token_id == mask_id


def test_remote_code_tokenizer_is_copied_verbatim(tmp_path, caplog):
    src = llada_checkpoint(tmp_path / "llada")[0]
    tiny_tokenizer().save_pretrained(src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="LLaDATokenizer", auto_map={"AutoTokenizer": ["tokenization_llada.LLaDATokenizer", None]})
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (src / "tokenization_llada.py").write_text("raise ImportError('remote code must not run')\n")
    with caplog.at_level(logging.WARNING, logger="r2lm.convert.importers"):
        import_checkpoint("llada", src, tmp_path / "out")
    assert "needs remote code" in caplog.text and "copying its tokenizer files verbatim" in caplog.text
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenization_llada.py"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes()


def test_unloadable_tokenizer_is_copied_verbatim(tmp_path, caplog):
    src = llada2_checkpoint(tmp_path / "llada2")[0]
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (src / "tokenizer.json").write_text("{not a tokenizer")
    with caplog.at_level(logging.WARNING, logger="r2lm.convert.importers"):
        import_checkpoint("llada2", src, tmp_path / "out", mask_token_id=98)
    assert "cannot load the tokenizer" in caplog.text
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes()


# ------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("command", ["from-llada", "from-dream", "from-llada2"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--mask-token-id", "--block-size", "--dtype", "--overwrite"):
        assert option in text
    if command == "from-llada2":
        assert "--sidecar-layers" in text and "MoE layers" in text and "NOT supported" in text


def test_cli_lists_the_importers():
    result = subprocess.run([sys.executable, "-m", "convert", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for command in ("from-llada", "from-dream", "from-llada2"):
        assert command in result.stdout
