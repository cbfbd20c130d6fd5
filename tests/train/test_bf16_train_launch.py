"""bf16 training on CPU through the real launcher (issue 33): `deepspeed --num_gpus 2`, ZeRO-2, precision=bf16 (what
precision=auto picks on a GPU), the block objective on a model with sidecars and on one with block-hybrid layers
too; then the export in bf16, its reload, and decoding from it. Dtype mistakes of the GPU configuration (bf16
module, fp32 master weights, bf16 export) show up here without a GPU."""

import math

import pytest
import torch

from r2lm import R2LMForDiffusionLM, generate
from tests.helpers.bf16 import assert_bf16_cache_equals_recompute
from tests.helpers.models import make_model_dir
from tests.helpers.processes import DEEPSPEED, free_port, run_cli
from tests.helpers.training import base_overrides, write_corpus
from train.tracking import read_metrics

pytestmark = pytest.mark.slow

MODELS = {
    "sidecars": dict(),  # make_model_dir's: causal attention, shift prediction, sidecars on layers 1 and 3
    "hybrid": dict(attention="block_causal", prediction="inplace", hybrid_layers=[0, 2], hybrid_feature_dim=8),
}


@pytest.mark.parametrize("name", MODELS)
def test_two_ranks_bf16_block_training_exports_and_decodes(tmp_path, name):
    start = make_model_dir(tmp_path / "model", **MODELS[name])
    train, heldout = write_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    items = base_overrides(start, out, train, heldout, tmp_path / "cache") + [
        "objective=block", "precision=bf16", "export_dtype=bfloat16", "steps=4", "save_every=4", "eval_every=2"]
    done = run_cli([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "train/pretrain.py", *items],
                   timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    losses = [r["loss"] for r in read_metrics(out)]
    evals = [r["eval_loss"] for r in read_metrics(out, "eval")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses + evals), (losses, evals)
    # the engine ran in bf16: its module (what each rank saves next to the fp32 optimizer state) is bf16
    states = torch.load(out / "checkpoints" / "step-00000004" / "mp_rank_00_model_states.pt", weights_only=False)
    floats = {v.dtype for v in states["module"].values() if v.is_floating_point()}
    assert floats == {torch.bfloat16}, floats

    model = R2LMForDiffusionLM.from_pretrained(out / "final").eval()
    assert model.dtype == torch.bfloat16 and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    before = R2LMForDiffusionLM.from_pretrained(start).state_dict()
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k].to(torch.bfloat16), after[k])}
    assert any(".sidecar." in k for k in changed) and any(".mlp." in k for k in changed)
    if name == "hybrid":
        assert any(".linear_attention." in k for k in changed)

    assert_bf16_cache_equals_recompute(model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    tokenizer.padding_side = "left"
    batch = tokenizer(["the quick brown fox", "a diffusion model"], return_tensors="pt", padding=True)
    sequences = generate(model, batch.input_ids, batch.attention_mask, max_new_tokens=16).sequences
    new = sequences[:, batch.input_ids.shape[1]:]
    assert new.shape == (2, 16) and not (new == model.config.mask_token_id).any()
