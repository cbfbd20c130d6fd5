"""Reliability of the training program (issue 14): resume with changed settings or another model, divergence,
damaged checkpoints, one run per output_dir, training data errors, file permissions.

In-process single-rank runs (real DeepSpeed ZeRO engine); the lock across the ranks of one launch goes through the
real deepspeed launcher (slow), the quickstart's lock through the real script."""

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train.optimizer
import train.trainer
from r2lm.checkpoints import (
    MANIFEST,
    DamagedCheckpointError,
    complete_checkpoints,
    read_state,
    verify_checkpoint,
)
from tests.helpers import REPO
from tests.helpers.checkpoints import damage_weights
from tests.helpers.processes import DEEPSPEED, free_port, run_cli
from tests.helpers.training import run_inprocess, training_inputs
from tests.helpers.training import run_overrides as overrides
from train.guard import NonFiniteLossError
from train.lock import LOCK_FILE, RunLock
from train.tracking import read_metrics

TIMING = ("tokens_per_s", "step_time_s")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return training_inputs(tmp_path_factory.mktemp("reliability"))


def history(run_dir, kind="train"):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run_dir, kind)]


def listing(folder: Path) -> dict:
    """{relative path: bytes} of every file under `folder`: what a refused run must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stopped_run(inputs):
    """Steps 1-3 of a 6-step run (warmup 2, cosine after), checkpoint at step 3: the run the resume tests continue."""
    out = inputs[0] / "stopped"
    run_inprocess(overrides(inputs, out, "stop_at=3"))
    return out


def copy_run(run_dir: Path, dst: Path) -> Path:
    shutil.copytree(run_dir, dst)
    return dst


# ---------------------------------------------------------------------------------------------- 3, 4: resume settings


def test_resume_refuses_changed_settings_naming_each(stopped_run, inputs, tmp_path):
    out = copy_run(stopped_run, tmp_path / "run")
    before = listing(out)
    with pytest.raises(ValueError) as info:
        run_inprocess(overrides(inputs, out, "lr=1.0e-3", "seed=1", "micro_batch_size=2", "data.shuffle_buffer=5"))
    message = str(info.value)
    for change in ["lr: 0.003 in the checkpoint, 0.001 now", "seed: 0 in the checkpoint, 1 now",
                   "micro_batch_size: 4 in the checkpoint, 2 now", "data.shuffle_buffer: 10000 in the checkpoint, 5 now"]:
        assert change in message
    assert "step-00000003" in message and "new output_dir" in message
    assert listing(out) == before  # config.yaml, train.log, metrics and checkpoints as they were


def test_resume_refuses_a_longer_schedule_once_the_cosine_decay_began(stopped_run, inputs, tmp_path):
    out = copy_run(stopped_run, tmp_path / "run")
    with pytest.raises(ValueError, match=r"steps: 6 in the checkpoint, 8 now \(steps sets the cosine decay"):
        run_inprocess(overrides(inputs, out, "steps=8"))


def test_resume_may_change_what_does_not_change_the_math(inputs):
    """In warmup, `steps` may grow (the learning rates so far do not depend on it); logging, evaluation and checkpoint
    frequency may change anyway. The resumed run equals the uninterrupted one, and records what it applied."""
    root = inputs[0]
    reference, out = root / "longer-reference", root / "longer"
    run_inprocess(overrides(inputs, reference, "steps=8", "warmup_steps=4", "eval_every=0"))
    run_inprocess(overrides(inputs, out, "steps=6", "warmup_steps=4", "eval_every=0", "stop_at=3"))
    run_inprocess(overrides(inputs, out, "steps=8", "warmup_steps=4", "eval_every=4", "log_every=2", "save_every=2",
                            "keep_checkpoints=0"))
    assert history(out) == history(reference)  # losses, learning rates and gradient norms, bit for bit
    assert [r["step"] for r in read_metrics(out, "eval")] == [0, 4, 8]
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [3, 4, 6, 8]
    saved = (out / "config.yaml").read_text()
    assert "steps: 8" in saved and "save_every: 2" in saved and "eval_every: 4" in saved
    assert read_state(out / "checkpoints" / "step-00000008")["config"]["steps"] == 8


def test_resume_refuses_another_model(stopped_run, inputs, tmp_path):
    out = copy_run(stopped_run, tmp_path / "run")
    other = Path(shutil.copytree(inputs[1], tmp_path / "other-model"))
    before = listing(out)
    with pytest.raises(ValueError, match=rf"continues a run of model {inputs[1]} .*but this run has model={other}"):
        run_inprocess(overrides(inputs, out, f"model={other}"))
    assert listing(out) == before


# ---------------------------------------------------------------------------------------------- 5: divergence


def model_states(checkpoint: Path) -> dict:
    return torch.load(checkpoint / "mp_rank_00_model_states.pt", weights_only=False)["module"]


def largest_weight(state: dict) -> float:
    return max(float(v.abs().max()) for v in state.values())


@pytest.mark.parametrize("stage", [0, 2])
def test_divergence_stops_before_the_bad_update(inputs, tmp_path, monkeypatch, stage):
    """lr 1e9: step 1 sends the weights to ~1e9 and step 2's gradients overflow. Whatever the ZeRO stage does with such
    a step (stage 0 applies it, then saves NaN weights), the run stops before that update; the checkpoint of step 1
    holds the engine's finite weights, but exploded ones, so the run names no good checkpoint but the model (before:
    it named step-00000001 as the last good one)."""
    ds = json.loads((REPO / "configs/deepspeed/zero2.json").read_text())
    ds["zero_optimization"] = {"stage": stage}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    engines = []
    build = train.trainer.build_engine
    monkeypatch.setattr(train.trainer, "build_engine", lambda *a: engines.append(build(*a)) or engines[-1])
    out = tmp_path / "diverge"
    with pytest.raises(NonFiniteLossError, match=r"non-finite gradient \(inf or NaN\) at step 2, before its update.*"
                                                 r"the last good checkpoint is none \(step-00000001 was saved as the "
                                                 rf"run diverged\): start again from the model {inputs[1]} with a lower lr"):
        run_inprocess(overrides(inputs, out, "lr=1.0e9", "warmup_steps=0", "save_every=1", "eval_every=0",
                                f"deepspeed={tmp_path / 'ds.json'}"))
    saved = model_states(out / "checkpoints" / "step-00000001")
    engine = engines[0].module.state_dict()
    assert all(torch.isfinite(v).all() for v in saved.values())
    assert largest_weight(saved) > 1e6  # step 1 did move the weights
    assert saved.keys() == engine.keys() and all(torch.equal(saved[k], engine[k]) for k in saved)
    RunLock(out).release()  # the failed run let go of its output_dir


def test_the_named_checkpoint_predates_the_divergence(inputs, tmp_path, monkeypatch):
    """Three steps at the tiny run's lr, then one a trillion times larger: step 4's update explodes the weights (which
    checkpoint 4 saves, finite) and step 5 overflows. The run names checkpoint 3, whose weights are the sane ones, and
    keep_checkpoints=1 did not delete it. Before: it named step-00000004 as the last good checkpoint, and step 3 was
    gone. (No config key makes the learning rate jump; the schedule is replaced so that the step the run diverges
    at does not depend on a CPU's rounding.)"""
    schedule = train.optimizer.lr_factor
    monkeypatch.setattr(train.optimizer, "lr_factor", lambda step, cfg: schedule(step, cfg) * (1.0 if step < 3 else 1e15))
    out = tmp_path / "diverge"
    good, bad = out / "checkpoints" / "step-00000003", out / "checkpoints" / "step-00000004"
    with pytest.raises(NonFiniteLossError, match=rf"at step 5.*: stopping without saving; the last good checkpoint is "
                                                 rf"{good} \(the newer step-00000004 was saved as the run diverged; .*"
                                                 rf"deepspeed-to-hf {good} DST\)"):
        run_inprocess(overrides(inputs, out, "steps=8", "save_every=1", "keep_checkpoints=1", "eval_every=0"))
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [3, 4]
    from safetensors.torch import load_file

    start = largest_weight(load_file(inputs[1] / "model.safetensors"))
    assert largest_weight(model_states(good)) < 2 * start  # three small steps from the start
    assert largest_weight(model_states(bad)) > 1e6 * start
    assert read_state(bad)["guard"]["good"] == good.name
    RunLock(out).release()


def test_a_checkpoint_counts_as_good_once_the_step_after_it_is_sane():
    """The guard's verdicts, step by step: a checkpoint is confirmed by the next step's loss, never after an
    exploded one; a resumed run keeps the good checkpoint its checkpoint recorded."""
    from train.guard import EXPLODED, DivergenceGuard

    guard = DivergenceGuard(Path("model"))
    guard.step_done(1, 5.0)
    guard.saved(Path("ckpt/step-00000001"))
    assert guard.good is None  # not confirmed yet
    guard.step_done(2, 4.0)
    assert guard.good == Path("ckpt/step-00000001") and guard.pending is None
    guard.saved(Path("ckpt/step-00000002"))
    guard.step_done(3, 5.0 * EXPLODED + 1)  # finite, but exploded: step 2's weights are not good
    guard.saved(Path("ckpt/step-00000003"))
    guard.step_done(4, 3.0)  # nothing after an explosion counts
    assert guard.good == Path("ckpt/step-00000001") and guard.pending == Path("ckpt/step-00000003")
    assert guard.state() == {"good": "step-00000001", "first_loss": 5.0, "exploded_at": 3}
    assert "the newer step-00000003 was saved as the run diverged, the loss exploding since step 3" in str(guard.error("x"))
    small = DivergenceGuard(Path("model"))
    small.step_done(1, 0.01)  # a small first loss (attention transfer's MSE): a rise to 9 is not an explosion
    small.step_done(2, 0.5 * EXPLODED)
    assert small.exploded_at is None


# ---------------------------------------------------------------------------------------------- 6: damaged checkpoints


@pytest.fixture(scope="module")
def checkpointed(inputs):
    """(uninterrupted 6-step run, the same run stopped at step 4 with checkpoints at 2 and 4)."""
    root = inputs[0]
    full, part = root / "ckpt-full", root / "ckpt-part"
    run_inprocess(overrides(inputs, full, "save_every=2", "eval_every=0"))
    run_inprocess(overrides(inputs, part, "save_every=2", "eval_every=0", "stop_at=4"))
    return full, part


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) * 3 // 5  # inside the tensor data of a zip-format torch file, not its directory
    data[at : at + 4] = bytes(b ^ 0x5A for b in data[at : at + 4])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,shard", [(truncate, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                                          (flip_bytes, "mp_rank_00_model_states.pt"), (truncate, "trainer_state.json")])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(checkpointed, inputs, tmp_path, caplog, damage, shard):
    full, part = checkpointed
    out = copy_run(part, tmp_path / "run")
    damage(out / "checkpoints" / "step-00000004" / shard)
    run_inprocess(overrides(inputs, out, "save_every=2", "eval_every=0"))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"step-00000004: {shard} is damaged" in w and "falling back to the previous complete checkpoint" in w
               and w.endswith("step-00000002") for w in warnings), warnings
    assert history(out) == history(full)  # replayed from step 2: exactly the uninterrupted run


def test_damaged_checkpoint_named_by_resume_is_refused(checkpointed, inputs, tmp_path):
    _, part = checkpointed
    out = copy_run(part, tmp_path / "run")
    ckpt = out / "checkpoints" / "step-00000004"
    truncate(ckpt / "mp_rank_00_model_states.pt")
    with pytest.raises(DamagedCheckpointError, match=r"step-00000004: mp_rank_00_model_states.pt is damaged"):
        run_inprocess(overrides(inputs, tmp_path / "new", "save_every=2", f"resume={ckpt}"))
    truncate(out / "checkpoints" / "step-00000002" / "trainer_state.json")
    with pytest.raises(DamagedCheckpointError, match=r"every checkpoint is damaged: .*step-00000004.*step-00000002"):
        run_inprocess(overrides(inputs, out, "save_every=2"))


def test_checkpoint_without_manifest_is_refused_unless_asked(checkpointed, inputs, tmp_path, caplog):
    """Before: a checkpoint whose manifest was deleted resumed with only a warning."""
    full, part = checkpointed
    out = copy_run(part, tmp_path / "run")
    ckpt = out / "checkpoints" / "step-00000004"
    (ckpt / MANIFEST).unlink()  # deleted, or as written by an older r2lm
    before = listing(out)
    with pytest.raises(ValueError, match=rf"checkpoint {ckpt} has no {MANIFEST} \(deleted, or written by an r2lm before "
                                         rf"manifests\), so its files cannot be checked .*: restore {ckpt / MANIFEST}, "
                                         "or give resume_unverified=true to resume from it unchecked"):
        run_inprocess(overrides(inputs, out, "save_every=2", "eval_every=0"))
    assert listing(out) == before  # nothing written, nothing pruned
    run_inprocess(overrides(inputs, out, "save_every=2", "eval_every=0", "resume_unverified=true"))
    assert any(f"step-00000004 has no {MANIFEST}" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert history(out) == history(full)


def test_a_resumed_run_knows_the_good_checkpoint(checkpointed):
    """Checkpoint 4 recorded checkpoint 2 as good (step 3 confirmed it): a run resumed from 4 names 2 if it diverges
    at once, and 4 only once a step has confirmed it."""
    from train.guard import DivergenceGuard

    _, part = checkpointed
    root = part / "checkpoints"
    guard = DivergenceGuard.resumed(Path("model"), root / "step-00000004", read_state(root / "step-00000004"))
    assert guard.good == root / "step-00000002" and guard.pending == root / "step-00000004"
    assert f"the last good checkpoint is {root / 'step-00000002'} (the newer step-00000004" in str(guard.error("x"))
    guard.step_done(5, 1.0)
    assert guard.good == root / "step-00000004"


def test_manifest_covers_every_file_in_sha256sum_format(checkpointed, tmp_path):
    _, part = checkpointed
    ckpt = shutil.copytree(part / "checkpoints" / "step-00000004", tmp_path / "step-00000004")
    listed = {line.split("  ", 1)[1] for line in (ckpt / MANIFEST).read_text().splitlines()}
    assert listed == {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()} - {MANIFEST}
    check = subprocess.run(["sha256sum", "--check", "--quiet", MANIFEST], cwd=ckpt, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert verify_checkpoint(ckpt) is True
    (ckpt / "config.json").unlink()
    with pytest.raises(DamagedCheckpointError, match=r"step-00000004: config.json is missing"):
        verify_checkpoint(ckpt)


# ---------------------------------------------------------------------------------------------- 10: one run per folder


def hold_lock(folder: Path, then: str = "time.sleep(120)") -> subprocess.Popen:
    """Another process that takes the run lock of `folder` (train.lock, as a training run does), then runs `then`."""
    code = f"import os, sys, time; from train.lock import RunLock; RunLock(sys.argv[1]); print('locked', flush=True); {then}"
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.fixture
def holder(tmp_path):
    procs = []
    yield lambda folder: procs.append(hold_lock(folder)) or procs[-1]
    for proc in procs:
        proc.kill()
        proc.wait()


def test_held_output_dir_is_refused_naming_the_holder(inputs, tmp_path, holder):
    out = tmp_path / "run"
    proc = holder(out)
    with pytest.raises(ValueError, match=rf"output_dir {out} is in use by another run: pid {proc.pid} on host "
                                         rf"{socket.gethostname()}, started 20\d\d-"):
        run_inprocess(overrides(inputs, out, "steps=1"))
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing written, nothing read


def test_lock_of_a_dead_process_does_not_block(inputs, tmp_path):
    out = tmp_path / "run"
    killed = hold_lock(out, then="os.kill(os.getpid(), 9)")
    assert killed.wait() == -signal.SIGKILL and '"pid"' in (out / LOCK_FILE).read_text()  # its record is left behind
    result = run_inprocess(overrides(inputs, out, "steps=1", "eval_every=0", "export=false"))
    assert result.step == 1 and (out / LOCK_FILE).read_text() == ""  # released at the end


def test_a_run_never_overwrites_the_model_it_trains(stopped_run, inputs, tmp_path):
    """The export replaces output_dir/final: a run of the model in final/ (a finished run's, its checkpoints
    deleted) into that same output_dir is refused before anything is written; so is an output_dir in the model."""
    out = copy_run(stopped_run, tmp_path / "run")
    shutil.copytree(inputs[1], out / "final")  # an exported model (the run's source model stands in for it)
    shutil.rmtree(out / "checkpoints")
    before = listing(out)
    items = overrides(inputs, out, "steps=1")
    items = [i for i in items if not i.startswith("model=")] + [f"model={out / 'final'}"]
    with pytest.raises(ValueError, match=rf"model {out / 'final'} lies in {out / 'final'}, which this run .* writes"):
        run_inprocess(items)
    assert listing(out) == before
    model = tmp_path / "model"
    shutil.copytree(inputs[1], model)
    items = [i for i in overrides(inputs, model / "run", "steps=1") if not i.startswith("model=")] + [f"model={model}"]
    with pytest.raises(ValueError, match=rf"output_dir {model / 'run'} is \(inside\) the model folder"):
        run_inprocess(items)
    assert not (model / "run").exists()


def test_an_export_that_would_replace_a_users_files_is_refused_before_training(stopped_run, inputs, tmp_path):
    out = copy_run(stopped_run, tmp_path / "run")
    (out / "final").mkdir()
    (out / "final" / "README.md").write_text("my model card\n")
    before = listing(out)
    with pytest.raises(ValueError, match=r"export: .*final .*has no checksums.sha256"):
        run_inprocess(overrides(inputs, out))
    assert listing(out) == before  # no step trained, nothing written


def test_unreadable_weights_are_named_before_anything_is_written(inputs, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(inputs[1], model)
    message = damage_weights(model)
    out = tmp_path / "new" / "run"
    with pytest.raises(ValueError, match=re.escape(message)):
        run_inprocess([i for i in overrides(inputs, out, "steps=1") if not i.startswith("model=")] + [f"model={model}"])
    assert not (tmp_path / "new").exists()


def test_a_folder_that_never_held_a_run_keeps_its_files(inputs, tmp_path):
    """`--config runs/x/config.yaml output_dir=runs/x`: the run would replace config.yaml (and metrics.jsonl ...)."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("# my experiment notes\nsteps: 1\n")
    with pytest.raises(ValueError, match=rf"output_dir {out} is not a training run's folder \(no {LOCK_FILE}\) but "
                                         "holds config.yaml, which a run writes"):
        run_inprocess(overrides(inputs, out, "steps=1"))
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml"]
    assert (out / "config.yaml").read_text().startswith("# my experiment notes")


def test_a_cut_last_metrics_line_does_not_block_the_resume(stopped_run, inputs, tmp_path):
    """A crash (or a full disk) mid-write leaves half a line: the resume drops it (its step is redone) and goes on;
    a damaged line before the last is a clear error naming the file and the line."""
    out = copy_run(stopped_run, tmp_path / "run")
    metrics = out / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"kind": "train", "step": 4, "lo')
    result = run_inprocess(overrides(inputs, out))
    assert result.step == 6 and [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    lines = whole.splitlines()
    metrics.write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=rf"{metrics}: line 2 is not a JSON record"):
        read_metrics(out)


@pytest.mark.slow
def test_two_rank_launch_into_a_held_output_dir_stops_every_rank(inputs, tmp_path, holder):
    out = tmp_path / "run"
    proc = holder(out)
    launch = run_cli([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "train/pretrain.py",
                      *overrides(inputs, out, "steps=2")], timeout=240)
    assert launch.returncode != 0
    assert f"is in use by another run: pid {proc.pid}" in launch.stdout + launch.stderr
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]


@pytest.mark.parametrize("held", ["run.lock", "tiny_cpu/run.lock"])
@pytest.mark.parametrize("how", ["env", "arg"])
def test_quickstart_leaves_a_folder_in_use_alone(tmp_path, holder, held, how):
    folder = tmp_path / "qs"
    (folder / "corpus").mkdir(parents=True)
    (folder / ".quickstart").write_text("an earlier quickstart's folder\n")
    (folder / "corpus" / "train.txt").write_text("another run's data\n")
    proc = holder((folder / held).parent)
    args, env = (["bash", "scripts/quickstart.sh"], {"QUICKSTART_DIR": str(folder)}) if how == "env" else (
        ["bash", "scripts/quickstart.sh", str(folder)], {})
    result = run_cli(args, timeout=60, env=env)
    assert result.returncode != 0
    assert f"is in use by another run: {{\"pid\": {proc.pid}" in result.stderr and str(folder / held) in result.stderr
    assert (folder / "corpus" / "train.txt").read_text() == "another run's data\n"
    assert "=== 1/5" not in result.stdout


@pytest.mark.parametrize("how", ["env", "arg"])
def test_quickstart_refuses_a_folder_it_did_not_make(tmp_path, how):
    """The quickstart empties its folder: one holding the user's files (no .quickstart mark) is left as it was."""
    folder = tmp_path / "mine"
    (folder / "thesis").mkdir(parents=True)
    (folder / "thesis" / "chapter1.tex").write_text("a draft\n")
    args, env = (["bash", "scripts/quickstart.sh"], {"QUICKSTART_DIR": str(folder)}) if how == "env" else (
        ["bash", "scripts/quickstart.sh", str(folder)], {})
    result = run_cli(args, timeout=60, env=env)
    assert result.returncode != 0
    assert f"error: {folder} is not a quickstart's folder" in result.stderr
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == ["thesis", "thesis/chapter1.tex"]
    (folder / "run.lock").write_text("")  # an earlier quickstart's lock beside the user's files: still refused
    result = run_cli(args, timeout=60, env=env)
    assert result.returncode != 0 and f"error: {folder} is not a quickstart's folder" in result.stderr
    file = tmp_path / "a_file"
    file.write_text("not a folder\n")
    result = run_cli(["bash", "scripts/quickstart.sh", str(file)], timeout=60)
    assert result.returncode != 0 and f"error: {file} is not a quickstart's folder" in result.stderr
    assert file.read_text() == "not a folder\n"


def test_quickstart_takes_back_a_folder_an_earlier_quickstart_made(tmp_path):
    """Folders made before the .quickstart mark hold its run.lock and its outputs only: they are still its own.
    (The run is stopped right after its clean-up by a python that fails: nothing else of the job runs.)"""
    folder = tmp_path / "qs"
    for name in ("corpus", "r2lm", "smollm2"):
        (folder / name).mkdir(parents=True)
    (folder / "run.lock").write_text("")
    stub = tmp_path / "bin"
    stub.mkdir()
    for tool in ("python", "pip"):
        (stub / tool).write_text("#!/bin/sh\nexit 1\n")
        (stub / tool).chmod(0o755)
    result = run_cli(["bash", "scripts/quickstart.sh", str(folder)], timeout=60,
                     env={"PATH": f"{stub}:{os.environ['PATH']}", "VIRTUAL_ENV": str(tmp_path / "none")})
    assert "is not a quickstart's folder" not in result.stderr
    assert sorted(p.name for p in folder.iterdir()) == [".quickstart", "run.lock"]  # emptied, marked


# ---------------------------------------------------------------------------------------------- 14: training data


def test_binary_text_file_reports_its_first_bad_byte(inputs, tmp_path):
    data = tmp_path / "binary.txt"
    data.write_bytes(b"a few words\n\n" + bytes(range(256)))
    out = tmp_path / "new" / "run"
    with pytest.raises(ValueError, match=rf"data.train: {data} is not UTF-8 text: a NUL byte at offset 13") as info:
        run_inprocess(overrides(inputs, out, f"data.train={data}"))
    assert "OFFLINE" not in str(info.value)
    data.write_bytes(b"a few words\n\n" + bytes(range(128, 256)))
    with pytest.raises(ValueError, match=r"byte 0x80 at offset 13 is not UTF-8"):
        run_inprocess(overrides(inputs, out, f"data.train={data}"))
    assert not (tmp_path / "new").exists()


def test_decode_error_past_the_checked_start_names_file_and_offset(inputs, tmp_path):
    text = inputs[2].read_bytes()
    text = text * (70_000 // len(text) + 1)  # past the first 64 KiB that validation reads
    data = tmp_path / "late.txt"
    data.write_bytes(text + b"\n\nlast words \xff\xfe")
    out = tmp_path / "new" / "run"
    with pytest.raises(ValueError, match=rf"{data} is not UTF-8 text: byte 0xff at offset {len(text) + 13} is not UTF-8") as info:
        run_inprocess(overrides(inputs, out, f"data.train={data}"))
    assert "OFFLINE" not in str(info.value)
    assert not (tmp_path / "new").exists()  # the lock's folder is removed again: the run never started


@pytest.mark.parametrize("spec", ["corpus/missing", "no/such/folder", "corpus/missing/"])
def test_missing_relative_path_is_no_such_file(inputs, monkeypatch, spec):
    monkeypatch.chdir(inputs[0])  # where corpus/ is
    out = inputs[0] / "never"
    with pytest.raises(ValueError, match=rf"data.train: no such file: {spec} \(relative to the working directory "
                                         rf"{inputs[0]}\)"):
        run_inprocess(overrides(inputs, out, f"data.train={spec}"))
    assert not out.exists()


def test_run_failing_the_data_checks_writes_nothing(stopped_run, inputs, tmp_path):
    (tmp_path / "short.txt").write_text("the quick brown fox\n")
    bad_data = f"data.train={tmp_path / 'short.txt'}"
    out = tmp_path / "new" / "run"
    with pytest.raises(ValueError, match="yields no complete sequence"):
        run_inprocess(overrides(inputs, out, bad_data))
    assert not (tmp_path / "new").exists()
    existing = copy_run(stopped_run, tmp_path / "existing")
    shutil.rmtree(existing / "checkpoints")  # a run folder with config.yaml, train.log, metrics.jsonl and nothing to resume
    before = listing(existing)
    with pytest.raises(ValueError, match="yields no complete sequence"):
        run_inprocess(overrides(inputs, existing, bad_data))
    assert listing(existing) == before


def test_data_changed_since_the_checkpoint_is_refused_naming_the_file(inputs, tmp_path, caplog):
    """Exact resume replays the batches of the data as it was; before, a changed data file went unnoticed. A file
    touched or copied without a change (its sha256 the same) resumes; resume_data_changed=true continues on the new
    data, with a warning, and the next checkpoint records it."""
    data = tmp_path / "train.txt"
    text = inputs[2].read_text()
    data.write_text(text)
    out = tmp_path / "run"
    items = [i for i in overrides(inputs, out, "eval_every=0", "save_every=1") if not i.startswith("data.train=")]
    items.append(f"data.train={data}")
    run_inprocess([*items, "stop_at=3"])
    ckpt = out / "checkpoints" / "step-00000003"
    assert read_state(ckpt)["data_files"]["data.train"][str(data)]["size"] == len(text)
    before = listing(out)
    mtimes = iter(range(read_state(ckpt)["data_files"]["data.train"][str(data)]["mtime_ns"] + 10**9, 2**63, 10**9))

    def rewrite(content: str) -> None:  # with a modification time certainly not one seen before
        data.write_text(content)
        later = next(mtimes)
        os.utime(data, ns=(later, later))

    for changed, how in [(text + "one more paragraph\n", rf"\({len(text)} bytes then, {len(text) + 19} now\)"),
                         (text.replace("fox", "cat", 1), r"\(the same size, other content\)")]:
        rewrite(changed)
        with pytest.raises(ValueError, match=rf"checkpoint {ckpt} was saved with other data: data.train file {data} "
                                             rf"changed {how}\. Exact resume .*: restore it, or give "
                                             "resume_data_changed=true"):
            run_inprocess(items)
        assert listing(out) == before
    rewrite(text)  # the same bytes, another modification time
    assert run_inprocess([*items, "stop_at=4"]).step == 4
    rewrite(text.replace("fox", "cat", 1))
    assert run_inprocess([*items, "resume_data_changed=true"]).step == 6
    assert any(f"continuing on changed data (resume_data_changed=true): data.train file {data} changed" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")
    recorded = read_state(out / "checkpoints" / "step-00000006")["data_files"]["data.train"][str(data)]
    assert recorded["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------- 16: permissions


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["022", "077"])
def test_run_files_follow_the_umask(inputs, tmp_path, umask):
    out = tmp_path / "run"
    old = os.umask(umask)
    try:  # a LoRA run: its export (final/, the adapter) is written by train/ itself
        run_inprocess(overrides(inputs, out, "lora.enabled=true", "steps=2", "save_every=1", "eval_every=0"))
    finally:
        os.umask(old)
    written = {str(p.relative_to(out)): p for p in out.rglob("*")}
    scripts = {"checkpoints/zero_to_fp32.py", "checkpoints/zero_to_torch.py"}  # DeepSpeed's, copied with u+x
    wrong = {name: oct(p.stat().st_mode & 0o777) for name, p in written.items()
             if name not in scripts and p.stat().st_mode & 0o777 != (0o777 if p.is_dir() else 0o666) & ~umask}
    assert not wrong
    for name in [LOCK_FILE, "config.yaml", "train.log", "metrics.jsonl", "checkpoints/latest",
                 f"checkpoints/step-00000002/{MANIFEST}", "checkpoints/step-00000002/trainer_state.json",
                 "checkpoints/step-00000002/mp_rank_00_model_states.pt", "final/adapter_model.safetensors"]:
        assert name in written, name


def test_a_finished_run_whose_export_was_lost_resumes_to_export(checkpointed, inputs, tmp_path):
    """Before: a run killed while exporting (after its last checkpoint) could not be finished: resuming said
    "nothing to do" and left it without final/."""
    from safetensors.torch import load_file

    full, _ = checkpointed
    run = copy_run(full, tmp_path / "run")
    shutil.rmtree(run / "final")
    run_inprocess(overrides(inputs, run, "save_every=2", "eval_every=0"))
    want, got = load_file(full / "final" / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(ValueError, match="is exported: nothing to do"):
        run_inprocess(overrides(inputs, run, "save_every=2", "eval_every=0"))
