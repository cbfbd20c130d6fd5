"""Every check that needs a CUDA GPU, in one run on one GPU (a few minutes; budget 8), printed as one table.

    bash scripts/gpu_check.sh              # on the GPU machine: no network needed, nothing is installed
    bash scripts/gpu_check.sh --dry-run    # the same code on CPU at tiny sizes (tests/eval/test_gpu_check.py runs it)

Rows (status ok / FAIL / not installed; the exit status is 1 if any row FAILs):
- kernel ssd, kernel conv1d: what r2lm.ops dispatches to (mamba_ssm's / causal_conv1d's CUDA kernels when
  installed) against the references, forward and backward: the SSD scan against the step-by-step recurrence, the
  conv against an explicit shifted sum. "not installed" when the package is absent (CPU: the reference runs);
- flex <layout>: flex_attention on the layout's BlockMask against SDPA over the dense mask on the training layouts
  (dual stream of the paper's seq_len, a padded prompt grid), values and gradients, and fwd+bwd time of both;
- hybrid chunked: the linear-time block-hybrid form against the dense one (values, gradients, time);
- train bf16: a tiny R2LM (pydoc text, BPE tokenizer, converted with sidecars) trained through the deepspeed
  launcher on one GPU in bf16 (ZeRO-2, default attention: flex_attention on CUDA): finite losses, and the held-out
  loss (fixed noise, step 0 against the last step) decreases;
- decode batch N: AR (r2lm.generate with block_size=1, the backbone without sidecars) against R2LM (sidecars,
  threshold decoding) tokens/s on a SmolLM2-135M-shaped model with random weights, at batch 1 / 8 / 32;
- verify == AR (fp32): verify=True with window drafts and with prompt-lookup drafts on that model (sidecar gates
  open), a left-padded batch: the same tokens as AR greedy decoding.

Writes --out/gpu_check.json as well.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from r2lm import Layout, R2LMConfig, R2LMForDiffusionLM, dual_stream
from r2lm.kind import SHIFT
from r2lm.layers.hybrid import HybridParts
from r2lm.ops import causal_conv1d, ssd_recurrent_ref, ssd_scan
from r2lm.ops.attention import attention
from r2lm.ops.flex import block_sparse, flex_attention
from r2lm.ops.kernels import optional_import

logger = logging.getLogger("gpu_check")
REPO = Path(__file__).resolve().parents[1]

SIZES = {
    "gpu": dict(ssd_len=256, conv_len=1024, seq_len=2048, heads=16, kv_heads=8, head_dim=128, block=32, repeats=5,
                train_steps=40, train_seq=256, decode_prompt=128, decode_tokens=64, batches=(1, 8, 32),
                decode_model=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)),
    "dry": dict(ssd_len=40, conv_len=64, seq_len=64, heads=4, kv_heads=2, head_dim=16, block=8, repeats=1,
                train_steps=16, train_seq=64, decode_prompt=8, decode_tokens=8, batches=(1, 2),
                decode_model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True)),
}


@dataclass
class Row:
    check: str
    status: str  # ok / FAIL / not installed
    result: str
    seconds: float = 0.0


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def _worst(got, want) -> float:
    return max(_rel(a, b) for a, b in zip(got, want, strict=True))


def _timed(fn, repeats: int, device) -> float:
    """Median seconds of fn() after one warm-up call (compilation, allocator)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _backend(device, module: str, attr: str) -> str | None:
    """The fast path r2lm.ops takes for tensors on `device`: the package name, 'reference' on CPU, None if absent."""
    if device.type != "cuda":
        return "reference"
    return module.split(".")[0] if optional_import(module, attr) is not None else None


# ---------------------------------------------------------------------------------------------- kernels


def check_ssd(device, size) -> Row:
    backend = _backend(device, "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
    if backend is None:
        return Row("kernel ssd", "not installed", "mamba_ssm is not importable: the model runs the PyTorch reference")
    g = torch.Generator().manual_seed(0)
    batch, length, heads, headdim, groups, state = 2, size["ssd_len"], 4, 16, 1, 16
    x = torch.randn(batch, length, heads, headdim, generator=g)
    dt = torch.randn(batch, length, heads, generator=g) * 0.5
    B, C = (torch.randn(batch, length, groups, state, generator=g) for _ in range(2))
    A, D, dt_bias = -torch.rand(heads, generator=g) - 0.5, torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    leaves = [t.to(device).requires_grad_() for t in (x, dt, B, C)]
    fixed = [t.to(device) for t in (A, D, dt_bias)]
    weight = torch.randn(batch, length, heads, headdim, generator=g).to(device)

    def run(fn, *extra):
        inputs = [t.detach().requires_grad_() for t in leaves]
        y = fn(inputs[0], inputs[1], fixed[0], inputs[2], inputs[3], *extra, D=fixed[1], dt_bias=fixed[2])
        return [y, *torch.autograd.grad((y.float() * weight).sum(), inputs)]

    got, want = run(ssd_scan, 16), run(ssd_recurrent_ref)
    err = _worst(got, want)
    ok = err < 2e-2 if backend != "reference" else err < 1e-4
    return Row("kernel ssd", "ok" if ok else "FAIL",
               f"{backend} vs step-by-step recurrence, L={length}: max rel err (y, dx, ddt, dB, dC) {err:.1e}")


def check_conv(device, size) -> Row:
    backend = _backend(device, "causal_conv1d", "causal_conv1d_fn")
    if backend is None:
        return Row("kernel conv1d", "not installed", "causal_conv1d is not importable: the model runs the reference")
    g = torch.Generator().manual_seed(1)
    batch, length, channels, kernel = 2, size["conv_len"], 64, 4
    x, w, b = torch.randn(batch, length, channels, generator=g), torch.randn(channels, kernel, generator=g), torch.randn(channels, generator=g)
    weight = torch.randn(batch, length, channels, generator=g).to(device)

    def shifted_sum(x, w, b, activation):  # out[t] = b + sum_k w[:, k] x[t - (K-1) + k], zero history
        padded = F.pad(x, (0, 0, kernel - 1, 0))
        out = b + sum(w[:, k] * padded[:, k : k + x.shape[1]] for k in range(kernel))
        return F.silu(out)

    def run(fn):
        inputs = [t.to(device).requires_grad_() for t in (x, w, b)]
        y = fn(*inputs, "silu")
        return [y, *torch.autograd.grad((y * weight).sum(), inputs)]

    err = _worst(run(causal_conv1d), run(shifted_sum))
    ok = err < 1e-3 if backend != "reference" else err < 1e-5
    return Row("kernel conv1d", "ok" if ok else "FAIL",
               f"{backend} vs explicit shifted sum, L={length}: max rel err (y, dx, dw, db) {err:.1e}")


# ---------------------------------------------------------------------------------------------- attention


def training_layouts(size, device):
    """(name, kind, layout): the block objective's dual stream at the run's seq_len, and a padded prompt grid."""
    length, b = size["seq_len"], size["block"]
    x0 = torch.zeros(2, length, dtype=torch.long, device=device)
    yield f"dual stream L={length}", "causal", dual_stream(x0, x0, b, SHIFT)[1]
    mask = torch.ones(4, length, dtype=torch.long, device=device)
    for row, pad in enumerate((0, length // 8, length // 3, length // 2)):
        mask[row, :pad] = 0
    prompt = Layout.span(mask, grid=b, grid_offset=1)
    window = Layout.span(torch.ones(4, b, device=device), start=mask.sum(1), noisy=True, chunk=int(prompt.chunks.max()) + 1)
    yield f"padded prompt grid L={length}", "block_causal", Layout.cat(prompt, window)


def _qkv(batch, size, length, device, dtype):
    g = torch.Generator().manual_seed(2)
    shapes = [(batch, h, length, size["head_dim"]) for h in (size["heads"], size["kv_heads"], size["kv_heads"])]
    return [torch.randn(s, generator=g).to(device, dtype) for s in shapes]


def check_flex(name, kind, layout, device, size, dtype) -> Row:
    batch = 2 if layout.rows == 1 else layout.rows
    q, k, v = _qkv(batch, size, layout.length, device, dtype)
    sparse = block_sparse(layout, kind)
    dense = layout.attention_mask(kind)
    scale = size["head_dim"] ** -0.5
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(device, dtype)

    def run(fn, cast=dtype):
        inputs = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        out = fn(*inputs)
        return [out, *torch.autograd.grad((out * weight.to(cast)).sum(), inputs)]

    def flex(q_, k_, v_):
        return flex_attention(q_, k_, v_, sparse, scale)

    def sdpa(q_, k_, v_):
        return attention(q_, k_, v_, dense, scale)

    err = _worst(run(flex), run(sdpa, torch.float32))  # against the fp32 reference on the same (rounded) inputs
    t_flex, t_sdpa = _timed(lambda: run(flex), size["repeats"], device), _timed(lambda: run(sdpa), size["repeats"], device)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    return Row(f"flex {name}", "ok" if err < tol else "FAIL",
               f"{'torch flex' if device.type == 'cuda' else 'packed SDPA'} vs dense SDPA, {str(dtype)[6:]}, "
               f"{sparse.density:.0%} of tiles: max rel err (out, dq, dk, dv) {err:.1e}; fwd+bwd {1e3 * t_flex:.1f} ms "
               f"vs {1e3 * t_sdpa:.1f} ms ({t_sdpa / t_flex:.1f}x)")


def check_hybrid(device, size) -> Row:
    length, b = size["seq_len"], size["block"]
    config = R2LMConfig(vocab_size=64, hidden_size=size["heads"] * size["head_dim"], num_hidden_layers=1,
                        num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
                        head_dim=size["head_dim"], hybrid_layers=[0], hybrid_feature_dim=min(64, size["head_dim"]),
                        block_size=b, mask_token_id=63)
    hybrid = R2LMForDiffusionLM(config).model.layers[0].self_attn.linear_attention.to(device)
    x0 = torch.zeros(1, length, dtype=torch.long, device=device)
    layout = dual_stream(x0, x0, b, SHIFT)[1]
    q, k, v = _qkv(1, size, layout.length, device, torch.float32)
    own, earlier = layout.mask_parts("causal")
    parts = HybridParts.of(layout, "causal", b)
    scale = size["head_dim"] ** -0.5

    def run(chosen):
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out, _ = hybrid(*inputs, scale, chosen)
        return [out, *torch.autograd.grad(out.square().sum(), inputs)]

    chunked, dense = (parts,), ((own[:, None], earlier[:, None]),)
    err = _worst(run(*chunked), run(*dense))
    t_chunked = _timed(lambda: run(*chunked), size["repeats"], device)
    t_dense = _timed(lambda: run(*dense), size["repeats"], device)
    return Row("hybrid chunked", "ok" if err < 1e-4 else "FAIL",
               f"prefix-sum form vs dense, fp32, dual stream L={length}: max rel err {err:.1e}; fwd+bwd "
               f"{1e3 * t_chunked:.1f} ms vs {1e3 * t_dense:.1f} ms ({t_dense / t_chunked:.1f}x)")


# ---------------------------------------------------------------------------------------------- training


def _run(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", **(env or {})}
    out = subprocess.run(args, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"{' '.join(args[:4])} ... failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return out


def check_training(device, size, work: Path) -> Row:
    deepspeed = Path(sys.executable).parent / "deepspeed"
    if importlib.util.find_spec("deepspeed") is None or not deepspeed.is_file():  # not a kernel: no fast-path warning
        return Row("train bf16" if device.type == "cuda" else "train fp32", "not installed", "deepspeed is not importable")
    from train.tracking import read_metrics

    py = sys.executable
    _run([py, "scripts/make_corpus.py", str(work / "corpus")])
    _run([py, "scripts/make_tiny_base.py", str(work / "base"), "--text", str(work / "corpus/train.txt"),
          "--vocab-size", "512", "--hidden-size", "64", "--layers", "2"])
    _run([py, "-m", "convert", "from-hf", str(work / "base"), str(work / "r2lm"), "--sidecar-layers", "1",
          "--headdim", "16", "--expand", "1", "--block-size", "16"])
    precision = "bf16" if device.type == "cuda" else "fp32"
    steps = size["train_steps"]
    env = {} if device.type == "cuda" else {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    port = str(29500 + os.getpid() % 1000)
    _run([str(deepspeed), "--num_gpus", "1", "--master_port", port, "train/pretrain.py",
          "--config", "configs/train/tiny_cpu.yaml", f"model={work / 'r2lm'}", f"output_dir={work / 'run'}",
          f"data.train={work / 'corpus/train.txt'}", f"data.heldout={work / 'corpus/heldout.txt'}",
          f"data.cache_dir={work / 'cache'}", f"precision={precision}", f"steps={steps}", f"seq_len={size['train_seq']}",
          "log_every=1", f"eval_every={steps}", f"save_every={steps}", "export=false", "wandb.mode=disabled",
          "warmup_steps=2", "micro_batch_size=4", "grad_accum=1"], env=env, timeout=600)
    losses = [r["loss"] for r in read_metrics(work / "run")]
    evals = [r["eval_loss"] for r in read_metrics(work / "run", "eval")]  # held-out, fixed noise: step 0 and the end
    n = max(2, steps // 4)
    head, tail = statistics.mean(losses[:n]), statistics.mean(losses[-n:])
    # the per-step training loss is noisy (each step draws its own mask rates); the held-out loss is not
    ok = len(losses) == steps and all(math.isfinite(x) for x in losses + evals) and len(evals) == 2 and evals[1] < evals[0]
    return Row(f"train {precision}", "ok" if ok else "FAIL",
               f"deepspeed launcher, 1 {'GPU' if device.type == 'cuda' else 'CPU rank'}, ZeRO-2, {len(losses)} steps: "
               f"train loss {head:.3f} -> {tail:.3f} (first / last {n} steps), held-out "
               + " -> ".join(f"{x:.3f}" for x in evals))


# ---------------------------------------------------------------------------------------------- decoding


def decode_models(size, device):
    """AR (the backbone) and R2LM (the backbone plus sidecars on every 4th layer) sharing random weights."""
    fields = dict(size["decode_model"], mask_token_id=size["decode_model"]["vocab_size"] - 1, block_size=32,
                  max_position_embeddings=2048)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    r2lm = R2LMForDiffusionLM(R2LMConfig(**fields, sidecar_layers=list(range(3, fields["num_hidden_layers"], 4))))
    ar = R2LMForDiffusionLM(R2LMConfig(**fields))
    ar.load_state_dict(r2lm.state_dict(), strict=False)
    return ar.to(device, dtype).eval(), r2lm.to(device, dtype).eval()


def check_decode(device, size) -> list[Row]:
    from eval.throughput import run_one

    ar, r2lm = decode_models(size, device)
    timing = SimpleNamespace(repeats=1 if size["repeats"] == 1 else 3, measure_tokens=size["decode_tokens"],
                             new_tokens=size["decode_tokens"], diagnostic_thresholds=())
    vocab = ar.config.vocab_size - 1
    rows = []
    for batch in size["batches"]:
        prompts = torch.randint(0, vocab, (batch, size["decode_prompt"]), generator=torch.Generator().manual_seed(batch))
        prompts = prompts.to(device)
        with torch.no_grad():
            for model, options in ((ar, dict(block_size=1)), (r2lm, dict(threshold=0.9))):
                run_one(model, prompts[:, :8], SimpleNamespace(repeats=1, measure_tokens=2, new_tokens=2, diagnostic_thresholds=()), options)
            a, r = run_one(ar, prompts, timing, dict(block_size=1)), run_one(r2lm, prompts, timing, dict(threshold=0.9))
        ok = all(x["tokens_per_s"] > 0 for x in (a, r))
        rows.append(Row(f"decode batch {batch}", "ok" if ok else "FAIL",
                        f"{a['tokens_per_s']:.0f} tok/s AR vs {r['tokens_per_s']:.0f} tok/s R2LM "
                        f"({r['tokens_per_step']:.2f} tokens/step, random weights; R2LM / AR {r['tokens_per_s'] / a['tokens_per_s']:.2f}x), "
                        f"prompt {size['decode_prompt']}, {r['measured_tokens']} new tokens"))
    return rows


def check_verify(device, size) -> Row:
    """verify=True (window drafts, 2 windows, and prompt-lookup drafts) against AR greedy decoding of the backbone,
    a left-padded batch in fp32: the same tokens, whatever the kernels do with b-column forwards."""
    from r2lm import generate

    ar, r2lm = (m.float() for m in decode_models(size, device))
    with torch.no_grad():
        for layer in r2lm.model.layers:
            if layer.sidecar is not None:
                layer.sidecar.gate.fill_(0.5)  # the drafter differs from the backbone; the output must not
    vocab, n = ar.config.vocab_size - 1, size["decode_tokens"]
    ids = torch.randint(0, vocab, (4, size["decode_prompt"]), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1:, : size["decode_prompt"] // 2] = 0  # rows with left padding
    with torch.no_grad():
        want = generate(ar, ids, mask, max_new_tokens=n, block_size=1, eos_token_id=[]).sequences
        runs = {name: generate(r2lm, ids, mask, max_new_tokens=n, verify=True, eos_token_id=[], **options)
                for name, options in (("window 8:2", dict(block_size=8, verify_windows=2)),
                                      ("lookup 8", dict(block_size=8, verify_draft="lookup")))}
    same = {name: torch.equal(out.sequences, want) for name, out in runs.items()}
    return Row("verify == AR (fp32)", "ok" if all(same.values()) else "FAIL",
               ", ".join(f"{name}: {'identical' if same[name] else 'DIFFERS'}, {out.tokens_per_forward:.2f} tokens/forward"
                         for name, out in runs.items()) + f" (batch 4, left-padded, {n} new tokens, random weights)")


# ---------------------------------------------------------------------------------------------- the run


def table(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    lines = [f"{'check':<{width}}  {'status':<13}  {'s':>6}  result", "-" * (width + 100)]
    lines += [f"{r.check:<{width}}  {r.status:<13}  {r.seconds:6.1f}  {r.result}" for r in rows]
    return "\n".join(lines)


def run_checks(dry_run: bool, out: Path) -> list[Row]:
    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run for the CPU rehearsal")
    device = torch.device("cpu" if dry_run else "cuda")
    size = SIZES["dry" if dry_run else "gpu"]
    attention_dtype = torch.float32 if dry_run else torch.bfloat16
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))  # the training run's inputs and outputs, removed at the end
    checks = [("kernel ssd", lambda: check_ssd(device, size)), ("kernel conv1d", lambda: check_conv(device, size))]
    checks += [(f"flex {n}", lambda n=n, k=k, lay=lay: check_flex(n, k, lay, device, size, attention_dtype))
               for n, k, lay in training_layouts(size, device)]
    checks += [("hybrid chunked", lambda: check_hybrid(device, size)),
               ("train", lambda: check_training(device, size, work)), ("decode", lambda: check_decode(device, size)),
               ("verify", lambda: check_verify(device, size))]
    rows = []
    try:
        for name, check in checks:
            start = time.perf_counter()
            try:
                got = check()
            except Exception as err:  # one broken check must not hide the others
                logger.exception("%s failed", name)
                got = Row(name, "FAIL", f"{type(err).__name__}: {str(err)[-300:]}")
            for row in got if isinstance(got, list) else [got]:
                row.seconds = time.perf_counter() - start
                rows.append(row)
                logger.info("%s: %s", row.check, row.status)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
            "torch": torch.__version__}
    (out / "gpu_check.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run the same checks on CPU at tiny sizes")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check"), help="folder for gpu_check.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    rows = run_checks(args.dry_run, args.out)
    print(table(rows))
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
