"""Multi-process training through the real launchers: `deepspeed --num_gpus 2` (ZeRO-2) and
scripts/launch_multinode.sh (`deepspeed --hostfile`, ZeRO-3), two CPU ranks over gloo.

The exported weights are checked against the engine's without trusting the exporter: the test recomputes the
run's last held-out evaluation (same batches, same noise seeds) on the exported model and compares it with the
loss the engine logged."""

import math
from pathlib import Path

import pytest
import torch

from r2lm import R2LMForDiffusionLM
from r2lm.checkpoints import complete_checkpoints, read_state
from r2lm.diffusion import compute_loss, noise_seed
from tests.helpers import REPO
from tests.helpers.processes import DEEPSPEED, free_port, python, run_cli
from tests.helpers.training import run_overrides as overrides
from tests.helpers.training import training_inputs
from train.config import load_config
from train.data import build_data
from train.tracking import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return training_inputs(tmp_path_factory.mktemp("launch"))



def shm_workspaces(port: int) -> list[Path]:
    """DeepSpeed's CPU allreduce workspaces of a run at `port` still named in /dev/shm."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def launch(items, timeout=240):
    port = free_port()
    out = run_cli([DEEPSPEED, "--num_gpus", "2", "--master_port", str(port), "train/pretrain.py", *items], timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not shm_workspaces(port), "a run left its shared-memory workspaces behind"
    return out


def test_a_run_leaves_no_shared_memory_behind(tmp_path):
    """DeepSpeed's CPU backend creates a 64 MiB /dev/shm workspace per rank and never removes it; the ranks of a run
    remove theirs once all are mapped (train.distributed.init_distributed), and still reduce through them."""
    script = tmp_path / "ranks.py"
    script.write_text(
        "import torch, deepspeed\n"
        "from deepspeed import comm as dist\n"
        "from train.distributed import init_distributed, setup_environment\n"
        "rank, _, world = setup_environment()\n"
        "deepspeed.init_distributed(verbose=False)  # DeepSpeed's own: the workspaces exist now\n"
        "import glob, os\n"
        "before = len(glob.glob(f\"/dev/shm/deepspeed_allreduce_buffer_*_{os.environ['MASTER_PORT']}_*\"))\n"
        "init_distributed(rank, world)\n"
        "x = torch.full((4,), float(rank + 1))\n"
        "dist.inference_all_reduce(x)  # through the unlinked workspaces\n"
        f"open(f'{tmp_path}/rank{{rank}}.txt', 'w').write(f'workspaces {{before}} sum {{x.tolist()}}')\n")
    port = free_port()
    out = run_cli([DEEPSPEED, "--num_gpus", "2", "--master_port", str(port), str(script)], timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "workspaces 2 sum [3.0, 3.0, 3.0, 3.0]"
    assert not shm_workspaces(port)


def heldout_loss(model_dir: Path, items: list[str], world: int) -> float:
    """The run's held-out evaluation, recomputed in this process on an exported model (see train.trainer.evaluate)."""
    cfg = load_config(None, items)
    model = R2LMForDiffusionLM.from_pretrained(model_dir).eval()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    total = tokens = 0.0
    for rank in range(world):
        data = build_data(cfg, tok, tok.eos_token_id, rank, world, first_on_node=True, barrier=lambda: None)
        for k, idx, weight in data.heldout.plan(rank):
            generator = torch.Generator().manual_seed(noise_seed(cfg.eval_seed, k, rank))
            with torch.no_grad():
                out = compute_loss(cfg.objective, model, data.heldout.batch(idx), separator_id=data.eos_id, generator=generator)
            total += float(out.loss) * out.tokens * weight
            tokens += out.tokens * weight
    return total / tokens


ZERO2 = ["steps=30", "save_every=15", "eval_every=15", "deepspeed=configs/deepspeed/zero2.json"]


@pytest.fixture(scope="module")
def zero2_run(inputs):
    out = inputs[0] / "zero2"
    launch(overrides(inputs, out, *ZERO2))
    return out


def test_two_ranks_zero2_loss_decreases(zero2_run):
    losses = [r["loss"] for r in read_metrics(zero2_run)]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first - last > 1.0, losses  # a small repetitive corpus: the tiny model learns it quickly
    evals = [r["eval_loss"] for r in read_metrics(zero2_run, "eval")]
    assert len(evals) == 3 and evals[0] - evals[-1] > 1.0
    assert read_state(zero2_run / "checkpoints" / "step-00000030")["world_size"] == 2


def test_two_ranks_zero2_resume_is_exact(zero2_run, inputs):
    out = inputs[0] / "zero2-resumed"
    launch(overrides(inputs, out, *ZERO2, "stop_at=15"))
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [15] and not (out / "final").exists()
    launch(overrides(inputs, out, *ZERO2))
    drop = ("tokens_per_s", "step_time_s")
    resumed = [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(out, None)]
    reference = [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(zero2_run, None)]
    assert resumed == reference


def test_two_ranks_zero2_export_holds_the_engine_weights(zero2_run, inputs, tmp_path):
    logged = read_metrics(zero2_run, "eval")[-1]["eval_loss"]
    assert heldout_loss(zero2_run / "final", overrides(inputs, zero2_run, *ZERO2), world=2) == pytest.approx(logged, rel=1e-5)
    converted = tmp_path / "converted"
    out = run_cli(python("-m", "convert", "deepspeed-to-hf", str(zero2_run / "checkpoints" / "step-00000030"), str(converted)))
    assert out.returncode == 0, out.stderr[-2000:]
    a, b = R2LMForDiffusionLM.from_pretrained(converted).state_dict(), R2LMForDiffusionLM.from_pretrained(zero2_run / "final").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_zero3_through_the_multinode_wrapper(inputs, tmp_path):
    out = inputs[0] / "zero3"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one node, two CPU ranks\nlocalhost slots=2\n")
    items = overrides(inputs, out, "steps=8", "save_every=4", "eval_every=4", "deepspeed=configs/deepspeed/zero3.json")
    # one host: the launcher runs locally; --no_ssh_check because CI has no ssh server
    result = run_cli(["bash", "scripts/launch_multinode.sh", str(hostfile), *items], timeout=240,
                     env={"MASTER_PORT": str(free_port()), "DS_LAUNCHER_ARGS": "--no_ssh_check"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "--hostfile" in result.stderr  # the wrapper's command line (set -x)
    ckpt = out / "checkpoints" / "step-00000008"
    assert read_state(ckpt)["world_size"] == 2
    assert sorted(p.name for p in ckpt.glob("zero_pp_rank_*_model_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]  # stage 3 shards
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    converted = tmp_path / "zero3-hf"
    conv = run_cli(python("-m", "convert", "deepspeed-to-hf", str(out / "checkpoints"), str(converted)))
    assert conv.returncode == 0, conv.stderr[-2000:]
    logged = read_metrics(out, "eval")[-1]["eval_loss"]
    assert heldout_loss(converted, items, world=2) == pytest.approx(logged, rel=1e-5)
    assert (REPO / "scripts" / "launch_multinode.sh").stat().st_mode & 0o111  # executable
