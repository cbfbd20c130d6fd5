"""Lazy imports of the optional CUDA packages. Nothing here runs at import time of r2lm."""

import functools
import importlib
import logging

logger = logging.getLogger(__name__)


@functools.cache
def optional_import(module: str, attr: str):
    """`module.attr` if the package imports, else None. Called on the first CUDA tensor, never on CPU."""
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as err:  # a missing package, or a CUDA extension that fails to load
        logger.info("fast path %s.%s unavailable (%s); using the PyTorch reference", module, attr, err)
        return None
