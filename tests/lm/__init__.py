"""Tests of replug_jax/lm/."""
