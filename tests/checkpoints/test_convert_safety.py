"""Every converter, used carelessly: sources stay untouched, --overwrite deletes only what a conversion wrote,
SIGTERM / SIGKILL leave nothing behind for long, bad destinations and bad weights are reported before any work,
outputs are reproducible (--seed) and get the umask's permissions."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from r2lm import R2LMConfig, R2LMForDiffusionLM
from r2lm.checkpoints import (
    LEGACY_MANIFEST,
    MANIFEST,
    DamagedCheckpointError,
    read_manifest,
    seal,
    verify_checkpoint,
    writing,
)
from r2lm.checkpoints.export import parameter_bytes
from r2lm.convert.__main__ import main
from r2lm.convert.from_hf import convert_from_hf
from tests.helpers import REPO
from tests.helpers.checkpoints import (
    damage_weights,
    dream_checkpoint,
    llada2_checkpoint,
    llada_checkpoint,
    make_adapter,
)
from tests.helpers.models import make_model_dir, tiny_hf_config, tiny_tokenizer
from tests.helpers.training import run_inprocess, run_overrides, training_inputs

SIDECAR = ["--sidecar-layers", "1", "--headdim", "16", "--d-state", "8"]


@dataclass
class Conversion:
    """One converter on tiny sources: `python -m convert COMMAND SOURCES... DST OPTIONS...`."""

    command: str
    sources: list[Path]  # SRC, and ADAPTER for merge-lora
    options: tuple[str, ...] = ()

    def argv(self, dst, *extra: str) -> list[str]:
        return [self.command, *map(str, self.sources), str(dst), *self.options, *extra]

    def copied_to(self, folder: Path) -> Conversion:
        """The same conversion on copies of the sources in `folder` (for tests that may destroy them)."""
        folder.mkdir(parents=True, exist_ok=True)
        return Conversion(self.command, [Path(shutil.copytree(s, folder / s.name)) for s in self.sources], self.options)

    def overlapping_destinations(self) -> list[Path]:
        """DSTs that are, contain or lie inside a source (for deepspeed-to-hf: the checkpoint read, RUN/checkpoints/
        step-N; RUN itself contains it, while RUN/final is a legitimate DST)."""
        sources = [checkpoint_of(self.sources[0])] if self.command == "deepspeed-to-hf" else self.sources
        found = []
        for src in sources:
            found += [src, src / "out", src.parent]
            if self.command == "deepspeed-to-hf":
                found += [src.parent.parent, src.parent.parent.parent]  # the run folder, the folder holding it
        return found


def checkpoint_of(run: Path) -> Path:
    return run / "checkpoints" / "step-00000001"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("sources")


@pytest.fixture(scope="module")
def qwen3_src(root):
    tok = tiny_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_hf_config("qwen3", vocab_size=len(tok)))
    model.save_pretrained(root / "qwen3")
    tok.save_pretrained(root / "qwen3")
    return root / "qwen3"


@pytest.fixture(scope="module")
def r2lm_src(root):
    """An R2LM with sidecars and a tokenizer (to-hybrid, merge-lora)."""
    return make_model_dir(root / "r2lm")


@pytest.fixture(scope="module")
def backbone_src(root):
    """An R2LM without extra layers (to-hf)."""
    return make_model_dir(root / "backbone", sidecar_layers=[])


@pytest.fixture(scope="module")
def adapter_src(r2lm_src, root):
    return make_adapter(r2lm_src, root / "lora")


@pytest.fixture(scope="module")
def run_src(root):
    """A real one-step training run (DeepSpeed ZeRO-2, in process): config.yaml, train.log, metrics.jsonl,
    checkpoints/{latest, zero_to_fp32.py, step-00000001/{shards, trainer_state.json, config.json, tokenizer}}."""
    inputs = training_inputs(root / "training")
    run = root / "run"
    run_inprocess(run_overrides(inputs, run, "steps=1", "save_every=1", "eval_every=0", "export=false"))
    for handler in [h for h in logging.getLogger().handlers if getattr(h, "_r2lm_file", None)]:
        logging.getLogger().removeHandler(handler)  # the run is over: its train.log must not log our conversions
        handler.close()
    assert (checkpoint_of(run) / "trainer_state.json").is_file()
    return run


@pytest.fixture(scope="module")
def llada_src(root):
    return llada_checkpoint(root / "llada")[0]


@pytest.fixture(scope="module")
def dream_src(root):
    return dream_checkpoint(root / "dream")[0]


@pytest.fixture(scope="module")
def llada2_src(root):
    return llada2_checkpoint(root / "llada2", mask_token_id=98)[0]


COMMANDS = ["from-hf", "to-hf", "to-hybrid", "merge-lora", "deepspeed-to-hf", "from-llada", "from-dream", "from-llada2"]


def conversion(command: str, request) -> Conversion:
    source = request.getfixturevalue
    if command == "from-hf":
        return Conversion(command, [source("qwen3_src")], tuple(SIDECAR))
    if command == "to-hf":
        return Conversion(command, [source("backbone_src")])
    if command == "to-hybrid":
        return Conversion(command, [source("r2lm_src")], ("--layers", "0"))
    if command == "merge-lora":
        return Conversion(command, [source("r2lm_src"), source("adapter_src")])
    if command == "deepspeed-to-hf":
        return Conversion(command, [source("run_src")])
    if command == "from-llada":
        return Conversion(command, [source("llada_src")])
    if command == "from-dream":
        return Conversion(command, [source("dream_src")])
    if command == "from-llada2":
        return Conversion(command, [source("llada2_src")], tuple(SIDECAR))
    raise ValueError(command)


def snapshot(folder: Path) -> dict:
    """Everything a modification would change: each entry's kind, bytes and mtime, and each folder's mtime (which
    moves when an entry is created or removed, even if it is removed again)."""
    entries = {".": ("dir", folder.stat().st_mtime_ns)}
    for path in sorted(folder.rglob("*")):
        stat = path.lstat()
        kind = "dir" if path.is_dir() else "file"
        entries[str(path.relative_to(folder))] = (kind, stat.st_mtime_ns, path.read_bytes() if kind == "file" else None)
    return entries


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------------------------- sources


@pytest.mark.parametrize("command", COMMANDS)
def test_sources_are_never_modified(command, request, tmp_path):
    conv = conversion(command, request)
    before = {s: snapshot(s) for s in conv.sources}
    assert main(conv.argv(tmp_path / "out")) == 0
    assert main(conv.argv(tmp_path / "out", "--overwrite")) == 0  # replacing an earlier output, too
    for src in conv.sources:
        assert snapshot(src) == before[src], src
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporaries left


@pytest.mark.parametrize("command", COMMANDS)
def test_the_same_conversion_gives_the_same_bits(command, request, tmp_path):
    conv = conversion(command, request)
    assert main(conv.argv(tmp_path / "a")) == 0
    assert main(conv.argv(tmp_path / "b")) == 0
    assert folder_bytes(tmp_path / "a") == folder_bytes(tmp_path / "b")


@pytest.mark.parametrize(("command", "new"), [
    ("from-hf", ".sidecar."), ("to-hybrid", ".linear_attention."), ("from-llada2", ".sidecar."),
])
def test_new_weights_come_from_the_seed(command, new, request, tmp_path):
    conv = conversion(command, request)
    rng = torch.random.get_rng_state()
    assert main(conv.argv(tmp_path / "default")) == 0
    assert torch.equal(torch.random.get_rng_state(), rng)  # the caller's random state is left alone
    assert main(conv.argv(tmp_path / "seed0", "--seed", "0")) == 0
    assert main(conv.argv(tmp_path / "seed1", "--seed", "1")) == 0
    assert folder_bytes(tmp_path / "default") == folder_bytes(tmp_path / "seed0")
    a, b = load_file(tmp_path / "seed0" / "model.safetensors"), load_file(tmp_path / "seed1" / "model.safetensors")
    differ = sorted(k for k in a if not torch.equal(a[k], b[k]))
    assert differ and all(new in k for k in differ), differ  # only the new weights depend on the seed


# ----------------------------------------------------------------------------------------------- DST


@pytest.mark.parametrize("command", COMMANDS)
def test_dst_overlapping_a_source_is_refused(command, request, tmp_path, capsys):
    conv = conversion(command, request).copied_to(tmp_path / "in")
    before = snapshot(tmp_path)
    for dst in conv.overlapping_destinations():
        assert main(conv.argv(dst, "--overwrite")) == 2, dst
        err = capsys.readouterr().err
        assert f"DST {dst} " in err and "the sources are never modified" in err, err
    assert snapshot(tmp_path) == before


def test_training_run_and_checkpoint_folders_are_never_replaced(run_src, qwen3_src, tmp_path, capsys):
    run = Path(shutil.copytree(run_src, tmp_path / "run"))
    before = snapshot(run)
    for dst in (run, run / "checkpoints", checkpoint_of(run)):
        assert main(["from-hf", str(qwen3_src), str(dst), "--overwrite"]) == 2
        assert "is a training run or checkpoint folder" in capsys.readouterr().err
    assert snapshot(run) == before
    # RUN/final is what train/pretrain.py exports to: a legitimate DST inside the run folder
    assert main(["deepspeed-to-hf", str(run), str(run / "final")]) == 0
    assert main(["deepspeed-to-hf", str(run), str(run / "final"), "--overwrite"]) == 0


def test_overwrite_replaces_only_what_a_conversion_wrote(qwen3_src, tmp_path, capsys):
    convert = ["from-hf", str(qwen3_src)]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main([*convert, str(mine), "--overwrite"]) == 2
    assert f"has no {MANIFEST} (nor an older {LEGACY_MANIFEST}): it was not written by r2lm" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    out = tmp_path / "out"
    assert main([*convert, str(out)]) == 0
    listed = read_manifest(out)
    assert sorted(listed) == sorted(p.name for p in out.iterdir() if p.name != MANIFEST)
    assert "model.safetensors" in listed and "tokenizer.json" in listed
    (out / "notes.txt").write_text("added later")
    assert main([*convert, str(out), "--overwrite"]) == 2
    assert "holds files r2lm did not write (notes.txt)" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "added later"
    (out / "notes.txt").unlink()
    assert main([*convert, str(out), *SIDECAR, "--overwrite"]) == 0  # an earlier output alone is replaced
    assert R2LMConfig.from_pretrained(out).sidecar_layers == [1]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*convert, str(empty), "--overwrite"]) == 0 and (empty / "model.safetensors").is_file()
    assert hidden(tmp_path) == []


def as_written_before_checksums(folder: Path) -> None:
    """`folder`, a conversion's output, as conversions wrote it before checksums.sha256: its files listed by name in
    r2lm_manifest.json."""
    names = sorted(read_manifest(folder))
    (folder / MANIFEST).unlink()
    (folder / LEGACY_MANIFEST).write_text(json.dumps({"files": names}))


def test_an_older_conversions_output_can_still_be_overwritten(qwen3_src, tmp_path, capsys):
    convert = ["from-hf", str(qwen3_src)]
    out = tmp_path / "out"
    assert main([*convert, str(out)]) == 0
    as_written_before_checksums(out)
    (out / "notes.txt").write_text("added later")
    assert main([*convert, str(out), "--overwrite"]) == 2
    assert "holds files r2lm did not write (notes.txt)" in capsys.readouterr().err
    (out / "notes.txt").unlink()
    assert main([*convert, str(out), *SIDECAR, "--overwrite"]) == 0
    assert (out / MANIFEST).is_file() and not (out / LEGACY_MANIFEST).exists()  # rewritten in the one format
    assert R2LMConfig.from_pretrained(out).sidecar_layers == [1]


def test_overwrite_keeps_what_a_user_changed_in_an_output(qwen3_src, tmp_path, capsys):
    """An earlier output is replaceable only while every file is as its manifest recorded (sha256) and it holds
    nothing else, not even an empty folder."""
    convert = ["from-hf", str(qwen3_src)]
    out = tmp_path / "out"
    assert main([*convert, str(out)]) == 0
    written = (out / "config.json").read_bytes()
    (out / "config.json").write_bytes(written.replace(b"{", b'{"_note": "hand edited",', 1))
    assert main([*convert, str(out), "--overwrite"]) == 2
    assert "its config.json changed since r2lm wrote it (the sha256 differs from" in capsys.readouterr().err
    assert b"hand edited" in (out / "config.json").read_bytes()
    (out / "config.json").write_bytes(written)  # the edit undone: replaceable again

    (out / "evals").mkdir()
    assert main([*convert, str(out), "--overwrite"]) == 2
    assert "holds files r2lm did not write (evals/)" in capsys.readouterr().err and (out / "evals").is_dir()
    (out / "evals").rmdir()
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").mkdir()  # a listed file replaced by a folder of the same name
    assert main([*convert, str(out), "--overwrite"]) == 2
    assert "holds files r2lm did not write (tokenizer.json/)" in capsys.readouterr().err
    (out / "tokenizer.json").rmdir()

    assert main([*convert, str(out), *SIDECAR, "--overwrite"]) == 0
    assert R2LMConfig.from_pretrained(out).sidecar_layers == [1]
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("case", ["user folder", "another output", "edited while converting", "output replaced"])
def test_dst_is_checked_again_just_before_the_rename(qwen3_src, tmp_path, capsys, monkeypatch, case):
    """DST may appear or change while a conversion writes (a user's folder, another conversion's output): the
    rules of the start apply again at the end, and a DST that no longer passes them is kept as it is."""
    convert = ["from-hf", str(qwen3_src)]
    dst, other = tmp_path / "out", tmp_path / "other"
    assert main([*convert, str(other)]) == 0  # another conversion's output
    overwrite = ["--overwrite"] if case in ("edited while converting", "output replaced") else []
    if overwrite:
        assert main([*convert, str(dst)]) == 0  # an earlier output: replaceable when the conversion starts
    seal = writing.seal

    def meanwhile(folder):
        seal(folder)
        if case == "user folder":
            dst.mkdir()
            (dst / "results.txt").write_text("the user's")
        elif case == "another output":
            shutil.copytree(other, dst)
        elif case == "edited while converting":
            with open(dst / "config.json", "a") as f:
                f.write(" ")
        else:
            shutil.rmtree(dst)
            shutil.copytree(other, dst)

    monkeypatch.setattr(writing, "seal", meanwhile)
    before = folder_bytes(other) if case == "output replaced" else None
    code = main([*convert, str(dst), *SIDECAR, *overwrite])
    err = capsys.readouterr().err
    assert hidden(tmp_path) == []  # no temporary or replaced folder left
    if case == "output replaced":  # still an output r2lm wrote, and --overwrite was given: replaced
        assert code == 0 and R2LMConfig.from_pretrained(dst).sidecar_layers == [1] and folder_bytes(dst) != before
        return
    assert code == 2 and "DST changed while this conversion ran, and its output was not kept: " in err, err
    if case == "user folder":
        assert "has no checksums.sha256" in err and [p.name for p in dst.iterdir()] == ["results.txt"]
    elif case == "another output":
        assert f"{dst} already exists; pass --overwrite" in err and folder_bytes(dst) == folder_bytes(other)
    else:
        assert "its config.json changed since r2lm wrote it" in err
        assert (dst / "config.json").read_text().endswith(" ") and R2LMConfig.from_pretrained(dst).sidecar_layers == []


@pytest.mark.parametrize("command", COMMANDS)
def test_every_output_lists_its_files_with_their_checksums(command, request, tmp_path):
    """One manifest for every folder r2lm writes: sha256sum format, every file, checked by verify_checkpoint."""
    out = tmp_path / "out"
    assert main(conversion(command, request).argv(out)) == 0
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert sorted(read_manifest(out)) == written
    check = subprocess.run(["sha256sum", "--check", "--quiet", MANIFEST], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert verify_checkpoint(out) is True
    with open(out / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(DamagedCheckpointError, match=r"out: config.json is damaged"):
        verify_checkpoint(out)


def test_a_file_as_dst_is_kept_and_leaves_no_old_copy(qwen3_src, tmp_path, capsys):
    dst = tmp_path / "model.bin"
    dst.write_bytes(b"not a folder")
    assert main(["from-hf", str(qwen3_src), str(dst), "--overwrite"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert dst.read_bytes() == b"not a folder" and sorted(p.name for p in tmp_path.iterdir()) == ["model.bin"]


@contextlib.contextmanager
def read_only(folder: Path):
    """`folder` made unwritable: mode 0555, and immutable too when running as root (root ignores the mode)."""
    folder.chmod(0o555)
    immutable = os.geteuid() == 0
    if immutable and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        folder.chmod(0o755)
        pytest.skip("running as root on a filesystem without chattr +i: cannot make a folder read-only")
    try:
        yield folder
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


def corrupt_copy(src: Path, folder: Path) -> Path:
    """A copy of `src` whose weights cannot be read: a conversion that reaches them fails with 'cannot read'."""
    copy = Path(shutil.copytree(src, folder))
    (copy / "model.safetensors").write_bytes(b"not safetensors")
    return copy


def test_read_only_destination_is_reported_before_any_work(qwen3_src, tmp_path):
    src = corrupt_copy(qwen3_src, tmp_path / "src")
    (tmp_path / "ro").mkdir()
    with read_only(tmp_path / "ro") as ro:
        for dst in (ro / "out", ro / "new" / "out"):
            with pytest.raises(ValueError, match=re.escape(f"cannot write DST {dst}: {ro} is not writable")):
                convert_from_hf(src, dst)
        assert list(ro.iterdir()) == []


def test_full_destination_is_reported_before_any_work(qwen3_src, tmp_path):
    src = corrupt_copy(qwen3_src, tmp_path / "src")
    free = shutil.disk_usage(tmp_path).free
    with open(src / "model.safetensors", "r+b") as f:  # sparse: as large as the free space plus 1 GB, using none
        f.truncate(free + 10**9)
    with pytest.raises(ValueError, match=re.escape(f"not enough space for DST {tmp_path / 'out'}: {tmp_path} has ")):
        convert_from_hf(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def flip_bytes(path: Path) -> None:
    """Silent corruption: four bytes inside the tensor data of a torch file (not its zip directory) changed."""
    data = bytearray(path.read_bytes())
    at = len(data) * 3 // 5
    data[at : at + 4] = bytes(b ^ 0x5A for b in data[at : at + 4])
    path.write_bytes(bytes(data))


def test_deepspeed_export_refuses_a_damaged_checkpoint(run_src, tmp_path, capsys):
    """Issue 14 item 6: deepspeed-to-hf verifies the checkpoint's manifest before it exports, as resume does."""
    run = Path(shutil.copytree(run_src, tmp_path / "run"))
    shard = "zero_pp_rank_0_mp_rank_00_optim_states.pt"  # the fp32 master weights the export reassembles
    flip_bytes(checkpoint_of(run) / shard)
    out = tmp_path / "out"
    assert main(["deepspeed-to-hf", str(run), str(out)]) == 2
    assert f"checkpoint {checkpoint_of(run)}: {shard} is damaged" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written, no temporary left


def test_deepspeed_export_of_a_checkpoint_without_manifest_warns(run_src, tmp_path, caplog):
    run = Path(shutil.copytree(run_src, tmp_path / "run"))
    (checkpoint_of(run) / MANIFEST).unlink()  # as written by an older r2lm
    with caplog.at_level(logging.WARNING):
        assert main(["deepspeed-to-hf", str(run), str(tmp_path / "out")]) == 0
    assert any(f"{checkpoint_of(run)} has no {MANIFEST}" in r.getMessage() and "cannot be verified" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")
    assert verify_checkpoint(tmp_path / "out") is True


def test_deepspeed_export_size_is_known_before_reassembly(run_src, tmp_path):
    """deepspeed-to-hf checks the free space against the parameter count (ZeRO shards hold optimizer state too)."""
    assert main(["deepspeed-to-hf", str(run_src), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    config = R2LMConfig.from_pretrained(checkpoint_of(run_src))
    tensors = sum(t.numel() * t.element_size() for t in load_file(tmp_path / "out" / "model.safetensors").values())
    assert parameter_bytes(config, torch.bfloat16) == tensors  # a tied head is stored (and counted) once


# ----------------------------------------------------------------------------------------------- weights, options


def poison(path: Path, names: list[str]) -> list[str]:
    state = load_file(path)
    for name, value in zip(names, (float("nan"), float("inf")), strict=False):
        state[name].view(-1)[0] = value
    save_file(state, path, metadata={"format": "pt"})
    return names


@pytest.mark.parametrize("command", ["from-hf", "to-hf", "to-hybrid", "merge-lora", "from-dream"])
def test_nan_and_inf_weights_are_named(command, request, tmp_path, capsys):
    conv = conversion(command, request).copied_to(tmp_path / "in")
    src = conv.sources[0]
    names = sorted(k for k in load_file(src / "model.safetensors") if k.endswith("up_proj.weight"))[:2]
    poison(src / "model.safetensors", names)
    assert main(conv.argv(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert f"{src} has NaN or inf weights in 2 tensor(s): " in err and all(name in err for name in names), err
    assert not (tmp_path / "out").exists() and hidden(tmp_path) == []


@pytest.mark.parametrize("damage", ["truncated", "missing"])
@pytest.mark.parametrize("command", ["from-hf", "to-hf", "to-hybrid", "merge-lora"])
def test_unreadable_weights_are_named(command, damage, request, tmp_path, capsys):
    """Every converter reads its source's weights through one reader: a clear error, not a SafetensorError or
    OSError traceback, and nothing written."""
    conv = conversion(command, request).copied_to(tmp_path / "in")
    message = damage_weights(conv.sources[0], damage)
    assert main(conv.argv(tmp_path / "out")) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and hidden(tmp_path) == []


def test_nan_in_a_lora_adapter_is_named(request, tmp_path, capsys):
    conv = conversion("merge-lora", request).copied_to(tmp_path / "in")
    adapter = conv.sources[1]
    name = sorted(load_file(adapter / "adapter_model.safetensors"))[0]
    poison(adapter / "adapter_model.safetensors", [name])
    assert main(conv.argv(tmp_path / "out")) == 2
    assert f"{adapter} has NaN or inf weights in 1 tensor(s): {name}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mask_id", ["5000", "-1"])
def test_mask_token_id_outside_the_vocabulary_is_refused(qwen3_src, tmp_path, capsys, mask_id):
    vocab = AutoConfig.from_pretrained(qwen3_src).vocab_size
    assert main(["from-hf", str(qwen3_src), str(tmp_path / "out"), "--mask-token-id", mask_id]) == 2
    assert f"--mask-token-id {mask_id} is outside the vocabulary of {qwen3_src} (ids 0..{vocab - 1})" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o007])
@pytest.mark.parametrize("command", ["from-hf", "to-hybrid"])
def test_outputs_get_the_umask_permissions(command, umask, request, tmp_path):
    conv = conversion(command, request)
    previous = os.umask(umask)
    try:
        assert main(conv.argv(tmp_path / "out")) == 0
    finally:
        os.umask(previous)
    out = tmp_path / "out"
    modes = {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777 for p in [out, *out.rglob("*")]}
    want = {name: (0o777 if (tmp_path / name).is_dir() else 0o666) & ~umask for name in modes}
    assert modes == want
    assert "out/model.safetensors" in modes and "out/tokenizer.json" in modes


# ----------------------------------------------------------------------------------------------- signals

# The real CLI in a subprocess, held (by an audit hook, without touching convert/) just before it renames its
# complete temporary folder into place: the moment with the most on disk, and deterministic.
PAUSED_CLI = """
import os, sys, time

def pause_before_committing(event, args):
    if event == "os.rename" and ".tmp-" in os.path.basename(args[0]):
        print("paused", flush=True)
        time.sleep(300)

sys.addaudithook(pause_before_committing)
from r2lm.convert.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def paused_conversions():
    """start(*argvs): one CLI process per argv (started together: each takes seconds to import torch), returned
    once all are paused; any still running at the end of the test is killed."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # an in-process training run of this pytest process set them for itself
    started = []

    def start(*argvs: list[str]) -> list[subprocess.Popen]:
        procs = [subprocess.Popen([sys.executable, "-c", PAUSED_CLI, *argv], cwd=REPO, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
                 for argv in argvs]
        started.extend(procs)
        for proc in procs:
            line = proc.stdout.readline()
            if line.strip() != "paused":
                proc.kill()
                pytest.fail(f"a conversion did not get to its rename: {line!r} {proc.communicate()[1][-3000:]}")
        return procs

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def temporaries(folder: Path, name: str) -> list[Path]:
    return sorted(folder.glob(f".{name}.tmp-*")) + sorted(folder.glob(f".{name}.old-*"))


@pytest.mark.slow  # CLI processes, seconds each to start
def test_sigterm_removes_the_unfinished_output(qwen3_src, tmp_path, paused_conversions):
    convert = ["from-hf", str(qwen3_src)]
    assert main([*convert, str(tmp_path / "earlier")]) == 0
    earlier = folder_bytes(tmp_path / "earlier")
    fresh, replacing = paused_conversions([*convert, str(tmp_path / "fresh")],
                                          [*convert, str(tmp_path / "earlier"), *SIDECAR, "--overwrite"])
    [tmp] = temporaries(tmp_path, "fresh")
    assert (tmp / "model.safetensors").is_file()  # stopped with its output written
    assert not (tmp_path / "earlier").exists()  # ... and, replacing, between its two renames
    for proc in (fresh, replacing):
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGTERM, err  # ended as a SIGTERM-killed process, for the scheduler
        assert "terminated by SIGTERM" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier"]
    assert folder_bytes(tmp_path / "earlier") == earlier


@pytest.mark.slow
def test_the_next_run_removes_what_killed_writers_left(qwen3_src, tmp_path, paused_conversions):
    convert = ["from-hf", str(qwen3_src)]
    assert main([*convert, str(tmp_path / "earlier")]) == 0
    earlier = folder_bytes(tmp_path / "earlier")
    *killed, live = paused_conversions([*convert, str(tmp_path / "a")],
                                       [*convert, str(tmp_path / "earlier"), *SIDECAR, "--overwrite"],
                                       [*convert, str(tmp_path / "b")])
    for proc in killed:
        proc.kill()  # SIGKILL: no clean-up runs
        proc.wait(timeout=60)
    assert len(temporaries(tmp_path, "a")) == 1 and len(temporaries(tmp_path, "earlier")) == 2
    assert not (tmp_path / "earlier").exists()  # killed between its two renames: only the .old copy is left
    [live_tmp] = temporaries(tmp_path, "b")

    assert main([*convert, str(tmp_path / "c")]) == 0  # any later conversion into the same folder
    assert temporaries(tmp_path, "a") == [] and temporaries(tmp_path, "earlier") == []
    assert folder_bytes(tmp_path / "earlier") == earlier  # the replaced folder is put back
    assert temporaries(tmp_path, "b") == [live_tmp]  # a live writer's folder is left alone
    live.send_signal(signal.SIGTERM)
    live.communicate(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "earlier"]


# ------------------------------------------------------------------------- issue 32: loaders verify checksums.sha256


def flip_a_low_bit(path: Path) -> None:
    """Silent corruption of a safetensors file: the lowest bit of one float in the middle of its data flipped. The
    file stays valid and finite: only its checksum tells."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # the tensor data follows the 8-byte length and the JSON header
    data[start + (len(data) - start) // 8 * 4] ^= 0x01  # a float32's least significant byte (little-endian)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("command", "damaged"), [
    ("to-hf", "model.safetensors"), ("to-hybrid", "model.safetensors"), ("merge-lora", "model.safetensors"),
    ("merge-lora", "adapter_model.safetensors"), ("from-hf", "model.safetensors"),
])
def test_weights_that_fail_their_checksums_are_refused(command, damaged, request, tmp_path, capsys):
    """Before: the folders' checksums.sha256 existed but no loader read them; flipped tensor bytes loaded (merge-lora:
    merged) without a word."""
    conv = conversion(command, request).copied_to(tmp_path / "in")
    for src in conv.sources:
        seal(src)  # as r2lm writes its folders (conversions, training exports, adapters)
    path = next(src / damaged for src in conv.sources if (src / damaged).is_file())
    flip_a_low_bit(path)
    assert main(conv.argv(tmp_path / "out")) == 2
    assert (f"error: {path} is damaged: its sha256 differs from the one {path.parent / MANIFEST} lists"
            in capsys.readouterr().err)
    assert not (tmp_path / "out").exists() and hidden(tmp_path) == []


def test_from_pretrained_verifies_checksums(r2lm_src, tmp_path):
    folder = Path(shutil.copytree(r2lm_src, tmp_path / "m"))
    seal(folder)
    R2LMForDiffusionLM.from_pretrained(folder)  # intact: loads
    flip_a_low_bit(folder / "model.safetensors")
    with pytest.raises(ValueError, match=re.escape(f"{folder / 'model.safetensors'} is damaged: its sha256 differs")):
        R2LMForDiffusionLM.from_pretrained(folder)
    (folder / MANIFEST).unlink()  # a folder without a manifest (a download, another program) is not checked
    R2LMForDiffusionLM.from_pretrained(folder)
