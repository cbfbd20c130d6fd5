"""Checkpoint folders the converters and loaders read: damaged weights, the source layouts of LLaDA, Dream and
LLaDA 2 (tiny synthetic checkpoints with the exact tensor names, shapes and config.json fields of each), a LoRA
adapter of an R2LM folder, and a small GGUF file."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from r2lm import R2LMForDiffusionLM

SOURCE_VOCAB = 100
HIDDEN, INTER, LAYERS, HEADS = 64, 128, 3, 4


def _w(*shape, scale=None):
    return torch.randn(*shape) * (scale if scale is not None else shape[-1] ** -0.5)


def _norm_w(n):
    return 1.0 + 0.2 * torch.randn(n)


def _write(folder, config: dict, state: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    return folder


def damage_weights(folder, damage: str = "truncated") -> str:
    """Damage `folder`'s model.safetensors as an interrupted copy ("truncated") or a lost file ("missing"); returns
    the start of the error every reader of it must give."""
    weights = folder / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:3000])
        return f"cannot read {weights}: "
    weights.unlink()
    return f"{folder} has no safetensors weights"


def llada_checkpoint(folder, n_kv_heads=HEADS, weight_tying=False, qkv_bias=False, embedding_size=128, **extra):
    cfg = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                     "AutoModel": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": HIDDEN,
        "embedding_dropout": 0.0, "embedding_size": embedding_size, "eos_token_id": 96, "flash_attention": False,
        "include_bias": False, "include_qkv_bias": qkv_bias, "init_cutoff_factor": None, "init_device": "meta",
        "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
        "layer_norm_with_affine": True, "mask_token_id": 97, "max_sequence_length": 256, "mlp_hidden_size": INTER,
        "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None, "n_heads": HEADS,
        "n_kv_heads": n_kv_heads, "n_layers": LAYERS, "pad_token_id": 96, "precision": "amp_bf16",
        "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True,
        "rope_theta": 500000.0, "scale_logits": False, "transformers_version": "4.46.3", "use_cache": False,
        "vocab_size": SOURCE_VOCAB, "weight_tying": weight_tying,
    }
    cfg.update(extra)
    d, kv = HIDDEN // HEADS, n_kv_heads * (HIDDEN // HEADS)
    p = "model.transformer."
    sd = {p + "wte.weight": _w(embedding_size, HIDDEN, scale=1.0), p + "ln_f.weight": _norm_w(HIDDEN)}
    for i in range(LAYERS):
        b = f"{p}blocks.{i}."
        sd |= {
            b + "attn_norm.weight": _norm_w(HIDDEN), b + "ff_norm.weight": _norm_w(HIDDEN),
            b + "q_proj.weight": _w(HIDDEN, HIDDEN), b + "k_proj.weight": _w(kv, HIDDEN), b + "v_proj.weight": _w(kv, HIDDEN),
            b + "attn_out.weight": _w(HIDDEN, HIDDEN), b + "ff_proj.weight": _w(INTER, HIDDEN),
            b + "up_proj.weight": _w(INTER, HIDDEN), b + "ff_out.weight": _w(HIDDEN, INTER),
        }
        if qkv_bias:
            sd |= {b + f"{t}_proj.bias": 0.1 * torch.randn(n) for t, n in (("q", HIDDEN), ("k", kv), ("v", kv))}
    if not weight_tying:
        sd[p + "ff_out.weight"] = _w(embedding_size, HIDDEN)
    assert d * HEADS == HIDDEN
    return _write(folder, cfg, sd), cfg, sd


def dream_checkpoint(folder, tie=False, vocab=SOURCE_VOCAB, **extra):
    cfg = {
        "architectures": ["DreamModel"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": 96, "eos_token_id": 96, "hidden_act": "silu", "hidden_size": HIDDEN,
        "initializer_range": 0.02, "intermediate_size": INTER, "mask_token_id": 97, "max_position_embeddings": 256,
        "max_window_layers": LAYERS, "model_type": "Dream", "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
        "num_key_value_heads": 2, "pad_token_id": 96, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": tie, "torch_dtype": "float32",
        "transformers_version": "4.46.2", "use_cache": True, "use_sliding_window": False, "vocab_size": vocab,
    }
    cfg.update(extra)
    kv = 2 * (HIDDEN // HEADS)
    sd = {"model.embed_tokens.weight": _w(vocab, HIDDEN, scale=1.0), "model.norm.weight": _norm_w(HIDDEN)}
    for i in range(LAYERS):
        b = f"model.layers.{i}."
        sd |= {
            b + "input_layernorm.weight": _norm_w(HIDDEN), b + "post_attention_layernorm.weight": _norm_w(HIDDEN),
            b + "self_attn.q_proj.weight": _w(HIDDEN, HIDDEN), b + "self_attn.q_proj.bias": 0.1 * torch.randn(HIDDEN),
            b + "self_attn.k_proj.weight": _w(kv, HIDDEN), b + "self_attn.k_proj.bias": 0.1 * torch.randn(kv),
            b + "self_attn.v_proj.weight": _w(kv, HIDDEN), b + "self_attn.v_proj.bias": 0.1 * torch.randn(kv),
            b + "self_attn.o_proj.weight": _w(HIDDEN, HIDDEN), b + "mlp.gate_proj.weight": _w(INTER, HIDDEN),
            b + "mlp.up_proj.weight": _w(INTER, HIDDEN), b + "mlp.down_proj.weight": _w(HIDDEN, INTER),
        }
    if not tie:
        sd["lm_head.weight"] = _w(vocab, HIDDEN)
    return _write(folder, cfg, sd), cfg, sd


def llada2_checkpoint(folder, moe=False, qkv_bias=False, dense_bias=False, tie=False, **extra):
    head_dim = 16
    cfg = {
        "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig", "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "embedding_dropout": 0.0, "eos_token_id": 96, "first_k_dense_replace": 1 if moe else LAYERS, "head_dim": head_dim,
        "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": INTER,
        "max_position_embeddings": 256, "model_type": "llada2_moe", "moe_intermediate_size": 32,
        "moe_router_enable_expert_bias": True, "n_group": 2, "norm_head": False, "num_attention_heads": HEADS,
        "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": LAYERS, "num_key_value_heads": 2,
        "num_shared_experts": 1, "output_dropout": 0.0, "pad_token_id": 96, "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 600000.0, "rotary_dim": head_dim // 2,
        "routed_scaling_factor": 2.5, "router_dtype": "fp32", "score_function": "sigmoid",
        "tie_word_embeddings": tie, "topk_group": 1, "torch_dtype": "float32", "transformers_version": "4.57.1",
        "use_bias": dense_bias, "use_cache": True, "use_qkv_bias": qkv_bias, "use_qk_norm": True, "vocab_size": SOURCE_VOCAB,
    }
    cfg.update(extra)
    fused = (HEADS + 2 * 2) * head_dim
    sd = {"model.word_embeddings.weight": _w(SOURCE_VOCAB, HIDDEN, scale=1.0), "model.norm.weight": _norm_w(HIDDEN)}
    for i in range(LAYERS):
        b = f"model.layers.{i}."
        sd |= {
            b + "input_layernorm.weight": _norm_w(HIDDEN), b + "post_attention_layernorm.weight": _norm_w(HIDDEN),
            b + "attention.query_key_value.weight": _w(fused, HIDDEN), b + "attention.dense.weight": _w(HIDDEN, HEADS * head_dim),
            b + "attention.query_layernorm.weight": _norm_w(head_dim), b + "attention.key_layernorm.weight": _norm_w(head_dim),
        }
        if qkv_bias:
            sd[b + "attention.query_key_value.bias"] = 0.1 * torch.randn(fused)
        if dense_bias:
            sd[b + "attention.dense.bias"] = 0.1 * torch.randn(HIDDEN)
        if i < cfg["first_k_dense_replace"]:
            sd |= {b + "mlp.gate_proj.weight": _w(INTER, HIDDEN), b + "mlp.up_proj.weight": _w(INTER, HIDDEN),
                   b + "mlp.down_proj.weight": _w(HIDDEN, INTER)}
        else:  # MoE layer, as LLaDA 2 stores it
            sd[b + "mlp.gate.weight"] = _w(4, HIDDEN)
            sd[b + "mlp.gate.expert_bias"] = torch.zeros(4)
            for e in range(4):
                sd |= {b + f"mlp.experts.{e}.{t}_proj.weight": _w(32, HIDDEN) for t in ("gate", "up")}
                sd[b + f"mlp.experts.{e}.down_proj.weight"] = _w(HIDDEN, 32)
            sd |= {b + f"mlp.shared_experts.{t}_proj.weight": _w(32, HIDDEN) for t in ("gate", "up")}
            sd[b + "mlp.shared_experts.down_proj.weight"] = _w(HIDDEN, 32)
    if not tie:
        sd["lm_head.weight"] = _w(SOURCE_VOCAB, HIDDEN)
    return _write(folder, cfg, sd), cfg, sd


def make_adapter(base_dir, out, r=4, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=0):
    """A LoRA adapter of `base_dir` with random (non-zero) A and B, saved with peft's save_pretrained."""
    from peft import LoraConfig, get_peft_model  # the train extra: only the tests that make an adapter need it

    torch.manual_seed(seed)
    model = get_peft_model(R2LMForDiffusionLM.from_pretrained(base_dir), LoraConfig(r=r, lora_alpha=8, target_modules=list(targets)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.05)
    model.save_pretrained(str(out))
    return out


def gguf_file(path, seed=0, vocab=96, hidden=64, ffn=128, heads=4, kv_heads=2, blocks=2):
    """A small Llama GGUF file (llama.cpp's format) that transformers loads whole: metadata, a byte-level vocabulary
    and float32 weights drawn from `seed`."""
    gguf = pytest.importorskip("gguf")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(blocks)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(33 + i) for i in range(vocab - 2)] + ['!"', "<|end|>"])
    writer.add_token_types([1] * vocab)
    writer.add_token_merges(['! "'])
    writer.add_bos_token_id(vocab - 1)
    writer.add_eos_token_id(vocab - 1)
    rng = np.random.default_rng(seed)
    kv = hidden // heads * kv_heads
    shapes = {"token_embd": (vocab, hidden), "output": (vocab, hidden), "output_norm": (hidden,)}
    for i in range(blocks):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in [
            ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
            ("ffn_down", (hidden, ffn)), ("attn_norm", (hidden,)), ("ffn_norm", (hidden,))]}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
