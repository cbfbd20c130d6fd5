"""In-process training runs (one rank, real DeepSpeed ZeRO-2 engine): export, conversion, resume, NaN stop.

The multi-process launches (2 ranks, ZeRO-2 and ZeRO-3, the deepspeed launcher) are in test_train_launch.py."""

import json
import math
import shutil

import pytest
import torch

from r2lm import R2LMForDiffusionLM
from r2lm.checkpoints import complete_checkpoints, read_state
from r2lm.convert.__main__ import main as convert_main
from tests.helpers.training import run_inprocess, training_inputs
from tests.helpers.training import run_overrides as overrides
from train.guard import NonFiniteLossError
from train.tracking import read_metrics


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return training_inputs(tmp_path_factory.mktemp("run"))



def weights(folder):
    return R2LMForDiffusionLM.from_pretrained(folder).state_dict()


def assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def full_run(inputs):
    """6 uninterrupted steps, checkpoints at 3 and 6, held-out evaluations at 0, 3, 6."""
    out = inputs[0] / "full"
    return run_inprocess(overrides(inputs, out)), out


def test_export_loads_and_equals_the_engine_weights(full_run, inputs):
    result, out = full_run
    engine_state = {k: v.detach().clone() for k, v in result.engine.module.state_dict().items()}
    exported = R2LMForDiffusionLM.from_pretrained(out / "final")
    assert_same_weights(exported.state_dict(), engine_state)
    original = weights(inputs[1])
    assert any(not torch.equal(original[k], engine_state[k]) for k in original)  # it did train
    assert exported.config.sidecar_layers == [1, 3] and exported.config.mask_token_id == original_mask(inputs)
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(out / "final")) == exported.config.vocab_size


def original_mask(inputs):
    return R2LMForDiffusionLM.config_class.from_pretrained(inputs[1]).mask_token_id


def test_run_folder_and_metrics(full_run):
    _, out = full_run
    train = read_metrics(out)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in train)
    assert train[0]["lr"] == pytest.approx(1.5e-3) and train[1]["lr"] == pytest.approx(3e-3)  # warmup 2 steps
    evals = read_metrics(out, "eval")
    assert [r["step"] for r in evals] == [0, 3, 6] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [3, 6]
    assert (out / "checkpoints" / "latest").read_text() == "step-00000006"
    assert read_state(out / "checkpoints" / "step-00000006")["world_size"] == 1
    assert (out / "config.yaml").is_file() and "step 6/6" in (out / "train.log").read_text()


def test_convert_deepspeed_to_hf_matches_the_export(full_run, tmp_path):
    _, out = full_run
    assert convert_main(["deepspeed-to-hf", str(out), str(tmp_path / "latest")]) == 0  # run folder: newest checkpoint
    assert_same_weights(weights(tmp_path / "latest"), weights(out / "final"))
    step3 = out / "checkpoints" / "step-00000003"
    assert convert_main(["deepspeed-to-hf", str(step3), str(tmp_path / "s3"), "--dtype", "bfloat16"]) == 0
    s3 = R2LMForDiffusionLM.from_pretrained(tmp_path / "s3")
    assert s3.dtype == torch.bfloat16
    assert not torch.equal(s3.state_dict()["model.embed_tokens.weight"].float(), weights(out / "final")["model.embed_tokens.weight"])
    assert convert_main(["deepspeed-to-hf", str(step3), str(tmp_path / "s3")]) == 2  # exists, no --overwrite
    assert convert_main(["deepspeed-to-hf", str(tmp_path), str(tmp_path / "x")]) == 2  # not a checkpoint


def test_resume_reproduces_the_uninterrupted_losses_exactly(full_run, inputs):
    _, full = full_run
    out = inputs[0] / "resumed"
    first = run_inprocess(overrides(inputs, out, "stop_at=4"))
    assert first.step == 4 and first.export_dir is None and not (out / "final").exists()
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [3, 4]  # stop_at always checkpoints
    # a crash after step 4's checkpoint was renamed would leave step 4; one during step 5's save leaves a temp
    # folder: drop the one, fake the other, and resume must take step 3 and replay 4..6
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    (out / "checkpoints" / ".tmp-step-00000005").mkdir()
    second = run_inprocess(overrides(inputs, out))
    assert second.step == 6
    strip = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time_s")} for r in read_metrics(out, None)]
    reference = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time_s")} for r in read_metrics(full, None)]
    assert strip == reference  # losses, lrs, grad norms and evaluations: bit for bit
    assert_same_weights(weights(out / "final"), weights(full / "final"))
    assert not (out / "checkpoints" / ".tmp-step-00000005").exists()


def test_streaming_run_resumes_exactly(inputs):
    root = inputs[0]
    full, part = root / "stream-full", root / "stream-part"
    extra = ["data.streaming=true", "data.shuffle_buffer=50", "steps=4", "eval_every=0", "save_every=2"]
    run_inprocess(overrides(inputs, full, *extra))
    run_inprocess(overrides(inputs, part, *extra, "stop_at=2"))
    run_inprocess(overrides(inputs, part, *extra))
    assert [r["loss"] for r in read_metrics(part)] == [r["loss"] for r in read_metrics(full)]


def test_nan_loss_stops_the_run_and_keeps_the_last_checkpoint(inputs, tmp_path):
    out = tmp_path / "nan"
    # lr 1e12 sends every weight to ~1e12 after step 1 and the step 2 forward overflows to NaN: checkpoint 1 holds
    # those weights, so the good restart point is the model (train/guard.py)
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss \(nan\) at step 2 \(micro-batch 0\).*last good checkpoint "
                                                 r"is none \(step-00000001 was saved as the run diverged\)"):
        run_inprocess(overrides(inputs, out, "lr=1.0e12", "warmup_steps=0", "save_every=1"))
    root = out / "checkpoints"
    assert [s for s, _ in complete_checkpoints(root)] == [1]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-00000001"]  # no half checkpoint
    assert [r["step"] for r in read_metrics(out)] == [1] and not (out / "final").exists()
    assert convert_main(["deepspeed-to-hf", str(root), str(tmp_path / "good")]) == 0
    assert all(torch.isfinite(v).all() for v in weights(tmp_path / "good").values())


def test_infinite_gradient_stops_the_run(inputs, tmp_path):
    with pytest.raises(NonFiniteLossError, match=r"non-finite gradient \(inf or NaN\) at step 2, before its update"):
        run_inprocess(overrides(inputs, tmp_path / "inf", "lr=1.0e8", "warmup_steps=0", "save_every=1"))
    assert [s for s, _ in complete_checkpoints(tmp_path / "inf" / "checkpoints")] == [1]


def test_resume_checks(full_run, inputs, tmp_path):
    _, full = full_run
    with pytest.raises(ValueError, match="already holds checkpoints and resume=never"):
        run_inprocess(overrides(inputs, full, "resume=never", "steps=8"))
    with pytest.raises(ValueError, match="is at step 6, the run has steps=6 and is exported: nothing to do"):
        run_inprocess(overrides(inputs, full))
    copy = tmp_path / "ckpt" / "step-00000006"
    shutil.copytree(full / "checkpoints" / "step-00000006", copy)
    state = json.loads((copy / "trainer_state.json").read_text())
    (copy / "trainer_state.json").write_text(json.dumps({**state, "world_size": 8}))
    with pytest.raises(ValueError, match="was written by 8 ranks but this run has 1"):
        run_inprocess(overrides(inputs, tmp_path / "other", f"resume={copy}", "steps=8"))


@pytest.mark.parametrize("precision, zero", [("fp32", 2), ("bf16", 2), ("bf16", 1), ("fp32", 3)])
def test_freeze_backbone_trains_only_the_sidecars(inputs, tmp_path, precision, zero):
    """Frozen weights have no fp32 master copy: under bf16 (what precision=auto picks on a GPU) the checkpoint holds
    them rounded, at ZeRO-1 not at all; the export takes them from the model the run started from, bit for bit."""
    result = run_inprocess(overrides(inputs, tmp_path / "frozen", "freeze_backbone=true", "steps=3", "eval_every=0",
                                     f"precision={precision}", f"deepspeed=configs/deepspeed/zero{zero}.json"))
    before, after = weights(inputs[1]), weights(result.export_dir)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".sidecar." in k for k in changed)
    assert any(k.endswith("sidecar.gate") for k in changed)
    cli = tmp_path / "cli"  # the converter's export of the same checkpoint: the same weights
    assert convert_main(["deepspeed-to-hf", str(tmp_path / "frozen"), str(cli)]) == 0
    assert_same_weights(weights(cli), after)


@pytest.mark.parametrize("extra", [
    ["objective=ar"],
    ["complementary=true", "grad_accum=1", "deepspeed=configs/deepspeed/zero1.json"],
    ["gradient_checkpointing=true", "data.heldout_fraction=0.1", "data.heldout=null"],
])
def test_other_objectives_and_stages_train(inputs, tmp_path, extra):
    run_inprocess(overrides(inputs, tmp_path / "o", "steps=3", "eval_every=0", "save_every=0", *extra))
    losses = [r["loss"] for r in read_metrics(tmp_path / "o")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_wandb_offline_writes_inside_the_run_folder(inputs, tmp_path):
    out = tmp_path / "wb"
    run_inprocess(overrides(inputs, out, "wandb.mode=offline", "steps=2", "eval_every=0", "export=false"))
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert (out / "wandb_run_id").read_text() in runs[0].name
