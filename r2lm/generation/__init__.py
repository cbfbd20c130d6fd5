"""Cached parallel decoding (DESIGN section 4): `generate(model, input_ids, ...)`, or `model.generate(...)`."""

from r2lm.generation.decoding import GenerateOutput, StepInfo, generate
from r2lm.generation.diagnostics import ParallelismMeter

__all__ = ["GenerateOutput", "ParallelismMeter", "StepInfo", "generate"]
