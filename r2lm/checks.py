"""Value checks shared by the option groups of a generate() call (r2lm.generation.options) and the unmasking rules
(r2lm.unmasking): each raises a ValueError that names the option. Outside r2lm.generation so that the rule table,
which the checkpoint writers read through r2lm.generation_config, reaches nothing of the generator."""

from __future__ import annotations

import math
import numbers


def real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def token_list(name: str, ids, vocab_size: int) -> list[int]:
    ids = [] if ids is None else [ids] if isinstance(ids, numbers.Integral) else list(ids)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < vocab_size:
            raise ValueError(f"{name} {i!r} is not a token id in the vocabulary [0, {vocab_size})")
    return [int(i) for i in ids]
