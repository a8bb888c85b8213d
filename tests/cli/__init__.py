"""Tests of replug_jax/cli/."""
