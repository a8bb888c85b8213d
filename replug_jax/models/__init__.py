"""Models: BERT retrievers and causal LMs in Flax NNX, loaded from Hugging Face folders, hub
ids, GGUF files or the packaged offline models.

The package face: ``load_retriever``, ``load_lm``, ``load_tokenizer`` and
``export_retriever`` (:mod:`~replug_jax.models.loading`), the architectures' classes and
functions, and the defaults (:mod:`~replug_jax.models.registry`). Names are imported on first
use, so ``from replug_jax.models import DEFAULT_LM`` loads no JAX.
"""

from replug_jax.imports import exports

__getattr__, __dir__, __all__ = exports(__name__, {
    "load_retriever": "loading", "load_lm": "loading", "load_tokenizer": "loading",
    "export_retriever": "loading", "RetrieverModel": "loading", "LanguageModel": "loading",
    "BertConfig": "bert", "BertEncoder": "bert", "pool": "bert",
    "CausalLM": "decoder", "DecoderConfig": "decoder", "functional": "decoder",
    "init_cache": "decoder", "target_logprobs": "decoder", "token_logprobs": "decoder",
    "WeightsError": "registry", "DEFAULT_LM": "registry", "DEFAULT_RETRIEVER": "registry",
})
