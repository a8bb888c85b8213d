"""``python -m replug_jax.cli``: the ``replug`` command."""

import sys

from replug_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
