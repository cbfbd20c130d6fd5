"""A drafter's τ against its training tokens: each checkpoint of a train/pretrain.py objective=drafter run (reassembled
from its DeepSpeed shards) drafting for the target, beside the run's own held-out estimate."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tqdm import tqdm

from eval.decoders import left_pad, r2lm_decoder
from eval.machine import name_of

logger = logging.getLogger("eval.drafter_curve")


def checkpoint_config(folder: Path):
    """The DrafterConfig saved beside a train/pretrain.py objective=drafter checkpoint (refused for another kind)."""
    from r2lm.drafter import DrafterConfig

    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    if config.get("model_type") != DrafterConfig.model_type:
        raise ValueError(f"{folder} is not a drafter checkpoint (its config.json is not a {DrafterConfig.model_type} "
                         "config): --curve takes the output_dir of a train/pretrain.py objective=drafter run")
    return DrafterConfig.from_pretrained(folder)


def checkpoint_drafter(folder: Path):
    """The drafter a train/pretrain.py objective=drafter checkpoint holds, reassembled from its DeepSpeed shards
    (verified against its manifest first)."""
    from r2lm.checkpoints import load_fp32_state_dict, verify_checkpoint
    from r2lm.drafter import Drafter

    config = checkpoint_config(folder)
    verify_checkpoint(folder)
    state = load_fp32_state_dict(folder.parent, folder.name)
    drafter = Drafter(config)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder} does not hold a drafter of its config: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    return drafter.eval()


TRAIN_WINDOW = 50  # steps of logged training τ averaged beside each checkpoint's τ


def spread_out(items: list, count: int) -> list:
    """At most `count` of `items`, evenly spaced, the last always among them."""
    if len(items) <= count:
        return items
    picks = sorted({round(i * (len(items) - 1) / (count - 1)) for i in range(count)}) if count > 1 else [len(items) - 1]
    return [items[i] for i in picks]


def measure_curve(s, prompts: dict, run_dir: Path, args) -> dict:
    """τ of a drafter run's checkpoints against its training tokens (eval/lossless_bench.py's docstring); `s`: the
    benchmark's Setup."""
    from r2lm.checkpoints import complete_checkpoints, read_state
    from train.tracking import read_metrics

    logged = read_metrics(run_dir, "train")
    train = {r["step"]: r["tokens"] for r in logged}
    train[0] = 0
    batch_tau = {r["step"]: r["tau"] for r in logged if "tau" in r}
    evals = [{"step": r["step"], "tokens": train.get(r["step"]), "eval_tau": r["eval_tau"]}
             for r in read_metrics(run_dir, "eval") if "eval_tau" in r]
    # the checkpoints the run also evaluated at (the two τ side by side) and the last one, where they are enough
    complete = complete_checkpoints(run_dir / "checkpoints")
    evaluated = {e["step"] for e in evals}
    pool = [c for c in complete[:-1] if c[0] in evaluated] + complete[-1:]
    checkpoints = spread_out(pool if len(pool) >= args.curve_points else complete, args.curve_points)
    points = []
    for step, folder in tqdm(checkpoints, desc=f"curve {run_dir.name}", unit="checkpoint", dynamic_ncols=True):
        state = read_state(folder)
        model_path = state.get("model_path")
        if model_path and Path(model_path).resolve() != Path(args.target).resolve():  # (a path of this machine: logged)
            logger.warning("%s was trained beside %s; measured beside --target %s", folder, model_path, args.target)
        drafter = checkpoint_drafter(folder).to(s.target.dtype)
        # the whole draft every step: the drafter's own τ (the adaptive policy would trade it for speed)
        run = r2lm_decoder(s.target, s.eos, s.pad, verify=True, drafter=drafter, verify_draft="drafter",
                           verify_policy="longest")
        tau = {}
        for category in args.categories:
            outs = [run(*left_pad([ids], s.pad), args.new_tokens) for _, ids in prompts[category][: args.curve_prompts]]
            tau[category] = sum(o.tokens for o in outs) / max(sum(o.forwards for o in outs), 1)
        # τ of the training batches themselves over the last TRAIN_WINDOW steps (logged): runs of one data file and
        # seed drew the same batches, so their difference is paired (replay logs its random anchors' τ)
        window = [batch_tau[k] for k in range(step - TRAIN_WINDOW + 1, step + 1) if k in batch_tau]
        points.append({"step": step, "tokens": state.get("tokens", train.get(step)), "tau": tau,
                       "train_tau": sum(window) / len(window) if window else None})
        logger.info("%s step %d: tau %s", run_dir.name, step, ", ".join(f"{c} {v:.2f}" for c, v in tau.items()))
    config = run_config(run_dir)
    return {"run": name_of(run_dir), "data": training_data(config), "recipe": recipe(config), "block_size":
            drafter.config.block_size if checkpoints else None, "points": points, "eval_tau": evals}


def run_config(run_dir: Path) -> dict:
    """The run's resolved config (its config.yaml; {} where it has none)."""
    import yaml

    path = run_dir / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def training_data(config: dict) -> str:
    """What a run trained on, as its config names it: the training file (by name) and the labels (the target's
    distributions, or the text's own tokens)."""
    data = config.get("data") or {}
    data = data.get("train") or data.get("hub_config") or "?"
    labels = "target's distributions" if (config.get("drafter") or {}).get("distill") else "text tokens"
    return f"{Path(str(data)).name}, {labels}"


def recipe(config: dict) -> str:
    """How a run trained, where runs on the same data differ: the drafter's layers, its layout where it is not
    r2lm's, and the share of blocks replayed from its errors (drafter.replay)."""
    section = config.get("drafter") or {}
    layers = section.get("layers", 1)
    parts = [f"{layers} drafter layer{'s' * (layers != 1)}"]
    if section.get("layout", "r2lm") != "r2lm":
        parts.append(f"layout {section['layout']}")
    if section.get("replay"):
        parts.append(f"replay {section['replay']}")
    return ", ".join(parts)


# settings two curve parts must share for their runs to sit in one table (checkpoints and threads change no τ)
COMPARABLE = ("categories", "curve_prompts", "max_prompt_tokens", "new_tokens")


def merge_runs(old: dict | None, runs: list[dict], settings: dict) -> list[dict]:
    """The runs measured now, then the runs of an earlier curve part (`old`, lossless.json's) that were not measured
    again, where it was measured with the same settings: one table then compares the data sources of runs measured
    in different sittings, each run keeping the commit and machine it was measured at."""
    if not old:
        return runs
    if any(old["settings"].get(k) != settings.get(k) for k in COMPARABLE):
        logger.warning("the curve lossless.json holds was measured with other settings: its runs are dropped")
        return runs
    again = {r["run"] for r in runs}
    where = {k: old["measured"][k] for k in ("commit", "machine")}
    return runs + [{"measured": where, **r} for r in old["runs"] if r["run"] not in again]
