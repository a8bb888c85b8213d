"""Tests of replug_jax/train/."""
