"""The optional CUDA packages: lazy imports, and the seam that decides when an op asks for them.

r2lm.ops dispatches to mamba_ssm / causal_conv1d for CUDA tensors only (`wants_fast_path`); `force_fast_path()`
sends tensors on any device down that branch. Nothing here runs at import time of r2lm.

Debugging the fast path without a GPU: with `TRITON_INTERPRET=1` set before mamba_ssm's Triton modules are
imported, its kernels run on CPU tensors in Triton's interpreter, so

    with force_fast_path():
        y = ssd_scan(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, reverse=True)

runs exactly the code a GPU runs around the kernel (argument order, flips, dt_bias and softplus, layouts).
tests/ops/test_fast_paths.py does this, with the few shims a CPU-only install needs (it loads the Triton modules
without mamba_ssm's package `__init__`, which imports its CUDA extension). On a GPU, CUDA tensors take the fast
path anyway, and a package that is installed but cannot be imported is reported by a RuntimeWarning.
"""

import contextlib
import functools
import importlib
import importlib.util
import logging
import warnings

logger = logging.getLogger(__name__)

_forced = False  # a plain module global: torch.compile guards on it (a ContextVar would break the graph)


@contextlib.contextmanager
def force_fast_path():
    """Inside this block, r2lm.ops takes the CUDA packages' branch for tensors on any device (see the module
    docstring): a debugging and testing seam, never needed on a GPU."""
    global _forced
    previous, _forced = _forced, True
    try:
        yield
    finally:
        _forced = previous


def wants_fast_path(x) -> bool:
    """Whether an op on tensor x asks for its CUDA package: x is on CUDA, or the call is inside force_fast_path()."""
    return x.is_cuda or _forced


@functools.cache
def optional_import(module: str, attr: str):
    """`module.attr` if the package imports, else None. Called on the first tensor that asks for a fast path.

    A package that is absent is the ordinary CPU case (logged at INFO). One that is installed and still does not
    import (mamba-ssm built without its CUDA extension, a build for another torch or CUDA) is warned about, once:
    the op runs its PyTorch reference instead, many times slower on a GPU, and nothing else would show it."""
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as err:  # a missing package, or a CUDA extension that fails to load
        package = module.partition(".")[0]
        if _installed(package):
            warnings.warn(
                f"{package} is installed but {module}.{attr} cannot be imported ({type(err).__name__}: {err}); "
                f"r2lm runs the PyTorch reference instead, many times slower on a GPU. Reinstall {package} built "
                "for this machine's torch and CUDA (pip install -e '.[gpu]') to use the kernel.",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            logger.info("fast path %s.%s unavailable (%s); using the PyTorch reference", module, attr, err)
        return None


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a package blocked in sys.modules, or a half-imported one
        return False
