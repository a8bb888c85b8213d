"""Tests of replug_jax/serve/."""
