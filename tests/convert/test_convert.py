"""`python -m convert from-hf`: the mask token, atomic output, and bad input (GGUF files, tokenizers, generation
configs)."""

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from r2lm import R2LMConfig, R2LMForDiffusionLM
from r2lm.checkpoints import load_tokenizer
from r2lm.convert.__main__ import main
from r2lm.convert.from_hf import convert_from_hf
from tests.helpers.checkpoints import gguf_file
from tests.helpers.models import sharp_hf, tiny_hf_config, tiny_r2lm, tiny_tokenizer


@pytest.fixture
def qwen3_dir(tmp_path):
    torch.manual_seed(0)
    tok = tiny_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_hf_config("qwen3", vocab_size=len(tok)))
    src = tmp_path / "qwen3"
    model.save_pretrained(src)
    tok.save_pretrained(src)
    return src


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_adds_mask_token_to_tokenizer_embeddings_and_config(qwen3_dir, tmp_path):
    before = _snapshot(qwen3_dir)
    vocab = len(AutoTokenizer.from_pretrained(qwen3_dir))
    assert main(["from-hf", str(qwen3_dir), str(tmp_path / "out"), "--sidecar-layers", "1", "--headdim", "16", "--d-state", "8"]) == 0
    assert _snapshot(qwen3_dir) == before  # the source is never modified

    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    model = R2LMForDiffusionLM.from_pretrained(tmp_path / "out")
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    assert mask_id == vocab and tok.mask_token == "<|mask|>"
    assert model.config.mask_token_id == mask_id and model.config.vocab_size == vocab + 1
    emb = model.get_input_embeddings().weight
    torch.testing.assert_close(emb[mask_id], emb[:mask_id].mean(0))
    assert tok("a <|mask|> fox").input_ids.count(mask_id) == 1


def test_check_measures_the_gap_to_the_source_and_refuses_a_wrong_conversion(qwen3_dir, tmp_path, caplog, capsys,
                                                                             monkeypatch):
    """--check runs the source (transformers) and the R2LM on a probe text before anything is written: closed gates
    pass it; a conversion that lost a weight is refused, nothing written; so is an attention that is not the
    source's, before any work."""
    import r2lm.convert.from_hf as from_hf

    args = ["from-hf", str(qwen3_dir), str(tmp_path / "out"), "--sidecar-layers", "1", "--headdim", "16", "--check"]
    with caplog.at_level("INFO"):
        assert main(args) == 0
    gap = float(re.search(r"max \|logit gap\| (\S+) on a probe text", caplog.text).group(1))
    assert gap <= from_hf.CHECK_TOLERANCE
    load_backbone = from_hf.load_backbone

    def one_weight_lost(model, state, fresh):  # a converter that leaves the last layer's MLP as initialised
        lost = "layers.2.mlp.down_proj"
        load_backbone(model, {k: v for k, v in state.items() if lost not in k}, fresh=lambda n: fresh(n) or lost in n)

    monkeypatch.setattr(from_hf, "load_backbone", one_weight_lost)
    assert main([*args[:2], str(tmp_path / "wrong"), *args[3:]]) == 2
    assert "--check: the R2LM does not compute what" in capsys.readouterr().err
    assert not (tmp_path / "wrong").exists()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="--check compares the R2LM with the source model"):
        convert_from_hf(qwen3_dir, tmp_path / "bidirectional", check=True, attention="bidirectional")
    assert not (tmp_path / "bidirectional").exists()


def test_existing_mask_token_is_reused(qwen3_dir, tmp_path):
    existing = AutoTokenizer.from_pretrained(qwen3_dir).convert_ids_to_tokens(40)
    convert_from_hf(qwen3_dir, tmp_path / "out", mask_token=existing)
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    model = R2LMForDiffusionLM.from_pretrained(tmp_path / "out")
    assert model.config.mask_token_id == 40 == tok.mask_token_id and model.config.vocab_size == len(tok)


@pytest.mark.parametrize("option,role", [
    (["--mask-token-id", "0"], "EOS"), (["--mask-token-id", "1"], "pad"),
    (["--mask-token", "<|endoftext|>"], "EOS"), (["--mask-token", "<|pad|>"], "pad"),
])
def test_a_mask_token_that_is_eos_or_padding_is_refused(qwen3_dir, tmp_path, capsys, option, role):
    """Issue 32: before, the conversion wrote a model that could never generate (every [MASK] reads as an EOS; the
    padding of finished rows as positions still to decode)."""
    assert main(["from-hf", str(qwen3_dir), str(tmp_path / "out"), *option]) == 2
    given = f"--mask-token-id {option[1]}" if option[0] == "--mask-token-id" else f"--mask-token {option[1]!r} (id "
    field = "eos_token_id is 0" if role == "EOS" else "pad_token_id is 1"
    err = capsys.readouterr().err
    assert given in err
    assert f"is the {role} token id of {qwen3_dir} (its tokenizer's {field}): the converted model could never" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen3"]


@pytest.mark.parametrize("token,role", [("<s>", "BOS"), ("<unk>", "unknown"), ("<|im_start|>", "special")])
def test_a_mask_token_with_any_other_special_role_is_refused(tmp_path, capsys, token, role):
    """Issue 40 item 2: a [MASK] id equal to BOS was accepted (rc 0); so were the unknown token and a chat
    template's role markers. Each is refused by name, for --mask-token-id and --mask-token alike."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"bos_token": "<s>", "unk_token": "<unk>", "additional_special_tokens": ["<|im_start|>"]})
    src = tmp_path / "src"
    AutoModelForCausalLM.from_config(tiny_hf_config("qwen3", vocab_size=len(tok))).save_pretrained(src)
    tok.save_pretrained(src)
    token_id = tok.convert_tokens_to_ids(token)
    for option in (["--mask-token-id", str(token_id)], ["--mask-token", token]):
        assert main(["from-hf", str(src), str(tmp_path / "out"), *option]) == 2
        err = capsys.readouterr().err
        assert (f"is the {role} token id of {src}" in err) if role != "special" else \
            (f"is {token!r}, a special token of {src}'s tokenizer" in err), err
        assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="bos_token_id 3 is also the mask token id"):
        R2LMConfig(vocab_size=10, bos_token_id=3, mask_token_id=3)


def test_round_trip_is_bit_exact(qwen3_dir, tmp_path):
    convert_from_hf(qwen3_dir, tmp_path / "a", sidecar_layers=[0, 2], sidecar_headdim=16, sidecar_d_state=8)
    a = R2LMForDiffusionLM.from_pretrained(tmp_path / "a")
    with torch.no_grad():  # sidecar weights that differ from any initialisation
        for layer in (0, 2):
            a.model.layers[layer].sidecar.gate.fill_(0.7)
            a.model.layers[layer].sidecar.mixer.A_log.add_(0.5)
    a.save_pretrained(tmp_path / "b")
    b = R2LMForDiffusionLM.from_pretrained(tmp_path / "b")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    assert b.config.to_diff_dict() | {"_name_or_path": ""} == a.config.to_diff_dict() | {"_name_or_path": ""}
    ids = torch.randint(0, 90, (1, 12))
    with torch.no_grad():
        assert torch.equal(a.eval()(ids).logits, b.eval()(ids).logits)


def test_existing_dst_needs_overwrite(qwen3_dir, tmp_path):
    dst = tmp_path / "out"
    convert_from_hf(qwen3_dir, dst)
    with pytest.raises(ValueError, match="already exists; pass --overwrite"):
        convert_from_hf(qwen3_dir, dst, sidecar_layers=[1], sidecar_headdim=16)
    assert R2LMForDiffusionLM.from_pretrained(dst).config.sidecar_layers == []
    convert_from_hf(qwen3_dir, dst, sidecar_layers=[1], sidecar_headdim=16, overwrite=True)  # an earlier output
    assert R2LMForDiffusionLM.from_pretrained(dst).config.sidecar_layers == [1]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left


def test_unsupported_architecture(tmp_path):
    src = tmp_path / "gpt2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported source architecture 'gpt2'"):
        convert_from_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_mismatched_checkpoint_leaves_no_dst(qwen3_dir, tmp_path):
    state = load_file(qwen3_dir / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, qwen3_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight has shape \(3, 3\)"):
        convert_from_hf(qwen3_dir, tmp_path / "out")
    assert list(tmp_path.iterdir()) == [qwen3_dir]


def test_corrupt_checkpoint(qwen3_dir, tmp_path):
    (qwen3_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read"):
        convert_from_hf(qwen3_dir, tmp_path / "out")


def test_bad_sidecar_layer_is_reported_by_the_cli(qwen3_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "convert", "from-hf", str(qwen3_dir), str(tmp_path / "out"), "--sidecar-layers", "1,9"],
        capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert "sidecar_layers [9] out of range for a model with 3 layers" in result.stderr
    assert not (tmp_path / "out").exists()


def test_help_lists_the_options():
    result = subprocess.run([sys.executable, "-m", "convert", "from-hf", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for option in ("--sidecar-layers", "--mask-token", "--d-state", "--overwrite"):
        assert option in result.stdout


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_to_hf_round_trip(arch, tmp_path):
    """from-hf then to-hf gives back a transformers model with the same logits (an R2LM without extra layers is
    its backbone); the mask row added by from-hf stays in the vocabulary."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_hf_config(arch)).eval()
    hf.save_pretrained(tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "r2lm")
    assert main(["to-hf", str(tmp_path / "r2lm"), str(tmp_path / "back")]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back.config.model_type == arch
    ids = torch.randint(0, 96, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits[..., :96], hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_to_hf_refuses_extra_layers(tmp_path, capsys):
    """Sidecars without --drop-sidecars, block-hybrid layers and block-causal attention are refused, naming why
    (issue 38: before, a checkpoint with sidecars could not be served at all)."""
    cases = [(dict(sidecar_layers=[1]), [], "has sidecars on layers [1], which transformers has no layer for; "
                                             "--drop-sidecars"),
             (dict(sidecar_layers=[], hybrid_layers=[1], hybrid_feature_dim=8), ["--drop-sidecars"],
              "has block-hybrid layers [1]"),
             (dict(sidecar_layers=[1], attention="block_causal"), ["--drop-sidecars"], "has 'block_causal' attention")]
    for i, (fields, flags, message) in enumerate(cases):
        tiny_r2lm(**fields).save_pretrained(tmp_path / f"r2lm{i}")
        assert main(["to-hf", str(tmp_path / f"r2lm{i}"), str(tmp_path / f"out{i}"), *flags]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / f"out{i}").exists()


def test_to_hf_drop_sidecars_exports_the_verified_forward(tmp_path):
    """A causal R2LM with open (trained) sidecars, exported with --drop-sidecars: transformers' greedy generate of the
    export is the R2LM's verify=True output and its AR decoding, token for token; its logits are the R2LM's clean
    forward's (which sidecars never touch)."""
    from transformers import AutoModelForCausalLM

    from r2lm import generate

    sharp_hf("qwen3").save_pretrained(tmp_path / "hf")  # clear argmaxes: two implementations agree to rounding only
    convert_from_hf(tmp_path / "hf", tmp_path / "r2lm", sidecar_layers=[0, 2], sidecar_headdim=16, sidecar_d_state=8)
    model = R2LMForDiffusionLM.from_pretrained(tmp_path / "r2lm").eval()
    with torch.no_grad():  # sidecars that matter, as trained ones do
        for layer in model.model.layers:
            if layer.sidecar is not None:
                layer.sidecar.gate.fill_(0.7)
    model.save_pretrained(tmp_path / "trained")
    assert main(["to-hf", str(tmp_path / "trained"), str(tmp_path / "stock"), "--drop-sidecars"]) == 0
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "stock").eval()
    assert stock.config.model_type == "qwen3"
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(stock(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
        greedy = stock.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    verified = generate(model, ids, max_new_tokens=12, verify=True, block_size=4, verify_draft="lookup", eos_token_id=[])
    assert torch.equal(verified.sequences, greedy)


def test_without_sidecars_shares_the_backbone_weights():
    """The backbone alone reads `model`'s own weights (no second copy: a benchmark's AR decoding reads the bytes
    verified decoding reads), while `model` keeps its sidecars; its block-size-1 decoding is the AR text."""
    from r2lm import generate
    from r2lm.convert.to_hf import without_sidecars

    model = tiny_r2lm(sidecar_layers=[1], tie_word_embeddings=True).eval()
    plain = without_sidecars(model)
    assert plain.config.sidecar_layers == [] and plain.model.layers[1].sidecar is None
    assert model.config.sidecar_layers == [1] and model.model.layers[1].sidecar is not None
    weights = dict(model.named_parameters())
    assert all(p is weights[name] for name, p in plain.named_parameters())
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    ar = generate(plain, ids, max_new_tokens=6, block_size=1, eos_token_id=[])
    verified = generate(model, ids, max_new_tokens=6, verify=True, block_size=3, verify_draft="lookup", eos_token_id=[])
    assert torch.equal(ar.sequences, verified.sequences)


# ---------------------------------------------------------------- issue 32: GGUF files, tokenizers, generation configs


@pytest.mark.parametrize("damage", ["truncated", "header only", "not gguf", "empty"])
def test_a_damaged_gguf_file_is_named(tmp_path, capsys, damage):
    """Before: numpy's "cannot reshape array of size ...", a struct error or "cannot mmap an empty file"."""
    path = gguf_file(tmp_path / "src" / "model.gguf")
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) * 3 // 5], "header only": data[:100], "empty": b"",
                      "not gguf": bytes(range(256)) * 40}[damage])
    assert main(["from-hf", str(tmp_path / "src"), str(tmp_path / "out"), "--gguf-file", "model.gguf"]) == 2
    assert f"error: {path} is not a readable GGUF file (truncated or corrupt): " in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_gguf_file_outside_src_is_refused(tmp_path, capsys):
    outside = gguf_file(tmp_path / "elsewhere" / "model.gguf")
    (tmp_path / "src").mkdir()
    assert main(["from-hf", str(tmp_path / "src"), str(tmp_path / "out"), "--gguf-file", str(outside)]) == 2
    assert (f"--gguf-file {outside} lies outside SRC {tmp_path / 'src'}; give the folder that holds it as SRC and its "
            f"name as --gguf-file (here: SRC {outside.parent}, --gguf-file model.gguf)") in capsys.readouterr().err
    assert main(["from-hf", str(tmp_path / "none"), str(tmp_path / "out"), "--gguf-file", "model.gguf"]) == 2
    assert f"SRC {tmp_path / 'none'} is not a folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "src"]


@pytest.mark.parametrize("left", [["tokenizer_config.json"], ["special_tokens_map.json", "tokenizer_config.json"]])
def test_tokenizer_files_without_a_vocabulary_are_named(qwen3_dir, tmp_path, capsys, left):
    """Before: transformers' "You need to have sentencepiece or tiktoken installed to convert a slow tokenizer"."""
    (qwen3_dir / "tokenizer.json").unlink()  # the vocabulary; tokenizer_config.json stays
    if "special_tokens_map.json" in left:
        (qwen3_dir / "special_tokens_map.json").write_text('{"eos_token": "<|endoftext|>"}')
    assert sorted(p.name for p in qwen3_dir.iterdir() if p.name.startswith(("tokenizer", "special"))) == left
    message = (f"{qwen3_dir} has no tokenizer vocabulary (tokenizer.json / tokenizer.model / vocab.json / vocab.txt): "
               f"it has only {', '.join(left)}, which describe one")
    assert main(["from-hf", str(qwen3_dir), str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=re.escape(message)):
        load_tokenizer(qwen3_dir)  # what r2lm-generate loads a checkpoint's tokenizer with


@pytest.mark.parametrize("text", ['{"block_size": 8, "thresh', "[0.9]", ""])
def test_a_corrupt_generation_config_is_refused(qwen3_dir, tmp_path, capsys, text):
    """Before: transformers logged it at info level and decoding used its built-in defaults."""
    assert main(["from-hf", str(qwen3_dir), str(tmp_path / "r2lm")]) == 0
    for folder in (qwen3_dir, tmp_path / "r2lm"):
        (folder / "generation_config.json").write_text(text)
    what = "must hold a JSON object of generation options" if text.startswith("[") else "is not valid JSON ("
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'r2lm' / 'generation_config.json'} {what}")):
        R2LMForDiffusionLM.from_pretrained(tmp_path / "r2lm")
    for command in (["from-hf", str(qwen3_dir)], ["to-hybrid", str(tmp_path / "r2lm"), "--layers", "0"]):
        assert main([*command, str(tmp_path / "out")]) == 2
        assert f"generation_config.json {what}" in capsys.readouterr().err
        assert not (tmp_path / "out").exists()
