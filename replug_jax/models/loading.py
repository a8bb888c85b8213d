"""Loading models with their tokenizers, and writing a retriever back out.

``source`` is a local Hugging Face folder, a hub id (``facebook/contriever``, ``gpt2``,
``HuggingFaceTB/SmolLM2-135M``), a ``.gguf`` file, or a packaged offline model name
(``minilm``, ``smollm2``; the defaults). :func:`~replug_jax.models.weights.load_model` builds
the module; this module adds the tokenizer and what the rest of the package needs to know.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from replug_jax.fileio import replace_dir, write_json_atomic
from replug_jax.models.bert import BertConfig, BertEncoder, hf_name_map
from replug_jax.models.decoder import CausalLM, DecoderConfig
from replug_jax.models.registry import DEFAULT_LM, DEFAULT_RETRIEVER
from replug_jax.models.weights import (
    WeightsError,
    load_model,
    read_gguf,
    resolve,
    save_safetensors_atomic,
)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _dtype(name: str):
    """A dtype by name; ``"auto"`` is bfloat16 on GPUs and TPUs, float32 on a CPU."""
    if name == "auto":
        import jax

        name = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got "
                         f"{name!r}") from None


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


def _hf_tokenizer(directory: pathlib.Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as err:
        raise WeightsError(f"{directory}: cannot load its tokenizer ({err})") from err


def load_retriever(source: str = DEFAULT_RETRIEVER, *, pooling: str | None = None,
                   normalize: bool | None = None, dtype: str = "float32") -> RetrieverModel:
    """Load a BERT retriever (Contriever, MiniLM, any ``BertModel``) with its tokenizer.

    Pooling defaults to what the folder declares (sentence-transformers metadata), else mean
    pooling as in Contriever and REPLUG Eq. 1.
    """
    loaded = load_model(source, "retriever", dtype=_dtype(dtype))
    directory = loaded.resolved.path
    declared_pool, declared_norm = _sentence_transformers_pooling(directory)
    return RetrieverModel(loaded.module, _hf_tokenizer(directory), loaded.config,
                          pooling or declared_pool or "mean",
                          declared_norm if normalize is None else normalize,
                          loaded.resolved.name, loaded.fingerprint)


def export_retriever(retriever: RetrieverModel, out_dir: str | pathlib.Path,
                     extra_files: dict[str, str] | None = None, *,
                     dtype: str = "float32", max_length: int | None = None,
                     truncation_side: str = "right") -> pathlib.Path:
    """Write ``retriever`` in HF layout so ``transformers.BertModel.from_pretrained`` and
    ``sentence_transformers.SentenceTransformer`` load it, weights in ``dtype`` (float32 or
    float16, a release's size). ``max_length`` and ``truncation_side`` (tokens, with [CLS]
    and [SEP]; ``left`` keeps the end) are how it was trained to cut its inputs: written to
    ``sentence_bert_config.json`` and the tokenizer's config, so sentence-transformers cuts a
    long input as :class:`~replug_jax.retrieval.encoder.Retriever` does.

    Files are written to a temporary sibling folder and renamed into place, so a crash never
    leaves a half-written checkpoint under ``out_dir``.
    """
    import shutil

    if dtype not in ("float32", "float16"):
        raise ValueError(f"dtype must be float32 or float16, got {dtype!r}")
    out = pathlib.Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _, state = nnx.split(retriever.encoder)
    flat = dict(nnx.to_flat_state(state))
    tensors = {name: transform(np.asarray(flat[path][...], np.float32)).astype(dtype)
               for path, (name, transform) in hf_name_map(retriever.config).items()}
    save_safetensors_atomic(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    write_json_atomic(retriever.config.to_hf(), tmp / "config.json")
    # the fast tokenizer keeps the truncation and padding of its last call in its backend;
    # a release must not bake that in (transformers sets both again on every call)
    retriever.tokenizer.backend_tokenizer.no_truncation()
    retriever.tokenizer.backend_tokenizer.no_padding()
    if truncation_side not in ("left", "right"):
        raise ValueError(f"truncation_side must be left or right, got {truncation_side!r}")
    side = retriever.tokenizer.truncation_side
    retriever.tokenizer.truncation_side = truncation_side
    try:
        retriever.tokenizer.save_pretrained(str(tmp))
    finally:
        retriever.tokenizer.truncation_side = side
    if max_length is not None:
        write_json_atomic({"max_seq_length": int(max_length), "do_lower_case": False},
                          tmp / "sentence_bert_config.json")
        # and the tokenizer's own limit: `tokenizer(text, truncation=True)` then cuts to the
        # trained length, not the base's 512
        tok_cfg = tmp / "tokenizer_config.json"
        settings = json.loads(tok_cfg.read_text()) if tok_cfg.is_file() else {}
        write_json_atomic({**settings, "model_max_length": int(max_length)}, tok_cfg)
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


def gguf_tokenizer(path: pathlib.Path, meta: dict | None = None):
    """The GGUF's own byte-level BPE vocabulary and merges as a ``tokenizers`` tokenizer
    (no torch needed), wrapped as a transformers fast tokenizer with its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    meta = meta if meta is not None else read_gguf(path)[0]
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
    resolved = resolve(source)
    if resolved.kind == "gguf":
        return gguf_tokenizer(resolved.path)
    return _hf_tokenizer(resolved.path)


def load_lm(source: str = DEFAULT_LM, *, dtype: str = "auto", mesh=None) -> LanguageModel:
    """Load a frozen causal LM (Llama family, GPT-2, OPT) with its tokenizer, in ``dtype``
    (``"auto"``: bfloat16 on GPUs and TPUs, float32 on a CPU), sharded over ``mesh`` when
    given (each process reads only its devices' slices of the weights)."""
    loaded = load_model(source, "lm", dtype=_dtype(dtype), mesh=mesh)
    path = loaded.resolved.path
    tokenizer = (gguf_tokenizer(path, loaded.gguf_meta) if loaded.gguf_meta is not None
                 else _hf_tokenizer(path))
    return LanguageModel(loaded.module, tokenizer, loaded.config, loaded.resolved.name,
                         loaded.fingerprint)
