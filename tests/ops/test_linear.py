"""r2lm.ops.linear: the transposed order and the few-row kernel compute F.linear's product (up to float rounding);
a tuner considers them only without autograd, float32 on CPU, at most FEW_ROWS rows, and takes one only for a shape
class that measured faster (every call returns the reference's product until its class is decided). The model is
plain PyTorch until `install` applies a tuner from outside; decisions saved and loaded give the same bits in
another process."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from r2lm import generate
from r2lm.ops import linear as ops_linear
from r2lm.ops.few_rows import FLAGS, compile_kernel, kernel
from r2lm.ops.linear import FEW_ROWS, MARGIN, REFERENCE, TRIALS, TunedLinear, Tuner, install, tuner_of, uninstall
from tests.helpers import REPO
from tests.helpers.decoding import ar_greedy
from tests.helpers.models import peaky


class MatrixProducts(TorchDispatchMode):
    """The shapes of the first operand of every aten.mm / addmm / linear dispatched."""

    def __init__(self):
        super().__init__()
        self.firsts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in ("aten.mm", "aten.addmm", "aten.linear"):
            self.firsts.append(tuple((args[1] if name == "aten.addmm" else args[0]).shape))
        return func(*args, **(kwargs or {}))


KERNEL = pytest.param("kernel", marks=pytest.mark.skipif(kernel() is None, reason="the few-row kernel is not built "
                                                          "on this machine (python -m r2lm.ops.few_rows)"))


@pytest.mark.parametrize("order", ["transposed", KERNEL, "reference", "measured"])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (3, 5), (2, 8), (1, FEW_ROWS), (FEW_ROWS + 1,), (2, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_f_linear(shape, bias, order):
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(200, 24, generator=g), torch.randn(*shape, 24, generator=g)
    b = torch.randn(weight.shape[0], generator=g) if bias else None
    with torch.no_grad():
        if order == "measured":  # every call: the trials, then the decided order
            tuner = Tuner()
            outs = [tuner(x, weight, b) for _ in range(2 * TRIALS + 2)]
        else:
            outs = [Tuner(order)(x, weight, b)]
    for out in outs:
        assert out.shape == (*shape, weight.shape[0])
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def multiplied_by_the_weight(x, weight, grad: bool, tuner: Tuner) -> bool:
    """Whether the product was computed as weight @ x^T (the transposed order) rather than x @ weight^T."""
    counter = MatrixProducts()
    with torch.set_grad_enabled(grad), counter:
        tuner(x, weight)
    return bool(counter.firsts) and counter.firsts[0] == tuple(weight.shape)  # (the kernel dispatches no aten mm)


def test_the_transposed_order_is_considered_only_for_few_rows_without_autograd_in_float32():
    weight, tuner = torch.randn(200, 24), Tuner("transposed")
    assert multiplied_by_the_weight(torch.randn(1, 1, 24), weight, False, tuner)
    assert multiplied_by_the_weight(torch.randn(2, FEW_ROWS // 2, 24), weight, False, tuner)
    assert not multiplied_by_the_weight(torch.randn(FEW_ROWS + 1, 24), weight, False, tuner)  # many rows
    assert not multiplied_by_the_weight(torch.randn(1, 4, 24), weight, True, tuner)  # training: F.linear
    assert not multiplied_by_the_weight(torch.randn(1, 4, 24).double(), weight.double(), False, tuner)


@pytest.mark.parametrize("costs", [dict(transposed=50.0, kernel=80.0), dict(transposed=120.0, kernel=40.0),
                                   dict(transposed=97.0, kernel=99.0), dict(transposed=300.0, kernel=300.0)],
                         ids=["transposed fastest", "kernel fastest", "within the margin", "reference fastest"])
def test_each_class_is_decided_by_its_trials_and_returns_the_reference_until_then(monkeypatch, costs):
    """A shape class (rows, weight shape, threads) times each order TRIALS times, in turn (the kernel only where it
    is built), returning F.linear's product meanwhile (a forward's values never depend on a timing in progress);
    then the fastest median decides, another order than the reference only by MARGIN. The timer is scripted (the
    reference costs 100 us), so the decision is known whatever this machine's speed."""
    costs = {REFERENCE: 100.0, **costs}
    weight, x = torch.randn(200, 24), torch.randn(1, 3, 24)
    ticks, running = iter(range(10**6)), []

    def clock():  # start / stop pairs: a call's duration is the one scripted for the order it timed
        return 0.0 if next(ticks) % 2 == 0 else 1e-6 * costs[running[-1]]

    def timed(order, fn):
        def run(*args):
            running.append(order)
            return fn(*args)
        return run

    orders = [REFERENCE, "transposed"] + (["kernel"] if kernel() is not None else [])
    tuner = Tuner()
    monkeypatch.setattr(ops_linear.time, "perf_counter", clock)
    monkeypatch.setattr(ops_linear, "ORDERS", {o: timed(o, fn) for o, fn in ops_linear.ORDERS.items()})
    with torch.no_grad():
        for _ in range(len(orders) * TRIALS):
            assert tuner.decisions() == []
            counter = MatrixProducts()
            with counter:
                out = tuner(x, weight)
            torch.testing.assert_close(out, F.linear(x, weight), rtol=0, atol=0)  # the reference's product
    monkeypatch.undo()
    assert sorted(running) == sorted(o for o in orders for _ in range(TRIALS))  # each order, TRIALS times
    (decision,) = tuner.decisions()
    best = min(orders, key=costs.get)
    expected = best if best == REFERENCE or costs[best] < MARGIN * costs[REFERENCE] else REFERENCE
    assert decision["rows"] == 3 and decision["weight"] == [200, 24] and decision["order"] == expected
    assert decision["us"] == {o: costs[o] for o in orders}
    with torch.no_grad():
        assert multiplied_by_the_weight(x, weight, False, tuner) == (expected == "transposed")
        assert not multiplied_by_the_weight(torch.randn(1, 4, 24), weight, False, tuner)  # another class: a trial


@pytest.mark.parametrize("cache, at_once", [(1, True), (200 * 24 * 4, False), (0, False)],
                         ids=["outgrows the cache", "fits the cache", "cache unknown"])
def test_a_weight_larger_than_the_last_level_cache_is_timed_at_its_first_use(monkeypatch, cache, at_once):
    """A weight that outgrows the last-level cache streams from memory however often it is multiplied: its class
    takes every timed call at its first use (a class used once a forward would otherwise stay undecided for
    len(orders) x TRIALS forwards). One that fits, or where the cache is unknown, is timed a call at a time. The
    product returned is the reference's either way."""
    monkeypatch.setattr(ops_linear, "last_level_cache", lambda: cache)
    orders = 2 + (kernel() is not None)
    weight, x, tuner = torch.randn(200, 24), torch.randn(1, 3, 24), Tuner()
    with torch.no_grad():
        for calls in range(1, (1 if at_once else orders * TRIALS) + 1):
            assert tuner.decisions() == []
            torch.testing.assert_close(tuner(x, weight), F.linear(x, weight), rtol=0, atol=0)
            assert sum(map(len, tuner.trials[(3, 200, 24, torch.get_num_threads())].values())) == (
                orders * TRIALS if at_once else calls)
    assert len(tuner.decisions()) == 1


def test_the_last_level_cache_is_read_from_linux_cache_descriptions(tmp_path):
    for index, size in enumerate(["32K", "512K", "8192K", "1M", "garbled"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert ops_linear.last_level_cache(tmp_path) == 8192 * 1024
    assert ops_linear.last_level_cache(tmp_path / "absent") == 0


def cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


# csrc/few_rows.cpp chooses its vector and tile by the ISA it is compiled for: the AVX2 build (8 floats, 4 x 3 tiles) is
# checked here too where the CPU can run it, not only the build for the machine at hand (a CI machine with AVX-512
# would never run the AVX2 tile otherwise). Not SSE's 4-float build: each compile is a slow test's time, and the
# CPUs r2lm is meant for all have AVX2.
ISAS = {"x86-64-v3": {"avx2", "fma"}}


@pytest.fixture(scope="module", params=["native", *(pytest.param(isa, marks=pytest.mark.slow) for isa in ISAS)])
def few_rows_kernel(request, tmp_path_factory):
    """The few-row kernel: this machine's build, or one compiled for another instruction set (slow: a compile)."""
    if request.param == "native":
        if kernel() is None:
            pytest.skip("the few-row kernel is not built on this machine (python -m r2lm.ops.few_rows)")
        return kernel()
    if platform.machine() != "x86_64" or not ISAS[request.param] <= cpu_flags():
        pytest.skip(f"this CPU cannot run code compiled for {request.param}")
    flags = [f for f in FLAGS if not f.startswith(("-march=", "-mprefer-vector-width"))] + [f"-march={request.param}"]
    name = f"r2lm_few_rows_test_{request.param.replace('-', '_')}"
    return compile_kernel(name, flags, tmp_path_factory.mktemp(name))


def test_the_kernel_is_f_linear_for_every_remainder(few_rows_kernel):
    """csrc/few_rows.cpp tiles 4 weight rows x 3 or 4 input rows x 4, 8 or 16 floats (by the build's vector
    registers): every remainder of each."""
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 3, 4, 5, 7, 8, 13, 16):
        for n, k in ((4, 16), (5, 17), (203, 576), (7, 1536), (1, 3)):
            x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
            # sums of k products in another order: rounding grows like sqrt(k); a tiling mistake is off by O(1)
            torch.testing.assert_close(few_rows_kernel.few_rows(x, w), F.linear(x, w), rtol=1e-5, atol=2e-6 * k**0.5)
    with pytest.raises(RuntimeError, match="float32 only"):
        few_rows_kernel.few_rows(x.double(), w.double())


def test_the_kernel_gives_a_row_the_same_bits_whatever_the_rows_beside_it(few_rows_kernel):
    """A row's product through the kernel does not depend on how many rows are multiplied with it, nor on where the
    weight's rows fall in its tiles (the tail tile, the prefetch of the next one): a verification forward's columns
    get exactly what AR steps over the same text would, where both use the kernel. (Where the compiler chose per
    loop whether to fuse a multiply-add, on Zen 3 the tail tile's one row did not and its rows beside others did.)"""
    g = torch.Generator().manual_seed(0)
    few_rows = few_rows_kernel.few_rows
    for n, k in ((4, 16), (9, 48), (6, 21), (203, 576), (7, 1536)):  # (6, 21): a weight's and a vector's tails
        x, w = torch.randn(16, k, generator=g), torch.randn(n, k, generator=g)
        alone = torch.cat([few_rows(x[i : i + 1], w) for i in range(16)])
        for rows in range(1, 17):
            assert torch.equal(few_rows(x[:rows], w), alone[:rows]), (rows, n, k)
        assert torch.equal(few_rows(x[:3], w[1:]), alone[:3, 1:])  # the weight's rows in other tiles


def test_a_column_major_input_is_multiplied_as_rows():
    """The fast path's own output is a column-major view; fed to the next product (the MLP's down_proj), it is
    copied into rows first, so W @ x^T gets the right-hand side layout MKL is fast with (x^T column-major)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 24, generator=g)
    x = torch.randn(24, 4, generator=g).t()[None]  # [1, 4, 24], column-major
    seen = []

    class Operands(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func.overloadpacket) == "aten.mm":
                seen.append(args[1].stride())
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Operands():
        out = Tuner("transposed")(x, weight)
    assert seen == [(1, 24)]  # x^T [24, 4] column-major: x's rows contiguous
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_autocast_and_other_dtypes_keep_f_linear():
    weight, x, tuner = torch.randn(200, 24), torch.randn(1, 3, 24), Tuner("transposed")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for bias in (None, torch.randn(weight.shape[0])):
            assert tuner(x, weight, bias).dtype == F.linear(x, weight, bias).dtype == torch.bfloat16
    with torch.no_grad(), pytest.raises(RuntimeError):  # F.linear's refusal of another dtype
        tuner(x, weight, torch.randn(weight.shape[0], dtype=torch.float64))


def test_a_model_is_plain_pytorch_until_a_tuner_is_installed():
    """Issue 39 item 4: no product order is chosen inside the model. Its layers are nn.Linear; `install` turns them
    into TunedLinear in place (the same parameter objects: tied weights stay tied; state dict, gradients), and
    `uninstall` makes them plain again."""
    model = peaky(sidecar_layers=[1])
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(type(m) is torch.nn.Linear for m in layers) and tuner_of(model) is None
    keys, weights, x = model.state_dict().keys(), [m.weight for m in layers], torch.randint(0, 100, (1, 5))
    plain = model(x).logits
    tuner = install(model, Tuner("transposed"))
    assert tuner_of(model) is tuner and all(type(m) is TunedLinear and m.tuner is tuner for m in layers)
    assert model.state_dict().keys() == keys and all(m.weight is w for m, w in zip(layers, weights, strict=True))
    torch.testing.assert_close(model(x).logits, plain)  # with autograd: F.linear's products, the same graph
    model(x).logits.square().sum().backward()
    tuned = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    uninstall(model)
    assert all(type(m) is torch.nn.Linear for m in layers) and tuner_of(model) is None
    model(x).logits.square().sum().backward()
    assert any(g is not None for g in tuned)
    assert all((a is None and p.grad is None) or torch.equal(a, p.grad) for a, p in zip(tuned, model.parameters(), strict=True))


LOGITS = """
import hashlib, sys, torch
from r2lm.ops.linear import Tuner, install
from tests.helpers.models import peaky
torch.set_num_threads(1)
model, path, save = peaky(sidecar_layers=[1]), sys.argv[1], sys.argv[2] == "save"
tuner = install(model, Tuner() if save else Tuner.load(path))
ids = torch.randint(0, 100, (2, 3), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    for _ in range(4 * 8 if save else 0):  # until every class is decided
        model(ids)
    assert not tuner.undecided()
    logits = model(ids).logits
if save:
    tuner.save(path)
print(hashlib.sha256(logits.numpy().tobytes()).hexdigest(), len(tuner.decisions()))
"""


def test_two_processes_with_the_same_decisions_compute_the_same_bits(tmp_path):
    """Decided once (measured in one process and saved), the orders are reloaded by others: their logits are
    bit-identical to each other and to the measuring process's once it had decided, whatever the orders are (the
    measured ones, and every class forced onto the transposed order)."""
    path = tmp_path / "decisions.json"

    def run(mode):
        done = subprocess.run([sys.executable, "-c", LOGITS, str(path), mode], cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    measured, classes = run("save")
    assert int(classes) > 0 and run("load") == run("load") == [measured, classes]
    saved = json.loads(path.read_text())
    for decision in saved["decisions"]:
        decision["order"] = "transposed"
    path.write_text(json.dumps(saved))
    assert run("load") == run("load")


def test_decisions_from_elsewhere_are_refused_by_name(tmp_path):
    path = tmp_path / "decisions.json"
    tuner = Tuner()
    tuner.chosen[(2, 8, 4, 1)] = "transposed"
    tuner.save(path)
    assert Tuner.load(path).chosen == tuner.chosen and not list(tmp_path.glob(".*.tmp"))
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "machine": "r2lm_few_rows_0123456789abcdef"}))
    with pytest.raises(ValueError, match="made on another machine, torch or kernel build"):
        Tuner.load(path)
    path.write_text(json.dumps({**saved, "decisions": [{"rows": 2, "weight": [8, 4], "threads": 1, "order": "fast"}]}))
    with pytest.raises(ValueError, match="is not a file of r2lm.ops.linear decisions: order must be"):
        Tuner.load(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="is not a file of r2lm.ops.linear decisions"):
        Tuner.load(path)


@pytest.mark.slow  # (compiles a decode step)
@pytest.mark.skipif(kernel() is None, reason="the few-row kernel is not built on this machine")
def test_a_compiled_decode_step_keeps_the_kernel_in_its_graph():
    """Under compile=True the kernel is a torch operator (its shape function checked by torch.library.opcheck): the
    compiled step has no graph break (a plain call broke it at every product, and the pieces recompiled per layer
    until dynamo gave up), and it decodes what eager decoding does."""
    from torch._dynamo.utils import counters

    torch.library.opcheck(ops_linear.few_rows_op, (torch.randn(3, 40), torch.randn(7, 40)))
    model = peaky()
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(1))
    install(model, Tuner("kernel"))
    eager = generate(model, ids, max_new_tokens=6, block_size=1)
    torch._dynamo.reset()
    counters.clear()
    compiled = generate(model, ids, max_new_tokens=6, block_size=1, compile=True)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] > 0
    assert torch.equal(compiled.sequences, eager.sequences)


@pytest.mark.parametrize("kind", [dict(sidecar_layers=[1, 3]), dict(sidecar_layers=[1], hybrid_layers=[0, 2],
                                                                    hybrid_feature_dim=8)], ids=["r2lm", "r2lm+hybrid"])
def test_decoding_through_the_transposed_order_keeps_the_cache_exact(kind):
    """A tuner forced onto the transposed order at every row count: the column-major views it returns flow through
    attention, the KV cache, the sidecars and the LM head: cached decoding still equals the full recompute
    (invariant 2), and verify=True still equals AR decoding with sidecars off."""
    model = peaky(**kind)  # sharp distributions: several tokens per step
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(1))
    ids[:, -3:] = ids[:, 1:4]  # a repeated span: prompt lookup has drafts to offer
    counter = MatrixProducts()
    install(model, Tuner("transposed"))
    with counter:
        cached = generate(model, ids, max_new_tokens=12, block_size=4, threshold=0.6)
    assert tuple(model.lm_head.weight.shape) in counter.firsts  # the LM head took the transposed order
    assert torch.equal(cached.sequences, generate(model, ids, max_new_tokens=12, block_size=4, threshold=0.6,
                                                  use_cache=False).sequences)
    assert cached.steps < 12  # several tokens per step: the window forwards are exercised
    if not kind.get("hybrid_layers"):  # verify=True needs softmax layers
        ar = ar_greedy(model, ids, 12).sequences
        for draft in ("window", "lookup"):
            out = generate(model, ids, max_new_tokens=12, block_size=4, verify=True, verify_draft=draft,
                           eos_token_id=[])
            assert torch.equal(out.sequences, ar)


def test_a_damaged_kernel_build_is_never_loaded(tmp_path, monkeypatch, caplog):
    """Issue 40 item 6: a truncated build killed every decode with a bus error while scripts/env.sh reported a
    fallback to torch. A build is loaded only if its bytes are those that loaded and computed F.linear's products in
    a child process (its stamp); a truncated or changed library is refused with a warning, and the check itself
    fails in the child, never here."""
    from r2lm.ops import few_rows

    if kernel() is None:
        pytest.skip("the few-row kernel is not built on this machine (python -m r2lm.ops.few_rows)")
    good = few_rows.library()
    copy = tmp_path / few_rows.build_name() / good.name
    copy.parent.mkdir()
    copy.write_bytes(good.read_bytes())
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    few_rows.kernel.cache_clear()
    try:
        assert few_rows.kernel() is None and "not the build that was checked" in caplog.text  # no stamp yet
        assert few_rows.verify_build() and few_rows.stamp().is_file()
        few_rows.kernel.cache_clear()
        assert few_rows.kernel() is not None
        # truncated: a new file where the checked one was (this process has the old one mapped; truncating a mapped
        # library in place is itself a bus error at its next touched page, at exit at the latest)
        copy.unlink()
        copy.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
        few_rows.kernel.cache_clear()
        assert few_rows.kernel() is None
        assert not few_rows.verify_build() and not few_rows.stamp().exists()  # the child failed, this process lives
    finally:
        monkeypatch.undo()
        few_rows.kernel.cache_clear()
