"""Tests of replug_jax/core/."""
