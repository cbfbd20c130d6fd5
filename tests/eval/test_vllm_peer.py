"""eval.vllm_peer without vLLM (tests/eval/test_vllm_serving.py runs vLLM itself, slow): what it exports for a
checkpoint with sidecars and a DFlash drafter, the server command and the benchmark's rows it builds from them, and
the help of both of its command lines (vllm_engine.py's without importing vLLM, which r2lm's environment lacks)."""

import json
import subprocess
import sys

import torch

from eval.vllm_peer import ENGINE, export, peer_configs, serve_argv
from r2lm import R2LMForDiffusionLM
from r2lm.drafter import Drafter, DrafterConfig
from tests.helpers.models import make_model_dir


def test_a_checkpoint_and_its_dflash_drafter_export_for_vllm(tmp_path):
    model = make_model_dir(tmp_path / "r2lm")  # sidecars on layers 1 and 3
    target = R2LMForDiffusionLM.from_pretrained(model)
    torch.manual_seed(0)
    Drafter(DrafterConfig.for_target(target.config, block_size=4, layout="dflash")).save_pretrained(tmp_path / "d")
    exported = export(model, tmp_path / "served", tmp_path / "d")
    assert json.loads((exported.base / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]  # qk_norm
    assert exported.speculative_config() == {"method": "dflash", "model": str(exported.dflash),
                                             "num_speculative_tokens": 3}
    argv = serve_argv("PY", exported, port=8123)
    assert argv[:5] == ["PY", "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str(exported.base) and argv[argv.index("--port") + 1] == "8123"
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == exported.speculative_config()
    rows = peer_configs({"": export(model, tmp_path / "plain"), "d": exported}, block_size=6)
    assert rows["vllm"] is None and rows["vllm_ngram"]["num_speculative_tokens"] == 6
    assert rows["vllm_dflash:d"] == exported.speculative_config()


def test_both_command_lines_explain_themselves():
    engine = subprocess.run([sys.executable, str(ENGINE), "--help"], capture_output=True, text=True)
    assert engine.returncode == 0 and "REQUESTS" in engine.stdout
    peer = subprocess.run([sys.executable, "-m", "eval.vllm_peer", "--help"], capture_output=True, text=True)
    assert peer.returncode == 0 and "--drafter" in peer.stdout
