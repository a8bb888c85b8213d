"""Tests of replug_jax/eval/."""
