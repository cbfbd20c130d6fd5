"""The lossless benchmark's speed part: every decoder over the same batches, interleaved a batch at a time, against AR
decoding of the same model (eval/lossless_bench.py's docstring), and the step costs verified decoding measured."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from tqdm import tqdm

from eval.decoders import Decoded, left_pad, r2lm_decoder, threshold_decoder, transformers_decoder
from eval.machine import name_of
from eval.parallel_bench import speed_batches
from eval.vllm_peer import bench_rows
from r2lm.generation.costs import measured_tables
from r2lm.generation.drafts import DRAFTS

logger = logging.getLogger("eval.lossless_speed")
AR_EVERY = 3  # decoders timed between two AR decodes of a batch (each pass: 1 / AR_EVERY more decodes)


def speed_decoders(s, block_size: int, policies: list[str], untrained: bool, siblings: list[int] = (3,)) -> dict:
    """name -> (decode(ids, mask, n), batch 1 only). Every verified decoder once per policy: the first plain
    (verify:lookup), the others suffixed (verify:lookup@longest); a drafter's once per `siblings` count
    (verify_siblings): the first plain, the others suffixed (verify:lookup+NAME/s0)."""
    decoders = {"ar": (r2lm_decoder(s.plain, s.eos, s.pad, block_size=1), False),
                "ar_again": (r2lm_decoder(s.plain, s.eos, s.pad, block_size=1), False),
                "transformers": (transformers_decoder(s.hf, s.eos, s.pad), False),
                "transformers_lookup": (transformers_decoder(s.hf, s.eos, s.pad, prompt_lookup_num_tokens=block_size),
                                        True)}
    decoders["threshold"] = (threshold_decoder(s.threshold_model, s.eos, s.pad), False)  # lossy: not checked
    verified = {"verify:lookup": (s.target, dict(verify_draft="lookup", block_size=block_size))}
    if untrained:  # the target's own window: an untrained model's drafts
        verified["verify:window"] = (s.target, dict(verify_draft="window", block_size=block_size))
    for name, drafter in s.drafters.items():
        for draft in ("drafter", "lookup+drafter"):
            key = f"verify:{name}" if draft == "drafter" else f"verify:lookup+{name}"
            for j, k in enumerate(siblings):
                verified[key if j == 0 else f"{key}/s{k}"] = (s.target, dict(drafter=drafter, verify_draft=draft,
                                                                             verify_siblings=k))
    for name, table in s.ngrams.items():
        verified[f"verify:{name}"] = (s.target, dict(ngram=table, verify_draft="ngram", block_size=block_size))
        verified[f"verify:lookup+{name}"] = (s.target, dict(ngram=table, verify_draft="lookup+ngram",
                                                            block_size=block_size))
        for drafter_name, drafter in s.drafters.items():
            verified[f"verify:lookup+{name}+{drafter_name}"] = (s.target, dict(
                ngram=table, drafter=drafter, verify_draft="lookup+ngram+drafter", verify_siblings=siblings[0]))
    for name, model in s.windows.items():  # (its verified output is still checked against the target's AR)
        verified[f"verify:{name}"] = (model, dict(verify_draft="window"))
    for i, policy in enumerate(policies):
        for key, (model, options) in verified.items():
            decoders[key if i == 0 else f"{key}@{policy}"] = (
                r2lm_decoder(model, s.eos, s.pad, verify=True, verify_policy=policy, **options), False)
    return decoders


def bracketed(order: list[str]) -> list[str]:
    """One pass's decodes of a batch: `order` (without "ar") with AR decoded before every AR_EVERY decoders and once
    after the last, so that each decoder is timed between two AR decodes."""
    others = [name for name in order if name != "ar"]
    out = []
    for start in range(0, len(others), AR_EVERY):
        out += ["ar", *others[start : start + AR_EVERY]]
    return [*out, "ar"]


def speed(category: str, prompts: list[list[int]], decoders: dict, args, batch: int, pad: int,
          peers: dict | None = None) -> dict:
    """tokens/s, τ and output checks of every decoder over the same batches, interleaved a batch at a time; `peers`:
    vLLM's rows over the same batches (eval.vllm_peer.measure_peers), checked and counted alike.

    Each pass times every decoder between two AR decodes of the same batch (`bracketed`): a pass's × AR is the
    decoder's seconds against the mean of those two, summed over the batches; a cell is the median over passes.
    A VM's speed drifts by more than the few percent a cell tells apart over the minutes a pass takes, and
    less over the seconds between a decoder and the AR decodes around it."""
    order = speed_batches(torch.arange(len(prompts))[:, None], args.speed_prompts, batch)
    batches = [left_pad([prompts[i] for i in rows[:, 0].tolist()], pad) for rows in order]
    runs = {name: run for name, (run, single_row) in decoders.items() if batch == 1 or not single_row}
    n = args.new_tokens
    for run in runs.values():  # warm-up: the tuner times its product orders on first use of each shape
        run(*batches[0], min(n, 16))
    times, results = {name: [[] for _ in batches] for name in runs}, {}  # name -> per batch, each pass's seconds
    # name -> per pass, [the AR decodes around it, its own] seconds summed over the batches
    against_ar = {name: [[0.0, 0.0] for _ in range(args.repeats)] for name in runs if name != "ar"}
    forwards = dict.fromkeys(runs, 0)  # every pass's, of the first decode of each batch (the policy learns across calls)
    names = list(runs)
    with tqdm(total=args.repeats * len(batches) * len(bracketed(names)), desc=f"speed {category} batch {batch}",
              unit="decode", dynamic_ncols=True) as progress:
        for repeat in range(args.repeats):
            outputs = {name: [] for name in runs}
            sequence = bracketed(names[repeat % len(names):] + names[: repeat % len(names)])
            for index, (ids, mask) in enumerate(batches):
                seconds = []
                for name in sequence:
                    start = time.perf_counter()
                    decoded = runs[name](ids, mask, n)
                    seconds.append(time.perf_counter() - start)
                    times[name][index].append(seconds[-1])
                    if len(outputs[name]) <= index:  # (AR decodes a batch several times a pass: its first)
                        outputs[name].append(decoded)
                        forwards[name] += decoded.forwards or 0
                    progress.update(1)
                for at, name in enumerate(sequence):
                    if name != "ar":
                        before = max(i for i in range(at) if sequence[i] == "ar")
                        after = min(i for i in range(at, len(sequence)) if sequence[i] == "ar")
                        against_ar[name][repeat][0] += (seconds[before] + seconds[after]) / 2
                        against_ar[name][repeat][1] += seconds[at]
            for name in runs:
                results.setdefault(name, outputs[name])  # the first pass's outputs
    for name, measured in (peers or {}).items():
        results[name] = [Decoded(m["rows"], m["tokens"], m["forwards"]) for m in measured]
        times[name] = [[m["seconds"]] for m in measured]
    ar = [row for d in results["ar"] for row in d.rows]
    differing = {name: sum(a != b for a, b in zip(ar, (row for d in out for row in d.rows), strict=True))
                 for name, out in results.items() if name not in ("ar", "threshold")}
    entry = {"prompts": len(batches) * batch,
             "tokens": {name: sum(d.tokens for d in out) for name, out in results.items()},
             # τ over every timed pass (a pass's policy has learnt from the passes before it)
             "forwards": {name: forwards[name] / args.repeats if name in forwards else sum(d.forwards for d in out)
                          for name, out in results.items() if name.startswith(("verify:", "vllm_"))},
             "seconds": {name: sum(map(min, t)) for name, t in times.items()},
             "against_ar": against_ar,
             "differing_rows": differing}
    if "threshold" in results:  # rows computed against rows decoding, and against every row in every forward
        out = results["threshold"]
        entry["threshold_rows"] = {"computed": sum(d.computed_rows for d in out), "decoding": sum(d.forwards for d in out),
                                   "all_forwards": sum(d.batch_forwards for d in out)}
    return with_ratios(entry)


def with_ratios(entry: dict) -> dict:
    """An entry's derived figures from its tokens, forwards, seconds and differing rows."""
    tps = {name: entry["tokens"][name] / max(s, 1e-9) for name, s in entry["seconds"].items()}
    tau = {name: entry["tokens"][name] / max(f, 1) for name, f in entry["forwards"].items()}
    # tokens/s against AR's (vLLM's rows, timed apart), or a decoder's median pass against the AR decodes around it
    vs_ar = {name: v / tps["ar"] for name, v in tps.items()}
    vs_ar |= {name: float(np.median([ar / max(own, 1e-9) for ar, own in passes]))
              for name, passes in entry.get("against_ar", {}).items()}
    out = {**entry, "tokens_per_s": tps, "vs_ar": vs_ar, "tau": tau,
           "step_cost_vs_ar": {name: tau[name] / vs_ar[name] for name in tau},
           "verify_is_ar": all(entry["differing_rows"][name] == 0 for name in tau),
           "ar_is_transformers": all(v == 0 for k, v in entry["differing_rows"].items()
                                     if k.startswith(("transformers", "vllm")))}
    if "transformers_lookup" in tps:
        out["vs_transformers_lookup"] = {name: v / tps["transformers_lookup"] for name, v in tps.items()}
    return out


def total(entries: list[dict]) -> dict:
    """The categories of one batch size together: tokens, forwards, seconds and differing rows summed (each pass's
    seconds against AR's too)."""
    summed = {key: {name: sum(e[key][name] for e in entries) for name in entries[0][key]}
              for key in ("tokens", "forwards", "seconds", "differing_rows", "threshold_rows") if key in entries[0]}
    if all("against_ar" in e for e in entries):
        summed["against_ar"] = {name: np.sum([e["against_ar"][name] for e in entries], 0).tolist()
                                for name in entries[0]["against_ar"]}
    return with_ratios({"prompts": sum(e["prompts"] for e in entries), **summed})


def measure_speed(s, prompts: dict, args, settings: dict) -> dict:
    """tokens/s, τ and output checks of every decoder per category and batch size (eval/lossless_bench.py's
    docstring); `s`: the benchmark's Setup."""
    decoders = speed_decoders(s, args.block_size, args.policies, args.untrained, args.siblings)
    prompts = {c: ps[: args.speed_prompts] for c, ps in prompts.items()}  # (more were read for the curve)
    dflash = [(name, path) for name, path in args.drafter if s.drafters[name].config.layout == "dflash"]
    peers = bench_rows(args.target, dflash, prompts, args, s.eos) if args.vllm else {}
    per_batch = {}
    for batch in args.batch_sizes:
        entries = {c: speed(c, [ids for _, ids in prompts[c]], decoders, args, batch, s.pad,
                            {name: rows[(batch, c)] for name, rows in peers.items()}) for c in args.categories}
        entries["all"] = total(list(entries.values()))
        per_batch[str(batch)] = entries
        logger.info("batch %d, all categories: %s", batch, ", ".join(
            f"{k} {v:.2f}x AR" + (f" (tau {entries['all']['tau'][k]:.2f})" if k in entries["all"]["tau"] else "")
            for k, v in entries["all"]["vs_ar"].items() if k != "ar"))
    paths = dict(args.drafter)
    drafters = {name: {"path": name_of(paths[name]) if name in paths else "freshly initialised (--untrained)",
                       **{k: getattr(d.config, k) for k in ("block_size", "num_hidden_layers", "in_block", "sidecar",
                                                            "draft_vocab_size", "feature_layers", "layout")}}
                for name, d in s.drafters.items()}
    windows = {name: {"path": name_of(path), "sidecar_layers": m.config.sidecar_layers, "block_size": m.config.block_size}
               for (name, path), m in zip(args.window, s.windows.values(), strict=True)}
    return {"settings": settings, "timing": "bracketed", "reference": s.reference,
            "windows": windows, "prompt_ids": {c: [i for i, _ in ps] for c, ps in prompts.items()},
            "prompt_tokens": {c: [len(ids) for _, ids in ps] for c, ps in prompts.items()}, "drafters": drafters,
            "batches": per_batch, "costs": step_costs(s)}


def step_costs(s) -> dict:
    """The costs verified decoding measured for the target's forwards in this run (r2lm.generation.costs), by the
    draft sources they were measured for (named as the decoders are: a drafter or table by its name): seconds of a
    verification forward by rows and width, and of drafting by rows (what the adaptive policy weighs; a window
    model's own are left out)."""
    kinds = {kind.__name__: kind.sources for kind in DRAFTS.values()}
    names = {id(d): name for name, d in s.drafters.items()} | {id(t): name for name, t in s.ngrams.items()}
    out = {}
    # keys: r2lm.generation.drafts' Drafts.key (its class, draft length, captured layers, outcomes, drafter, table),
    # then what kept_costs adds (threads, dtype, device)
    for (kind, b, _capture, _outcomes, drafter, ngram, *_rest), table in measured_tables(s.target).items():
        name = "+".join(names.get(drafter, source) if source == "drafter" else names.get(ngram, source)
                        if source == "ngram" else source for source in kinds[kind])
        out[name if name not in out else f"{name} (draft {b})"] = table
    return out
