"""Cached parallel decoding (DESIGN section 4): `generate(model, input_ids, ...)`."""

from r2lm.generation.decoding import GenerateOutput, generate

__all__ = ["GenerateOutput", "generate"]
