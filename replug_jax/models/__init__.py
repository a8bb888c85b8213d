"""Model entry points: ``load_retriever(source)`` and ``load_lm(source)``.

``source`` is a local Hugging Face folder, a hub id (``facebook/contriever``, ``gpt2``,
``HuggingFaceTB/SmolLM2-135M``), a ``.gguf`` file, or a packaged offline model name
(``minilm``, ``smollm2``; the defaults).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from replug_jax.models import gpt2, llama
from replug_jax.models.bert import BertConfig, BertEncoder, pool
from replug_jax.models.decoder import (
    CausalLM,
    DecoderConfig,
    functional,
    init_cache,
    target_logprobs,
    token_logprobs,
)
from replug_jax.fileio import replace_dir, write_json_atomic
from replug_jax.models.weights import (
    DEFAULT_LM,
    DEFAULT_RETRIEVER,
    WeightsError,
    fingerprint,
    load_into,
    read_config,
    read_gguf,
    read_hf_tensors,
    resolve,
    save_safetensors_atomic,
    weight_files,
)

__all__ = [
    "load_retriever", "load_lm", "load_tokenizer", "export_retriever", "RetrieverModel",
    "LanguageModel", "BertConfig", "BertEncoder", "CausalLM", "DecoderConfig", "WeightsError",
    "functional", "init_cache", "target_logprobs", "token_logprobs", "pool", "DEFAULT_LM",
    "DEFAULT_RETRIEVER",
]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _dtype(name: str):
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


@dataclasses.dataclass
class RetrieverModel:
    """A BERT encoder, its tokenizer and how it pools (paper §3.1)."""

    encoder: BertEncoder
    tokenizer: Any  # a transformers fast tokenizer
    config: BertConfig
    pooling: str = "mean"
    normalize: bool = False
    source: str = ""
    fingerprint: str = ""


@dataclasses.dataclass
class LanguageModel:
    """A causal LM, its tokenizer and identity (frozen: never trained here)."""

    model: CausalLM
    tokenizer: Any
    config: DecoderConfig
    source: str = ""
    fingerprint: str = ""


# -- retriever ---------------------------------------------------------------------------

def _bert_name_map(cfg: BertConfig) -> dict:
    def t(w):
        return w.T.copy()

    def same(w):
        return w

    m = {("word_embed", "embedding"): ("embeddings.word_embeddings.weight", same),
         ("pos_embed", "embedding"): ("embeddings.position_embeddings.weight", same),
         ("type_embed", "embedding"): ("embeddings.token_type_embeddings.weight", same),
         ("embed_norm", "scale"): ("embeddings.LayerNorm.weight", same),
         ("embed_norm", "bias"): ("embeddings.LayerNorm.bias", same)}
    if cfg.has_pooler:
        m[("pooler", "kernel")] = ("pooler.dense.weight", t)
        m[("pooler", "bias")] = ("pooler.dense.bias", same)
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        for ours, theirs in (("query", "attention.self.query"), ("key", "attention.self.key"),
                             ("value", "attention.self.value"),
                             ("attn_out", "attention.output.dense"),
                             ("intermediate", "intermediate.dense"), ("output", "output.dense")):
            m[("layers", i, ours, "kernel")] = (p + theirs + ".weight", t)
            m[("layers", i, ours, "bias")] = (p + theirs + ".bias", same)
        for ours, theirs in (("attn_norm", "attention.output.LayerNorm"),
                             ("output_norm", "output.LayerNorm")):
            m[("layers", i, ours, "scale")] = (p + theirs + ".weight", same)
            m[("layers", i, ours, "bias")] = (p + theirs + ".bias", same)
    return m


def _normalise_bert_names(tensors: dict) -> dict:
    out = {}
    for name, arr in tensors.items():
        if name.startswith("bert."):
            name = name[len("bert."):]
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
            "LayerNorm.beta", "LayerNorm.bias")
        out[name] = arr
    return out


def _bert_ignored(name: str) -> bool:
    # MLM / NSP heads of BertForPreTraining checkpoints, and the position_ids buffer.
    return name.startswith("cls.") or name.endswith("position_ids")


def _sentence_transformers_pooling(directory: pathlib.Path) -> tuple[str | None, bool]:
    """Pooling and normalisation declared by a sentence-transformers folder, if any."""
    pooling, normalize = None, False
    pool_cfg = directory / "1_Pooling" / "config.json"
    if pool_cfg.exists():
        cfg = json.loads(pool_cfg.read_text())
        pooling = "cls" if cfg.get("pooling_mode_cls_token") else "mean"
    modules = directory / "modules.json"
    if modules.exists():
        normalize = any("Normalize" in m.get("type", "") for m in json.loads(modules.read_text()))
    return pooling, normalize


def load_retriever(source: str = DEFAULT_RETRIEVER, *, pooling: str | None = None,
                   normalize: bool | None = None, dtype: str = "float32") -> RetrieverModel:
    """Load a BERT retriever (Contriever, MiniLM, any ``BertModel``) with its tokenizer.

    Pooling defaults to what the folder declares (sentence-transformers metadata), else mean
    pooling as in Contriever and REPLUG Eq. 1.
    """
    from transformers import AutoTokenizer

    resolved = resolve(source)
    if resolved.kind != "hf_dir":
        raise WeightsError(f"{resolved.path}: a retriever must be a Hugging Face BERT folder")
    directory = resolved.path
    hf = read_config(directory)
    tensors = _normalise_bert_names(read_hf_tensors(directory))
    cfg = BertConfig.from_hf(hf, has_pooler="pooler.dense.weight" in tensors)
    encoder = load_into(lambda rngs: BertEncoder(cfg, dtype=_dtype(dtype), rngs=rngs),
                        _bert_name_map(cfg), tensors, file=str(directory), dtype=_dtype(dtype),
                        ignore=_bert_ignored)
    declared_pool, declared_norm = _sentence_transformers_pooling(directory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as err:
        raise WeightsError(f"{directory}: cannot load its tokenizer ({err})") from err
    return RetrieverModel(encoder, tokenizer, cfg, pooling or declared_pool or "mean",
                          declared_norm if normalize is None else normalize, resolved.name,
                          fingerprint(weight_files(resolved)))


def export_retriever(retriever: RetrieverModel, out_dir: str | pathlib.Path,
                     extra_files: dict[str, str] | None = None) -> pathlib.Path:
    """Write ``retriever`` in HF layout so ``transformers.BertModel.from_pretrained`` loads it.

    Files are written to a temporary sibling folder and renamed into place, so a crash never
    leaves a half-written checkpoint under ``out_dir``.
    """
    import shutil

    out = pathlib.Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _, state = nnx.split(retriever.encoder)
    flat = dict(nnx.to_flat_state(state))
    tensors = {}
    for path, (name, transform) in _bert_name_map(retriever.config).items():
        tensors[name] = transform(np.asarray(flat[path][...], np.float32))  # -> HF layout
    save_safetensors_atomic(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    write_json_atomic(retriever.config.to_hf(), tmp / "config.json")
    retriever.tokenizer.save_pretrained(str(tmp))
    pool_dir = tmp / "1_Pooling"
    pool_dir.mkdir()
    write_json_atomic({"word_embedding_dimension": retriever.config.hidden_size,
                       "pooling_mode_mean_tokens": retriever.pooling == "mean",
                       "pooling_mode_cls_token": retriever.pooling == "cls"},
                      pool_dir / "config.json")
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if retriever.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    write_json_atomic(modules, tmp / "modules.json")
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    replace_dir(tmp, out)
    return out


# -- language models -----------------------------------------------------------------------

def _gguf_tokenizer(path: pathlib.Path):
    """The GGUF's own byte-level BPE vocabulary and merges as a ``tokenizers`` tokenizer
    (no torch needed), wrapped as a transformers fast tokenizer with its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    meta, _ = read_gguf(path)
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise WeightsError(f"{path}: tokenizer model {meta.get('tokenizer.ggml.model')!r} is "
                           "not supported (supported: byte-level BPE, 'gpt2')")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                     byte_fallback=False)
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                use_regex=True)
    tk.decoder = decoders.ByteLevel()
    # Token types 3 (control) and 4 (user-defined) are special tokens, never merged.
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty in (3, 4)])

    def tok_id(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=tok_id("bos"), eos_token=tok_id("eos"),
        unk_token=tok_id("unknown"), pad_token=tok_id("padding"),
        chat_template=meta.get("tokenizer.chat_template"))


def load_tokenizer(source: str):
    """Only the tokenizer of a model source (HF folder, hub id, .gguf, packaged name)."""
    from transformers import AutoTokenizer

    resolved = resolve(source)
    if resolved.kind == "gguf":
        return _gguf_tokenizer(resolved.path)
    try:
        return AutoTokenizer.from_pretrained(str(resolved.path))
    except Exception as err:
        raise WeightsError(f"{resolved.path}: cannot load its tokenizer ({err})") from err


def load_lm(source: str = DEFAULT_LM, *, dtype: str = "float32") -> LanguageModel:
    """Load a frozen causal LM (Llama family or GPT-2) with its tokenizer."""
    from transformers import AutoTokenizer

    resolved = resolve(source)
    dt = _dtype(dtype)
    if resolved.kind == "gguf":
        meta, tensors = read_gguf(resolved.path)
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise WeightsError(f"{resolved.path}: GGUF architecture {arch!r} is not supported "
                               "(supported: 'llama')")
        if "rope_freqs.weight" in tensors:
            raise WeightsError(f"{resolved.path}: per-frequency RoPE factors (rope_freqs, as in "
                               "Llama 3.1+ GGUF files) are not supported; load the Hugging "
                               "Face folder instead, whose 'llama3' RoPE scaling is")
        cfg = llama.config_from_gguf(meta, set(tensors))
        name_map = llama.gguf_name_map(cfg)
        ignore = (lambda n: False)  # noqa: E731
        tokenizer = _gguf_tokenizer(resolved.path)
    else:
        directory = resolved.path
        hf = read_config(directory)
        model_type = hf.get("model_type")
        tensors = read_hf_tensors(directory)
        if model_type in llama.LLAMA_MODEL_TYPES:
            cfg = llama.config_from_hf(hf)
            name_map = llama.hf_name_map(cfg)
            ignore = (lambda n: n.endswith("rotary_emb.inv_freq")  # noqa: E731
                      or (cfg.tie_embeddings and n == "lm_head.weight"))
        elif model_type == "gpt2":
            cfg = gpt2.config_from_hf(hf)
            tensors = {k[len("transformer."):] if k.startswith("transformer.") else k: v
                       for k, v in tensors.items()}
            name_map = gpt2.hf_name_map(cfg)
            ignore = (lambda n: n.endswith(gpt2.IGNORED_HF_TENSORS)  # noqa: E731
                      or n == "lm_head.weight")
        else:
            raise WeightsError(f"{directory / 'config.json'}: unsupported architecture "
                               f"model_type={model_type!r} (supported: "
                               f"{', '.join(llama.LLAMA_MODEL_TYPES)}, gpt2)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(directory))
        except Exception as err:
            raise WeightsError(f"{directory}: cannot load its tokenizer ({err})") from err
    model = load_into(lambda rngs: CausalLM(cfg, dtype=dt, rngs=rngs), name_map, tensors,
                      file=str(resolved.path), dtype=dt, ignore=ignore)
    return LanguageModel(model, tokenizer, cfg, resolved.name,
                         fingerprint(weight_files(resolved)))
