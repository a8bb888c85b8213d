import sys

from replug_jax.cli import main

sys.exit(main())
