"""Bad input to the training program stops it with a ValueError naming the problem, before any work starts."""

import pytest

from tests.helpers.models import make_model_dir, tiny_hf_config
from tests.helpers.training import base_overrides, run_inprocess, write_corpus


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    model = make_model_dir(root / "model")
    train, heldout = write_corpus(root / "corpus", n_train=60, n_heldout=10)
    return root, model, train, heldout


def expect_error(overrides, message, out):
    with pytest.raises(ValueError, match=message):
        run_inprocess(overrides)
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.train={root}/missing.txt", "data.train: no such file: .*missing.txt"),
        ("data.heldout={root}/nope.jsonl", "data.heldout: no such file: .*nope.jsonl"),
        ("seq_len=513", "seq_len 513 is above the model's max_position_embeddings 512"),
        ("seq_len=8", "seq_len 8 must exceed the block size 8"),
        ("objective=mdlm", r"objective 'mdlm' does not fit a 'causal' model \(it needs attention in \('bidirectional',\)\)"),
        ("model={root}/no-model", "model .*no-model is not a checkpoint folder"),
        ("complementary=true objective=ar", "complementary masks exist for the block objective only"),
        ("deepspeed={root}/missing.json", "DeepSpeed config .*missing.json does not exist"),
        ("resume={root}/corpus", "is not a complete training checkpoint"),
    ],
)
def test_bad_input(inputs, override, message):
    root, model, train, heldout = inputs
    out = root / "out"
    extra = [item.format(root=root) for item in override.split()]
    expect_error(base_overrides(model, out, train, heldout, root / "cache") + extra, message, out)
    assert not out.exists()  # nothing was written: the check came before the run folder


def test_empty_data_file(inputs):
    root, model, _, heldout = inputs
    (root / "empty.txt").write_text("")
    expect_error(base_overrides(model, root / "out", root / "empty.txt", heldout, root / "cache"), "data file .*empty.txt is empty",
                 root / "out")


def test_data_without_one_full_sequence(inputs):
    root, model, _, heldout = inputs
    (root / "short.txt").write_text("the quick brown fox\n")
    expect_error(base_overrides(model, root / "short-out", root / "short.txt", heldout, root / "cache"),
                 r"data.train \(.*short.txt\) yields no complete sequence of 64 tokens \(1 documents\)", root / "short-out")


def test_freeze_backbone_without_sidecars(inputs, tmp_path):
    root, _, train, heldout = inputs
    plain = make_model_dir(tmp_path / "plain", sidecar_layers=[])
    expect_error(base_overrides(plain, tmp_path / "out", train, heldout, root / "cache") + ["freeze_backbone=true"],
                 "freeze_backbone leaves nothing to train: the model has no sidecar_layers", tmp_path / "out")


def test_non_r2lm_checkpoint(inputs, tmp_path):
    from transformers import Qwen3ForCausalLM

    root, _, train, heldout = inputs
    Qwen3ForCausalLM(tiny_hf_config("qwen3")).save_pretrained(tmp_path / "qwen3")
    expect_error(base_overrides(tmp_path / "qwen3", tmp_path / "out", train, heldout, root / "cache"),
                 "convert it with python -m convert from-hf", tmp_path / "out")
