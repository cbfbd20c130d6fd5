"""objective=certainty through the training program, on teacher continuations written by train/teacher_data.py:
full training, freeze_backbone (sidecars only) and LoRA in process (one rank, real DeepSpeed ZeRO-2 engine), and a
two-rank `deepspeed --num_gpus 2` launch (slow)."""

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from r2lm import R2LMForDiffusionLM
from tests.helpers.models import make_model_dir
from tests.helpers.processes import DEEPSPEED, free_port, python, run_cli
from tests.helpers.training import base_overrides, run_inprocess, write_corpus
from train.checkpointing import read_state
from train.teacher_data import build_parser, generate_records
from train.tracking import read_metrics

PARTS = ("ce", "entropy", "right_fraction")


def teacher_args(model, prompts, out):
    return ["--teacher", str(model), "--prompts", str(prompts), "--out", str(out), "--student", str(model),
            "--prompt-tokens", "12", "--max-new-tokens", "32", "--max-prompts", "48", "--batch-size", "8"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny model, and its own continuations of training paragraphs (self-distillation, as dParallel)."""
    root = tmp_path_factory.mktemp("certainty")
    model = make_model_dir(root / "model")
    train, heldout = write_corpus(root / "corpus", n_train=60, n_heldout=20)
    data = root / "teacher.jsonl"
    assert generate_records(build_parser().parse_args(teacher_args(model, train, data))) == 48
    return root, model, data, heldout


def overrides(inputs, out, *extra):
    root, model, data, heldout = inputs
    return base_overrides(model, out, data, heldout, root / "cache") + ["objective=certainty", "steps=3",
                                                                         "eval_every=0", "save_every=0", *extra]


def weights(folder):
    return R2LMForDiffusionLM.from_pretrained(folder).state_dict()


def check_metrics(out: Path, steps: int, weight: float = 2.0):
    train = read_metrics(out)
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        assert all(math.isfinite(r[key]) for key in ("loss", *PARTS)) and 0 <= r["right_fraction"] <= 1
        assert r["loss"] == pytest.approx(r["ce"] + weight * r["entropy"], rel=1e-5)  # the logged parts add up
    evals = read_metrics(out, "eval")
    assert evals and all(all(math.isfinite(r[f"eval_{key}"]) for key in PARTS) for r in evals)
    return train


def test_full_training(inputs, tmp_path):
    out = tmp_path / "full"
    result = run_inprocess(overrides(inputs, out, "certainty.entropy_weight=1.5", "certainty.temperature=0.7"))
    check_metrics(out, 3, weight=1.5)
    before, after = weights(inputs[1]), weights(result.export_dir)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "model.embed_tokens.weight" in changed
    assert any(".sidecar." in k for k in changed)
    assert "right_fraction" in (out / "train.log").read_text()


def test_freeze_backbone_trains_only_the_sidecars(inputs, tmp_path):
    out = tmp_path / "frozen"
    result = run_inprocess(overrides(inputs, out, "freeze_backbone=true"))
    check_metrics(out, 3)
    before, after = weights(inputs[1]), weights(result.export_dir)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".sidecar." in k for k in changed)


def test_lora_trains_only_the_adapters(inputs, tmp_path):
    out = tmp_path / "lora"
    result = run_inprocess(overrides(inputs, out, "lora.enabled=true", "lora.r=4"))
    check_metrics(out, 3)
    before = weights(inputs[1])
    trained = {k: v.detach() for k, v in result.engine.module.state_dict().items()}
    adapters = {k: v for k, v in trained.items() if ".lora_" in k}
    assert adapters and any(k.endswith("lora_B.default.weight") and v.abs().sum() > 0 for k, v in adapters.items())
    for key, value in trained.items():  # everything else: the starting weights
        if ".lora_" not in key:
            name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(value, before[name]), key
    exported = load_file(result.export_dir / "adapter_model.safetensors")
    assert exported and all("lora_" in k for k in exported)


def test_bidirectional_model_is_refused_before_any_work(inputs, tmp_path):
    bidirectional = make_model_dir(tmp_path / "bidi", attention="bidirectional", prediction="inplace", sidecar_layers=[])
    root, _, data, heldout = inputs
    out = tmp_path / "out"
    items = base_overrides(bidirectional, out, data, heldout, root / "cache") + ["objective=certainty"]
    with pytest.raises(ValueError, match="objective 'certainty' does not fit a 'bidirectional' model"):
        run_inprocess(items)
    assert not out.exists()



@pytest.mark.slow
def test_two_ranks_through_the_deepspeed_launcher(tmp_path):
    """The documented commands end to end: teacher data from the CLI, then `deepspeed --num_gpus 2`."""
    model = make_model_dir(tmp_path / "model")
    train, heldout = write_corpus(tmp_path / "corpus", n_train=60, n_heldout=20)
    data = tmp_path / "data" / "teacher.jsonl"
    gen = run_cli(python("train/teacher_data.py", *teacher_args(model, train, data)), timeout=300,
                  env={"OMP_NUM_THREADS": "1"})
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert "wrote 48 records" in gen.stderr
    out = tmp_path / "run"
    items = base_overrides(model, out, data.parent, heldout, tmp_path / "cache") + [
        "objective=certainty", "steps=12", "eval_every=6", "save_every=6", "lr=1.0e-2"]  # data.train: the folder
    launch = run_cli([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "train/pretrain.py", *items],
                     timeout=300)
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    train_records = check_metrics(out, 12)
    assert read_state(out / "checkpoints" / "step-00000012")["world_size"] == 2
    evals = read_metrics(out, "eval")
    assert [r["step"] for r in evals] == [0, 6, 12] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    first, last = train_records[0]["ce"], sum(r["ce"] for r in train_records[-3:]) / 3
    assert last < first, [r["ce"] for r in train_records]
    assert (out / "final" / "model.safetensors").is_file()
