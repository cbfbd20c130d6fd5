"""The training configuration: YAML + overrides, unknown keys, types, --help, DeepSpeed JSON, LR schedule."""

import json
import math

import pytest

from r2lm.diffusion import noise_seed
from tests.helpers import REPO
from tests.helpers.processes import python, run_cli
from train.checks import read_deepspeed_config
from train.config import all_keys, load_config, parse_overrides
from train.optimizer import lr_factor

REQUIRED = ["model=m", "output_dir=o", "data.train=t.txt"]


def test_overrides_nest_and_parse_yaml_scalars():
    assert parse_overrides(["a.b.c=3", "a.d=true", "e=1.0e-4", "f=null", "g=[1, 2]", "h=text"]) == {
        "a": {"b": {"c": 3}, "d": True}, "e": 1e-4, "f": None, "g": [1, 2], "h": "text"}
    with pytest.raises(ValueError, match="not of the form key=value"):
        parse_overrides(["lr"])


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: m\noutput_dir: o\nlr: 1.0e-3\ndata:\n  train: t.txt\n  text_field: body\n")
    cfg = load_config(path, ["lr=3e-4", "data.streaming=true"])
    assert cfg.lr == 3e-4 and isinstance(cfg.lr, float)  # YAML reads "3e-4" as a string: coerced
    assert cfg.data.text_field == "body" and cfg.data.streaming is True and cfg.data.train == "t.txt"
    assert cfg.objective == "block" and cfg.data.heldout is None  # defaults


def test_unknown_keys_are_named_with_suggestions(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key\(s\): data.txt_field \(did you mean data.text_field\?\), "
                                         r"lrr \(did you mean lr\?\), zzz"):
        load_config(None, REQUIRED + ["lrr=1", "data.txt_field=x", "zzz=1"])
    path = tmp_path / "c.yaml"
    path.write_text("model: m\noutput_dir: o\ndata: {train: t}\nwarmup: 10\n")
    with pytest.raises(ValueError, match=r"unknown config key\(s\): warmup \(did you mean warmup_steps\?\)"):
        load_config(path)


@pytest.mark.parametrize(
    "override,message",
    [
        ("steps=ten", "config key steps must be int, got 'ten'"),
        ("freeze_backbone=3", "config key freeze_backbone must be bool"),
        ("objective=gpt", r"config key objective must be one of \('ar', 'mdlm', 'block', 'certainty', 'attention_transfer', 'drafter'\), got 'gpt'"),
        ("data=3", "config key data must be a mapping"),
        ("seq_len=0", "seq_len must be positive"),
        ("stop_at=2000", r"stop_at must be in \[1, steps=1000\]"),
        ("data.heldout_fraction=1.5", r"heldout_fraction must be in \[0, 1\)"),
        ("adam_betas=[0.9]", "adam_betas must be two numbers"),
        ("eps=1.0", r"eps \(the smallest masking probability\) must be in \(0, 1\), got 1.0"),
        ("eps=-0.5", r"eps .* must be in \(0, 1\), got -0.5"),
        ("seed=-1", r"seed must be an integer in \[0, 2\*\*63\), got -1"),
        ("eval_seed=100000000000000000000", r"eval_seed must be an integer in \[0, 2\*\*63\)"),
    ],
)
def test_bad_values(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, REQUIRED + [override])


def test_missing_required_keys():
    with pytest.raises(ValueError, match=r"missing required config key\(s\): model, output_dir, data.train"):
        load_config(None, [])


def test_shipped_configs_load():
    tiny = load_config(REPO / "configs/train/tiny_cpu.yaml")
    assert tiny.objective == "block" and tiny.seq_len == 128 and tiny.deepspeed.endswith("zero2.json")
    big = load_config(REPO / "configs/train/qwen3_1p7b_r2lm.yaml")
    assert big.precision == "bf16" and big.deepspeed.endswith("zero2.json") and big.data.streaming


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*/*.yaml")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_training_config_is_valid(path):
    """What the scripts launch: each file with the keys they fill in (model, output_dir, data) given on the
    command line, as they give them."""
    cfg = load_config(path, REQUIRED)
    assert cfg.steps > 0 and cfg.model == "m"


def test_qwen3_config_sidecars_add_about_ten_percent():
    """The arithmetic stated in configs/train/qwen3_1p7b_r2lm.yaml, recomputed from the real Qwen3-1.7B shape."""
    from r2lm import R2LMConfig

    text = (REPO / "configs/train/qwen3_1p7b_r2lm.yaml").read_text()
    layers = json.loads(text.split("--sidecar-layers ")[1].split()[0].join("[]"))
    cfg = R2LMConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, qk_norm=True,
                     tie_word_embeddings=True, sidecar_layers=layers, block_size=32)
    backbone = 1_720_574_976  # Qwen3-1.7B with tied embeddings (the arithmetic is in the YAML)
    added = len(layers) * cfg.num_sidecar_parameters
    assert f"{cfg.num_sidecar_parameters:,}" in text and f"{added:,}" in text
    assert 0.09 < added / backbone < 0.11


def test_every_key_is_in_help():
    out = run_cli(python("train/pretrain.py", "--help"), timeout=60)
    assert out.returncode == 0
    for name, _ in all_keys():
        assert f"  {name}" in out.stdout, name
    assert "deepspeed --num_gpus" in out.stdout


def test_cli_reports_unknown_key_before_any_work():
    out = run_cli(python("train/pretrain.py", "--config", "configs/train/tiny_cpu.yaml", "learning_rate=1"), timeout=60)
    assert out.returncode == 2
    assert "error: unknown config key(s): learning_rate" in out.stderr
    assert "Traceback" not in out.stderr


def test_deepspeed_json_gets_batch_clipping_and_precision_from_the_training_config():
    cfg = load_config(None, REQUIRED + ["micro_batch_size=3", "grad_accum=5", "grad_clip=0.5", "deepspeed=configs/deepspeed/zero3.json"])
    ds = read_deepspeed_config(cfg, use_bf16=False)
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 5
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] is False and ds["zero_optimization"]["stage"] == 3
    assert read_deepspeed_config(cfg, use_bf16=True)["bf16"]["enabled"] is True
    for stage in (1, 2, 3):
        shipped = json.loads((REPO / f"configs/deepspeed/zero{stage}.json").read_text())
        assert shipped["zero_optimization"]["stage"] == stage and "optimizer" not in shipped


def test_deepspeed_json_conflicts_are_errors(tmp_path):
    path = tmp_path / "ds.json"
    for body, message in [
        ({"optimizer": {"type": "Adam"}}, "has an 'optimizer' section"),
        ({"train_micro_batch_size_per_gpu": 8}, "sets train_micro_batch_size_per_gpu=8 but the training config gives 4"),
        ({"fp16": {"enabled": True}}, "enables fp16"),
    ]:
        path.write_text(json.dumps(body))
        with pytest.raises(ValueError, match=message):
            read_deepspeed_config(load_config(None, REQUIRED + [f"deepspeed={path}"]), use_bf16=False)
    with pytest.raises(ValueError, match="does not exist"):
        read_deepspeed_config(load_config(None, REQUIRED + ["deepspeed=nope.json"]), use_bf16=False)


def test_warmup_then_cosine():
    cfg = load_config(None, REQUIRED + ["steps=110", "warmup_steps=10", "min_lr_ratio=0.1"])
    factors = [lr_factor(s, cfg) for s in range(110)]
    assert factors[:3] == [0.1, 0.2, 0.3] and factors[9] == 1.0 and factors[10] == 1.0
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))  # monotone decay after warmup
    assert math.isclose(factors[60], 0.55) and math.isclose(lr_factor(110, cfg), 0.1)


def test_noise_seeds_differ_per_step_micro_and_rank():
    seeds = {noise_seed(0, s, m, r) for s in range(5) for m in range(3) for r in range(4)}
    assert len(seeds) == 60 and noise_seed(0, 1, 2, 3) == noise_seed(0, 1, 2, 3)
