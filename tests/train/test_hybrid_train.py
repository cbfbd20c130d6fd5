"""Block-hybrid conversion through the training program, in process (one rank, real DeepSpeed ZeRO-2 engine):
stage 1 (objective attention_transfer) and stage 2 (lora.enabled), and their input checks.

The two-rank launch of stage 1 is in test_hybrid_train_launch.py (slow); merge-lora's own checks in
tests/convert/test_merge_lora.py."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from r2lm import R2LMForDiffusionLM
from r2lm.checkpoints import MANIFEST, complete_checkpoints
from r2lm.convert.__main__ import main as convert_main
from r2lm.diffusion import block_noise, noise_seed, noised_dual_stream
from tests.helpers.models import make_model_dir
from tests.helpers.training import base_overrides, corpus_paragraphs, run_inprocess, write_corpus
from train.tracking import read_metrics

HYBRID = dict(attention="block_causal", prediction="inplace", hybrid_layers=[0, 2], hybrid_feature_dim=8)  # + sidecars 1, 3


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    model = make_model_dir(root / "hybrid", **HYBRID)
    train, heldout = write_corpus(root / "corpus")
    return root, model, train, heldout


def overrides(inputs, model, out, *extra):
    root, _, train, heldout = inputs
    return base_overrides(model, out, train, heldout, root / "cache") + list(extra)


def weights(folder):
    return R2LMForDiffusionLM.from_pretrained(folder).state_dict()


STAGE1 = ["objective=attention_transfer", "lr=1.0e-2", "steps=80", "grad_accum=1", "eval_every=0", "save_every=0",
          "freeze_backbone=true"]  # ignored by stage 1: the sidecars must stay as they are


@pytest.fixture(scope="module")
def stage1(inputs):
    out = inputs[0] / "stage1"
    return run_inprocess(overrides(inputs, inputs[1], out, *STAGE1)), out


def heldout_mse(model_dir, x0, config) -> torch.Tensor:
    """Per-layer attention-transfer MSE of a saved model on a noised dual-stream batch (fixed noise)."""
    model = R2LMForDiffusionLM.from_pretrained(model_dir).eval()
    _, [(masked, _)] = block_noise(x0, config, generator=torch.Generator().manual_seed(noise_seed(7)))
    inputs, layout, _ = noised_dual_stream(x0, masked, config)
    with torch.no_grad():
        return model.attention_transfer(inputs, layout)


def test_attention_transfer_lowers_every_layers_heldout_mse(stage1, inputs):
    result, out = stage1
    summary = json.loads((out / "attention_transfer.json").read_text())
    assert summary["hybrid_layers"] == [0, 2] and summary["steps"] == 80
    for layer in ("0", "2"):
        entry = summary["layers"][layer]
        assert entry["after"] < 0.7 * entry["before"], summary  # a real decrease, not noise
        assert entry["reduction"] == pytest.approx(entry["before"] / entry["after"])
    evals = read_metrics(out, "eval")
    assert [r["step"] for r in evals] == [0, 80]  # before and after, although eval_every=0
    assert evals[0]["eval_mse_layer_2"] == summary["layers"]["2"]["before"]
    assert evals[0]["eval_loss"] == pytest.approx(evals[0]["eval_mse_layer_0"] + evals[0]["eval_mse_layer_2"])  # the sum
    train = read_metrics(out)
    assert len(train) == 80 and all(math.isfinite(r["mse_layer_0"]) and math.isfinite(r["mse_layer_2"]) for r in train)
    # independently of the run's own evaluation: the exported model against the starting one, on held-out text
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(inputs[1])(" ".join(corpus_paragraphs(40, seed=5)))["input_ids"]
    tok_ids = torch.tensor(ids[:256]).view(4, 64)  # text of the corpus' kind that the run never saw
    config = R2LMForDiffusionLM.config_class.from_pretrained(inputs[1])
    before, after = heldout_mse(inputs[1], tok_ids, config), heldout_mse(out / "final", tok_ids, config)
    assert torch.all(after < 0.8 * before), (before, after)


def test_attention_transfer_trains_only_feature_maps_and_gates(stage1, inputs):
    result, out = stage1
    before, after = weights(inputs[1]), weights(out / "final")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    transfer = {k for k in before if ".linear_attention." in k}
    assert transfer == {f"model.layers.{i}.self_attn.linear_attention.{p}" for i in (0, 2) for p in ("hedgehog_weights", "alpha")}
    assert changed == transfer  # every feature map and gate moved, nothing else (sidecars included)
    log = (out / "train.log").read_text()
    trainable = sum(v.numel() for k, v in before.items() if k in transfer)
    assert f"{trainable} trainable" in log and "freeze_backbone is implied" in log


@pytest.mark.parametrize(
    "model_kind,extra,message",
    [
        ("plain", ["objective=attention_transfer"], r"objective 'attention_transfer' needs a model with block-hybrid layers.*"
                                                    r"python -m convert to-hybrid"),
        ("hybrid", ["objective=attention_transfer", "data.heldout=null"], "give data.heldout or data.heldout_fraction"),
        ("hybrid", ["objective=attention_transfer", "lora.enabled=true"], "lora.enabled does not combine with objective "
                                                                          "attention_transfer"),
        ("hybrid", ["lora.enabled=true", "lora.target_modules=[qkv_proj]"], r"lora.target_modules \['qkv_proj'\] name no "
                                                                            r"linear layer of the model \(it has: .*q_proj"),
        ("hybrid", ["lora.enabled=true", "freeze_backbone=true"], "lora.enabled and freeze_backbone exclude each other"),
        ("hybrid", ["lora.enabled=true", "lora.r=0"], "lora.r and lora.alpha must be positive"),
        ("tied", ["lora.enabled=true", "lora.target_modules=[q_proj,lm_head]"],
         r"lora.target_modules puts a LoRA on lm_head of a model with tied embeddings"),
    ],
)
def test_stage_inputs_are_checked_before_any_work(inputs, tmp_path, model_kind, extra, message):
    model = {"plain": lambda: make_model_dir(tmp_path / "plain", sidecar_layers=[]),
             "tied": lambda: make_model_dir(tmp_path / "tied", tie_word_embeddings=True),
             "hybrid": lambda: inputs[1]}[model_kind]()
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        run_inprocess(overrides(inputs, model, out, *extra))
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- stage 2: LoRA

STAGE2 = ["lora.enabled=true", "lora.r=4", "lora.alpha=8", "lora.dropout=0.1", "steps=6", "save_every=3", "eval_every=3"]


@pytest.fixture(scope="module")
def stage2(stage1, inputs):
    base = stage1[1] / "final"
    out = inputs[0] / "stage2"
    return run_inprocess(overrides(inputs, base, out, *STAGE2)), out, base


def test_lora_trains_only_the_adapters(stage2):
    result, out, base = stage2
    engine_state = {k: v.detach().clone() for k, v in result.engine.module.state_dict().items()}
    original = weights(base)
    lora = {k: v for k, v in engine_state.items() if ".lora_" in k}
    assert lora and all(any(t in k for t in ("q_proj", "k_proj", "v_proj", "o_proj")) for k in lora)
    assert {k.split(".self_attn.")[0] for k in lora} == {f"base_model.model.model.layers.{i}" for i in range(4)}  # every layer
    assert all(torch.count_nonzero(v) for k, v in lora.items() if ".lora_B." in k)  # B starts at 0: it trained
    for key, value in engine_state.items():  # everything else, feature maps and gates included, is as it started
        if ".lora_" not in key:
            name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(value, original[name]), key
    # the export is the adapter alone (and the writer's manifest), exactly the engine's adapter weights
    assert sorted(p.name for p in (out / "final").iterdir() if p.name != "README.md") == [
        "adapter_config.json", "adapter_model.safetensors", MANIFEST]
    saved = load_file(out / "final" / "adapter_model.safetensors")
    assert saved.keys() == {k.replace(".default.", ".") for k in lora}
    for key, value in lora.items():
        assert torch.equal(saved[key.replace(".default.", ".")], value), key
    evals = read_metrics(out, "eval")
    assert [r["step"] for r in evals] == [0, 3, 6] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]


def test_merged_checkpoint_equals_the_peft_model(stage2, tmp_path):
    from peft import PeftModel

    _, out, base = stage2
    assert convert_main(["merge-lora", str(base), str(out / "final"), str(tmp_path / "merged")]) == 0
    merged = R2LMForDiffusionLM.from_pretrained(tmp_path / "merged").eval()
    peft_model = PeftModel.from_pretrained(R2LMForDiffusionLM.from_pretrained(base), str(out / "final")).eval()
    plain = R2LMForDiffusionLM.from_pretrained(base).eval()
    config = merged.config
    assert config.hybrid_layers == [0, 2] and config.sidecar_layers == [1, 3]
    x0 = torch.randint(0, config.mask_token_id, (2, 64), generator=torch.Generator().manual_seed(3))
    _, [(masked, _)] = block_noise(x0, config, generator=torch.Generator().manual_seed(4))
    ids, layout, _ = noised_dual_stream(x0, masked, config)
    with torch.no_grad():
        want, got, unmerged = (m(ids, layout=layout).logits for m in (peft_model, merged, plain))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - unmerged).abs().max() > 1e-3  # the adapter does something
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


def test_a_bf16_lora_run_exports_its_adapter(stage2, inputs, tmp_path):
    """Under bf16 (precision=auto on a GPU) the frozen base lives only in the bf16 module: the export's check
    compares it with the base as the run held it, and the adapter is written."""
    _, _, base = stage2
    result = run_inprocess(overrides(inputs, base, tmp_path / "bf16", *STAGE2, "steps=2", "save_every=2",
                                     "eval_every=0", "precision=bf16"))
    saved = load_file(result.export_dir / "adapter_model.safetensors")
    assert saved and all(".lora_" in k for k in saved)


def test_lora_resume_is_exact_with_dropout(stage2, inputs):
    _, full, base = stage2
    out = inputs[0] / "stage2-resumed"
    first = run_inprocess(overrides(inputs, base, out, *STAGE2, "stop_at=3"))
    assert first.step == 3 and [s for s, _ in complete_checkpoints(out / "checkpoints")] == [3]
    assert (out / "checkpoints" / "step-00000003" / "adapter_config.json").is_file()
    run_inprocess(overrides(inputs, base, out, *STAGE2))
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time_s")} for r in rows]  # noqa: E731
    assert strip(read_metrics(out, None)) == strip(read_metrics(full, None))
    a, b = load_file(out / "final" / "adapter_model.safetensors"), load_file(full / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
