"""Tests of replug_jax/models/."""
