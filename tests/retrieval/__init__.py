"""Tests of replug_jax/retrieval/."""
