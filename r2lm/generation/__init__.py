"""Cached parallel decoding (docs/design.md section 4): `generate(model, input_ids, ...)`, or `model.generate(...)`."""

from r2lm.generation.decoding import generate
from r2lm.generation.diagnostics import ParallelismMeter
from r2lm.generation.outputs import GenerateOutput, StepInfo

__all__ = ["GenerateOutput", "ParallelismMeter", "StepInfo", "generate"]
