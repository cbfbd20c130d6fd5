"""A CPU kernel for the few-row products of decoding (csrc/few_rows.cpp), built for the machine at hand.

A verification or window forward multiplies a few rows (4-16) by every weight. That is memory-bound, so it should
cost about what one row costs; BLAS's small-M paths often cost two or three times that. The kernel reads each tile
of weight rows from memory once and multiplies every input row by it from cache, prefetching the next tile as it
goes.

It is compiled once per machine (its CPU model and flags: `-march=native` code must never run on another CPU),
torch version and source, into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) by `build()` (`python -m
r2lm.ops.few_rows`, which scripts/env.sh runs; about 40 s, with a C++ compiler and ninja). `kernel()` loads that
build if there is one and never compiles: a decode step must not wait for a compiler. Without a build,
r2lm.ops.linear chooses among torch's own products.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "few_rows.cpp"
# OpenMP: at::parallel_for's threads. -ffp-contract=off: every multiply-add rounds its product, in every tile shape.
# Left to GCC, whether `acc += a * b` fuses into one FMA is decided per loop and per -mtune (on Zen 3 it avoids FMA
# chains in a loop of one accumulator, and fuses them in loops of several), so a row's product would depend on the
# rows multiplied beside it (tests/ops/test_linear.py checks it does not).
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fopenmp")


def _cpu() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def build_name() -> str:
    digest = hashlib.blake2b(digest_size=8)
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), torch.__version__.encode(), _cpu().encode()):
        digest.update(part)
    return f"r2lm_few_rows_{digest.hexdigest()}"


def build_directory() -> Path:
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(base) / build_name()


def library() -> Path:
    return build_directory() / f"{build_name()}.so"


def stamp() -> Path:
    """The build's stamp: the sha256 of a library that loaded and computed F.linear's products in a child process
    (a crash there, a bus error from a truncated file say, costs that process, never a decode)."""
    return library().with_suffix(".so.sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


CHECK = """
import sys, torch, importlib.machinery, importlib.util
name, path = sys.argv[1], sys.argv[2]
loader = importlib.machinery.ExtensionFileLoader(name, path)
module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
loader.exec_module(module)
g = torch.Generator().manual_seed(0)
for rows in (1, 3, 8):
    x, w = torch.randn(rows, 96, generator=g), torch.randn(40, 96, generator=g)
    torch.testing.assert_close(module.few_rows(x, w), torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
"""


def verify_build() -> bool:
    """Load the library in a child process and check its products against F.linear's; stamp it if they agree."""
    import subprocess
    import sys

    path = library()
    done = subprocess.run([sys.executable, "-c", CHECK, build_name(), str(path)], capture_output=True, text=True)
    if done.returncode:
        logger.warning("the few-row kernel %s does not load or compute right (%s): decoding uses torch's products",
                       path, (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1])
        stamp().unlink(missing_ok=True)
        return False
    stamp().write_text(_sha256(path) + "\n")
    return True


def compile_kernel(name: str, flags, folder: Path, verbose: bool = False):
    """Compile csrc/few_rows.cpp with these flags into `folder` and import it (`build` compiles this machine's;
    tests/ops/test_linear.py also compiles it for another instruction set)."""
    from torch.utils.cpp_extension import load

    return load(name, [str(SOURCE)], extra_cflags=list(flags), extra_ldflags=["-fopenmp"], build_directory=str(folder),
                verbose=verbose)


def build(verbose: bool = False):
    """Compile the kernel for this machine (if not compiled already), check it in a child process, and return it
    (None if the check failed)."""
    folder = build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    compile_kernel(build_name(), FLAGS, folder, verbose)
    verify_build()
    kernel.cache_clear()
    return kernel()


@functools.cache
def kernel():
    """The built kernel's module (its `few_rows(x, w)`), or None when this machine has no checked build of it: a
    library whose bytes are not the ones `build` checked (truncated, rebuilt, copied from elsewhere) is never loaded
    into this process."""
    path = library()
    if not path.is_file():
        logger.debug("no build of the few-row kernel for this machine (%s): python -m r2lm.ops.few_rows", path)
        return None
    if not stamp().is_file() or stamp().read_text().strip() != _sha256(path):
        logger.warning("the few-row kernel %s is not the build that was checked (truncated or changed since): decoding "
                       "uses torch's products; python -m r2lm.ops.few_rows rebuilds and checks it", path)
        return None
    loader = importlib.machinery.ExtensionFileLoader(build_name(), str(path))
    spec = importlib.util.spec_from_file_location(build_name(), path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m r2lm.ops.few_rows", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args()
    if build(args.verbose) is None:
        raise SystemExit(f"the build in {build_directory()} failed its check: decoding uses torch's products")
    print(f"built and checked {build_directory()}")


if __name__ == "__main__":
    main()
