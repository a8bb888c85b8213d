"""replug-jax: REPLUG (Shi et al., NAACL 2024) in JAX.

The pure math lives in :mod:`replug_jax.core`; models, retrieval, LM scorers, the pipeline
and training are thin shells around it.
"""

import os as _os

# transformers prints an advisory "PyTorch was not found" banner at import, which reads like an
# error; this project uses transformers only for tokenizers and configs. Advisory notices only:
# real warnings still show. Set TRANSFORMERS_NO_ADVISORY_WARNINGS= (empty) to see them.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def _xla_cpu_defaults() -> None:
    """Route XLA:CPU's matmuls to its YNNPACK kernels, measured faster on CPU
    (``benches/README.md``: MiniLM encode +22 %, SmolLM2 forward +12 % on 2 AVX2 cores).

    Only on the jaxlib releases it was verified with: XLA aborts the process on a flag it does
    not know, and the flag is experimental. A flag already in ``XLA_FLAGS`` wins; set
    ``REPLUG_XLA_CPU_DEFAULTS=0`` to keep XLA's own defaults. It must be set before JAX starts
    its CPU backend, so it takes effect when ``replug_jax`` is imported before any JAX
    computation runs. It touches only the CPU backend.
    """
    from importlib.metadata import PackageNotFoundError, version

    flag = "--xla_cpu_experimental_ynn_fusion_type"
    current = _os.environ.get("XLA_FLAGS", "")
    if _os.environ.get("REPLUG_XLA_CPU_DEFAULTS", "1") == "0" or flag in current:
        return
    try:
        release = tuple(int(x) for x in version("jaxlib").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return
    if release in _YNN_VERIFIED:
        _os.environ["XLA_FLAGS"] = f"{current} {flag}=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT".strip()


_YNN_VERIFIED = {(0, 10)}  # jaxlib (major, minor) releases the flag was measured on
_xla_cpu_defaults()

__version__ = "0.1.0"
