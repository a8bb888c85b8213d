"""The test suite: one folder per package of replug_jax, as nanodo pairs train.py with its
test; shared builders in helpers.py and conftest.py."""
