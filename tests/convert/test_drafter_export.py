"""r2lm-convert drafter: a trained drafter as it ships (its dtype, its target's digest, checksums over its files)."""

import json
import warnings

import pytest
import torch

from r2lm import R2LMForDiffusionLM, generate
from r2lm.convert.__main__ import main
from r2lm.drafter import Drafter, DrafterConfig, target_digest
from tests.helpers.models import make_model_dir


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("ship")
    model = make_model_dir(root / "target", sidecar_layers=[])
    target = R2LMForDiffusionLM.from_pretrained(model).eval()
    torch.manual_seed(0)
    Drafter(DrafterConfig.for_target(target.config, block_size=4, draft_vocab_size=32)).save_pretrained(root / "trained")
    return root, model, target


def test_the_shipped_form_records_its_target_and_loads_checked(made, capsys):
    root, model, target = made
    assert main(["drafter", str(root / "trained"), str(root / "shipped"), "--target", str(model)]) == 0
    files = sorted(p.name for p in (root / "shipped").iterdir())
    assert files == ["checksums.sha256", "config.json", "model.safetensors"]
    config = json.loads((root / "shipped" / "config.json").read_text())
    assert config["target_digest"] == target_digest(target) and config["dtype"] == "bfloat16"
    drafter = Drafter.from_pretrained(root / "shipped")
    assert drafter.fuse.weight.dtype == torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its own target: no warning
        out = generate(target, torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, verify=True,
                       drafter=drafter.float().eval(), eos_token_id=[])
    assert torch.equal(out.sequences, generate(target, torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, block_size=1,
                                               eos_token_id=[]).sequences)


def test_a_drafter_for_another_shape_is_refused(made, tmp_path, capsys):
    root, model, target = made
    other = DrafterConfig.for_target(target.config, block_size=4, target_num_hidden_layers=target.config.num_hidden_layers + 1)
    Drafter(other).save_pretrained(tmp_path / "other")
    assert main(["drafter", str(tmp_path / "other"), str(tmp_path / "out"), "--target", str(model)]) == 2
    assert "made for another target: layer count" in capsys.readouterr().err and not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()
    assert main(["drafter", str(tmp_path / "empty"), str(tmp_path / "out2"), "--target", str(model)]) == 2
    assert "neither a drafter folder" in capsys.readouterr().err
