"""objective=drafter through the training program: teacher records of the frozen target's own replies, the target
unchanged, exact resume, an export that from_pretrained loads beside its target (and verify=True stays the target's
greedy output), the features cache, and the held-out ShareGPT split refused by id."""


import pytest
import torch
from safetensors.torch import load_file

from r2lm import R2LMForDiffusionLM, generate
from r2lm.checkpoints import complete_checkpoints
from r2lm.drafter import Drafter
from r2lm.workloads import HELDOUT_PERCENT, is_heldout
from tests.helpers.models import make_model_dir
from tests.helpers.processes import free_port, python, run_cli
from tests.helpers.training import drafter_overrides, run_inprocess, teacher_records
from train.tracking import read_metrics


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafting")
    model = make_model_dir(root / "model", sidecar_layers=[])
    with torch.no_grad():  # sharper greedy choices: the target's replies are learnable in a few steps
        target = R2LMForDiffusionLM.from_pretrained(model)
        target.lm_head.weight.mul_(20)
        target.save_pretrained(model)
    train = teacher_records(model, root / "train.jsonl", 24, seed=0,
                            ids=[f"sharegpt/train{i}" for i in range(1000) if not is_heldout(f"train{i}")][:24])
    heldout = teacher_records(model, root / "heldout.jsonl", 6, seed=1)
    return root, model, train, heldout


@pytest.fixture(scope="module")
def trained(inputs):
    out = inputs[0] / "run"
    return run_inprocess(drafter_overrides(inputs, out, f"drafter.features_cache={inputs[0] / 'features'}"))


def test_the_drafter_trains_and_exports_beside_an_unchanged_target(trained, inputs):
    _, model, _, _ = inputs
    rows = read_metrics(trained.run_dir, "train")
    assert len(rows) == 6 and all("tau" in r and "first_right" in r for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    evals = read_metrics(trained.run_dir, "eval")
    assert [r["step"] for r in evals] == [0, 3, 6] and all("eval_tau" in r for r in evals)
    drafter = Drafter.from_pretrained(trained.export_dir).eval()
    assert len(drafter.draft_ids) == 64 and drafter.config.block_size == 4
    assert not any(k.startswith("model.") or k.startswith("lm_head") for k in load_file(trained.export_dir / "model.safetensors"))
    target = R2LMForDiffusionLM.from_pretrained(model).eval()  # the target's files are untouched by the run
    ids = torch.randint(3, target.config.vocab_size - 1, (2, 7), generator=torch.Generator().manual_seed(5))
    ar = generate(target, ids, max_new_tokens=20, block_size=1, eos_token_id=[])
    out = generate(target, ids, max_new_tokens=20, verify=True, drafter=drafter, eos_token_id=[])
    assert torch.equal(out.sequences, ar.sequences)


def test_a_training_checkpoint_loads_as_a_drafter(trained):
    """Every checkpoint of the run is a drafter (the benchmark's tau-against-training-tokens curve reads them); the
    last one holds the exported weights."""
    last = complete_checkpoints(trained.run_dir / "checkpoints")[-1][1]
    drafter = Drafter.from_training_checkpoint(last)
    exported = load_file(trained.export_dir / "model.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in drafter.state_dict().items())


def test_features_are_cached_once_per_record(trained, inputs):
    cached = list((inputs[0] / "features").rglob("*.pt"))
    assert len(cached) == 24 + 6  # every training and held-out record, once


def test_drafter_training_resumes_exactly(trained, inputs):
    out = inputs[0] / "resumed"
    first = run_inprocess(drafter_overrides(inputs, out, "stop_at=3"))
    assert first.step == 3 and [s for s, _ in complete_checkpoints(out / "checkpoints")] == [3]
    run_inprocess(drafter_overrides(inputs, out))
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time_s")} for r in rows]  # noqa: E731
    assert strip(read_metrics(out, None)) == strip(read_metrics(trained.run_dir, None))
    a, b = load_file(out / "final" / "model.safetensors"), load_file(trained.export_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_training_goes_on_from_a_trained_drafter(trained, inputs, tmp_path):
    """drafter.init=FOLDER (the shipped drafter adapted to other data): the run starts from the folder's weights and
    draft vocabulary, so its step-0 evaluation is the one the first run ended with (the same held-out batches),
    and it trains on, here on other records; a drafter.* key that sets another shape than the folder's is refused,
    naming it, and so is a folder that holds no drafter."""
    _, _, _, heldout = inputs
    last = read_metrics(trained.run_dir, "eval")[-1]
    on = run_inprocess(drafter_overrides(inputs, tmp_path / "on", f"drafter.init={trained.export_dir}",
                                         f"data.train={heldout}", "steps=2", "save_every=2", "eval_every=2"))
    first = read_metrics(on.run_dir, "eval")[0]
    assert first["step"] == 0 and first["eval_tau"] == last["eval_tau"]
    assert first["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
    before, after = Drafter.from_pretrained(trained.export_dir), Drafter.from_pretrained(on.export_dir)
    assert torch.equal(after.draft_ids, before.draft_ids)
    assert not torch.equal(after.fuse.weight, before.fuse.weight)
    for key, message in [("drafter.block_size=8", r"drafter.block_size 8 \(the folder's: 4\)"),
                         ("drafter.layers=2", r"drafter.layers 2 \(the folder's: 1\)")]:
        with pytest.raises(ValueError, match=message):
            run_inprocess(drafter_overrides(inputs, tmp_path / "other", f"drafter.init={trained.export_dir}", key))
    with pytest.raises(ValueError, match="drafter.init is target, random or a drafter's folder"):
        run_inprocess(drafter_overrides(inputs, tmp_path / "none", f"drafter.init={tmp_path}"))
    assert not (tmp_path / "other").exists() and not (tmp_path / "none").exists()


def test_held_out_sharegpt_records_never_reach_training(inputs, tmp_path):
    """Records are refused by their ShareGPT conversation id: the split the benchmark's chat prompts come from."""
    _, model, _, _ = inputs
    held = next(f"c{i}" for i in range(1000) if is_heldout(f"c{i}"))
    assert 0 < HELDOUT_PERCENT < 50
    bad = teacher_records(model, tmp_path / "bad.jsonl", 3, seed=2, ids=["sharegpt/x", f"sharegpt/{held}", "pydoc/y"])
    with pytest.raises(ValueError, match=rf"line 2 continues sharegpt/{held}, a held-out ShareGPT conversation"):
        run_inprocess(drafter_overrides((inputs[0], model, bad, None), tmp_path / "run")[:4] +
                      drafter_overrides(inputs, tmp_path / "run")[4:])
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_bf16_training_runs_beside_a_float32_target(inputs, tmp_path):
    """precision=bf16: the drafter trains in bf16 while the frozen target's features come in float32."""
    result = run_inprocess(drafter_overrides(inputs, tmp_path / "bf16", "precision=bf16", "steps=2", "save_every=2",
                                             "eval_every=0"))
    drafter = Drafter.from_pretrained(result.export_dir)
    assert drafter.fuse.weight.dtype == torch.float32  # export_dtype=auto: the target's
    assert all(r["loss"] == r["loss"] for r in read_metrics(result.run_dir, "train"))  # finite


def test_replay_of_the_drafters_errors_trains(inputs, tmp_path):
    """drafter.replay through the training program: a run with half its blocks replayed trains (finite losses) and
    evaluates on random anchors alone (r2lm.drafter_loss, `replay`; tests/generation/test_drafter_loss.py)."""
    result = run_inprocess(drafter_overrides(inputs, tmp_path / "replay", "drafter.replay=0.5", "steps=2",
                                             "save_every=2", "eval_every=2"))
    rows = read_metrics(result.run_dir, "train")
    assert len(rows) == 2 and all(r["loss"] == r["loss"] and 1 <= r["tau"] for r in rows)
    assert [r["step"] for r in read_metrics(result.run_dir, "eval")] == [0, 2]


def test_conditional_columns_reach_the_training_loss(inputs, tmp_path):
    """drafter.conditional through the training program: at step 0 (the same weights) the held-out loss is another
    (columns after a wrong guess left out) and the acceptance measured the same (r2lm.drafter_loss, `conditional`;
    tests/generation/test_drafter_loss.py)."""
    evals = {}
    for conditional in ("false", "true"):
        result = run_inprocess(drafter_overrides(inputs, tmp_path / conditional, f"drafter.conditional={conditional}",
                                                 "steps=1", "save_every=1", "eval_every=1"))
        evals[conditional] = read_metrics(result.run_dir, "eval")[0]
    plain, conditional = evals["false"], evals["true"]
    assert plain["step"] == conditional["step"] == 0
    assert plain["eval_tau"] == conditional["eval_tau"] and plain["eval_first_right"] == conditional["eval_first_right"]
    assert plain["eval_loss"] != conditional["eval_loss"]


@pytest.mark.parametrize("extra, message", [(["lora.enabled=true"], "lora, freeze_backbone and complementary"),
                                            (["drafter.blocks=0"], "drafter.blocks must be positive"),
                                            (["drafter.replay=1.5"], "drafter.replay is a share of the blocks"),
                                            (["drafter.feature_layers=[9]"], "feature_layers must be target layer"),
                                            (["objective=block", "drafter.layers=2"], "drafter.* keys set the drafter")])
def test_bad_drafter_settings_are_refused(inputs, tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        run_inprocess(drafter_overrides(inputs, tmp_path / "run", *extra))


@pytest.mark.slow
def test_two_ranks_through_the_deepspeed_launcher(inputs, tmp_path):

    args = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "train/pretrain.py",
            *drafter_overrides(inputs, tmp_path / "run", "steps=2", "save_every=2", "eval_every=2")]
    done = run_cli(args, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert Drafter.from_pretrained(tmp_path / "run" / "final").config.block_size == 4
    assert python  # (the launcher is the real one)


def test_a_features_cache_serves_only_its_target_and_whole_records(inputs, tmp_path, caplog):
    """Issue 37 / 40 item 6: features cached for one target are never read for another (each target's files live
    under its own identity: weights, config, layers, dtype), and a file that does not hold its record's length
    (a truncated write, an edited cache) is computed again, with a warning, rather than zero-filled."""
    from train.drafter import Batches, FeatureCache, read_records

    _, model, train, _ = inputs
    target = R2LMForDiffusionLM.from_pretrained(model).eval()
    records = read_records([str(train)], 64, "data.train")[:3]
    batch = Batches(records, 3, 0).batch([0, 1, 2])
    layers = (0, 1)
    first = FeatureCache(str(tmp_path), target, layers)
    want = first(batch)
    assert first.misses == 3 and len(list(tmp_path.rglob("*.pt"))) == 3
    other = R2LMForDiffusionLM.from_pretrained(model).eval()  # the same shapes, one weight changed
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    second = FeatureCache(str(tmp_path), other, layers)
    got = second(batch)
    assert second.hits == 0 and second.misses == 3  # its own files: the first target's are not read
    assert not all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    path = sorted(first.folder.glob("*.pt"))[0]
    stored = torch.load(path)
    torch.save(stored[:-2].clone(), path)  # two positions short
    again = FeatureCache(str(tmp_path), target, layers)
    with caplog.at_level("WARNING"):
        assert all(torch.equal(a, b) for a, b in zip(again(batch), want, strict=True))
    assert again.misses == 1 and again.hits == 2 and "computed again" in caplog.text
    assert torch.load(path).shape == stored.shape  # rewritten whole


def test_unfinished_teacher_files_and_other_models_replies_are_refused(inputs, tmp_path):
    """Issue 40 item 6: a killed teacher run's file, or the replies of another model of the same shapes, trained a
    drafter without a word. A teacher file is read only once its run wrote every record (FILE.complete); a record
    that names another model as its teacher is refused, naming both."""
    import json

    from train.teacher_records import COMPLETE_SUFFIX, SETTINGS_SUFFIX

    root, model, train, heldout = inputs
    cut = tmp_path / "cut.jsonl"  # what a run asked for 24 records leaves when it is killed after 21
    (tmp_path / ("cut.jsonl" + SETTINGS_SUFFIX)).write_text("{}\n")
    cut.write_text("".join(train.read_text().splitlines(keepends=True)[:-3]))
    (tmp_path / ("cut.jsonl" + COMPLETE_SUFFIX)).write_text(json.dumps({"records": 24}))  # (an earlier, longer one)
    with pytest.raises(ValueError, match=r"cut.jsonl holds 21 records of a teacher run that has not finished"):
        run_inprocess(drafter_overrides((root, model, cut, heldout), tmp_path / "run"))
    other = tmp_path / "other.jsonl"
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    rows[4]["teacher"] = "0123456789abcdef"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"other.jsonl, line 5 holds the replies of another model \(teacher "
                                         r"0123456789abcdef, the target [0-9a-f]+\)"):
        run_inprocess(drafter_overrides((root, model, other, heldout), tmp_path / "run2"))
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run2" / "checkpoints").exists()
