"""Data preparation: the experiments' datasets written from ../shared/data (``python -m
experiments.prepare.<name>``)."""
