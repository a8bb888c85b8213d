"""replug-jax: REPLUG (Shi et al., NAACL 2024) in JAX.

The pure math lives in :mod:`replug_jax.core`; models, retrieval, LM scorers, the pipeline
and training are thin shells around it.
"""

import os as _os

# transformers prints an advisory "PyTorch was not found" banner at import, which reads like an
# error; this project uses transformers only for tokenizers and configs. Advisory notices only:
# real warnings still show. Set TRANSFORMERS_NO_ADVISORY_WARNINGS= (empty) to see them.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"
