"""replug-jax: REPLUG (Shi et al., NAACL 2024) in JAX.

The pure math lives in :mod:`replug_jax.core`; models, retrieval, LM scorers, the pipeline
and training are thin shells around it.
"""

__version__ = "0.1.0"
