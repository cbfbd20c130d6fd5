"""Continued pretraining of R2LM models (docs/design.md section 3): `train/pretrain.py` is the DeepSpeed entry point,
`train/checks.py` its checks before any work, `train/trainer.py` the run's steps, `train/data.py` the
tokenise-and-pack data pipeline (over the sources of `train/sources.py`), `train/config.py` the training configuration."""
