"""Continued pretraining of R2LM models (docs/design.md section 3): `train/pretrain.py` is the DeepSpeed entry point,
`train/data.py` the tokenise-and-pack data pipeline, `train/config.py` the training configuration."""
