"""Stage 1 of hybrid conversion (objective attention_transfer) through the real launcher: `deepspeed --num_gpus 2`,
ZeRO-2, two CPU ranks over gloo. What one rank cannot show: the per-layer held-out MSE is reduced across ranks
correctly (recomputed here from the export over both ranks' evaluation batches), and the frozen weights stay
frozen when gradients are averaged across ranks."""

import json
from pathlib import Path

import pytest
import torch

from r2lm import R2LMForDiffusionLM
from r2lm.diffusion import noise_seed
from tests.helpers.models import make_model_dir
from tests.helpers.processes import DEEPSPEED, free_port, run_cli
from tests.helpers.training import base_overrides, write_corpus
from train.config import load_config
from train.data import build_data
from train.transfer import transfer_loss

pytestmark = pytest.mark.slow


def per_layer_heldout_mse(model_dir: Path, items: list[str], world: int) -> torch.Tensor:
    """The run's held-out per-layer evaluation (train.trainer.evaluate), recomputed in this process."""
    from transformers import AutoTokenizer

    cfg = load_config(None, items)
    model = R2LMForDiffusionLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    total, weights = 0.0, 0.0
    for rank in range(world):
        data = build_data(cfg, tok, tok.eos_token_id, rank, world, first_on_node=True, barrier=lambda: None)
        for k, idx, weight in data.heldout.plan(rank):
            generator = torch.Generator().manual_seed(noise_seed(cfg.eval_seed, k, rank))
            with torch.no_grad():
                out = transfer_loss(model, data.heldout.batch(idx), separator_id=data.eos_id, generator=generator, eps=cfg.eps)
            total = total + out.per_layer.double() * weight
            weights += weight
    return total / weights


def test_two_ranks_attention_transfer(tmp_path):
    model = make_model_dir(tmp_path / "hybrid", attention="block_causal", prediction="inplace", hybrid_layers=[0, 2],
                           hybrid_feature_dim=8)
    train, heldout = write_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    items = base_overrides(model, out, train, heldout, tmp_path / "cache") + [
        "objective=attention_transfer", "lr=1.0e-2", "steps=40", "grad_accum=1", "eval_every=20", "save_every=20"]
    done = run_cli([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "train/pretrain.py", *items], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    summary = json.loads((out / "attention_transfer.json").read_text())
    after = torch.tensor([summary["layers"][str(i)]["after"] for i in (0, 2)], dtype=torch.float64)
    before = torch.tensor([summary["layers"][str(i)]["before"] for i in (0, 2)], dtype=torch.float64)
    assert torch.all(after < 0.7 * before), summary
    torch.testing.assert_close(per_layer_heldout_mse(out / "final", items, world=2), after, rtol=1e-5, atol=0)
    torch.testing.assert_close(per_layer_heldout_mse(model, items, world=2), before, rtol=1e-5, atol=0)

    start = R2LMForDiffusionLM.from_pretrained(model).state_dict()
    end = R2LMForDiffusionLM.from_pretrained(out / "final").state_dict()
    changed = {k for k in start if not torch.equal(start[k], end[k])}
    assert changed == {k for k in start if ".linear_attention." in k}
