"""Models: BERT retrievers and causal LMs in Flax NNX, loaded from Hugging Face folders, hub
ids, GGUF files or the packaged offline models.

The package face: ``load_retriever``, ``load_lm``, ``load_tokenizer`` and
``export_retriever`` (:mod:`~replug_jax.models.loading`), the architectures' classes and
functions, and the defaults (:mod:`~replug_jax.models.registry`). Names are imported on first
use, so ``from replug_jax.models import DEFAULT_LM`` loads no JAX.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "load_retriever": "loading", "load_lm": "loading", "load_tokenizer": "loading",
    "export_retriever": "loading", "RetrieverModel": "loading", "LanguageModel": "loading",
    "BertConfig": "bert", "BertEncoder": "bert", "pool": "bert",
    "CausalLM": "decoder", "DecoderConfig": "decoder", "functional": "decoder",
    "init_cache": "decoder", "target_logprobs": "decoder", "token_logprobs": "decoder",
    "WeightsError": "registry", "DEFAULT_LM": "registry", "DEFAULT_RETRIEVER": "registry",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'replug_jax.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"replug_jax.models.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
