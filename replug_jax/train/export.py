"""Export a trained retriever from an LSR work directory, without loading its data or LM.

The exported folder is a ``transformers``-loadable BERT (see
:func:`replug_jax.models.export_retriever`), float16 by default, with a ``README.md`` card
(metadata, the verdict against its base under the release rule of
:mod:`replug_jax.train.release`, the weights' SHA-256, how to load it) and ``replug.json``:
the similarity and the sequence lengths the retriever was trained with, which
:meth:`replug_jax.retrieval.encoder.Retriever.load` honours, so that it is evaluated on the
views of passages and queries it was trained on.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax

from replug_jax.models import export_retriever, load_retriever
from replug_jax.models.params import split_params, to_module
from replug_jax.train.checkpoint import Checkpoints
from replug_jax.train.config import LSRConfig
from replug_jax.train.lsr import init_state


def saved_config(workdir: str | pathlib.Path) -> LSRConfig:
    path = pathlib.Path(workdir) / "config.json"
    if not path.exists():
        raise ValueError(f"{workdir}: no config.json, not an LSR work directory")
    return LSRConfig(**json.loads(path.read_text())["config"])


def retriever_settings(cfg: LSRConfig) -> dict:
    """What ``replug.json`` records: how the retriever must be used to match its training."""
    return {"similarity": cfg.similarity, "query_max_length": cfg.query_max_length,
            "doc_max_length": cfg.doc_max_length, "trained_from": cfg.retriever}


def export_run(workdir: str | pathlib.Path, out_dir: str | pathlib.Path,
               step: int | None = None, *, dtype: str = "float16",
               comparison: str | pathlib.Path | None = None,
               metric: str | None = None) -> tuple[pathlib.Path, int, dict | None]:
    """The newest checkpoint of ``workdir`` (or the one of ``step``) as a retriever folder in
    ``dtype``; with ``comparison`` (``replug eval``'s ``results.json`` of this very folder
    against its base) the card states the result and whether it passes the release rule.
    Returns ``(path, step, comparison or None)``."""
    workdir = pathlib.Path(workdir)
    cfg = saved_config(workdir)
    model = load_retriever(cfg.retriever)
    graphdef, template, params = split_params(model.encoder)
    like = init_state(params, cfg.optim_config.build(cfg.total_steps))
    step, state, _ = Checkpoints(workdir / "checkpoints", cfg.keep_checkpoints).restore(
        like, step)
    if state is None:
        raise ValueError(f"{workdir}: no checkpoint to export")
    encoder = to_module(graphdef, template, jax.device_get(state.params))
    return write_retriever(model, encoder, out_dir, cfg, step, workdir, dtype=dtype,
                           comparison=comparison, metric=metric)


def write_retriever(model, encoder, out_dir, cfg: LSRConfig, step: int,
                    workdir: str | pathlib.Path, *, dtype: str = "float16",
                    comparison: str | pathlib.Path | None = None, metric: str | None = None):
    """``model`` with the trained ``encoder`` in HF layout (weights in ``dtype``), its
    ``README.md`` card and ``replug.json``; returns ``(path, step, comparison)``. The folder
    is staged and checked before it replaces ``out_dir``: a comparison of other weights is
    refused and nothing is lost."""
    from replug_jax.fileio import replace_dir, write_text_atomic
    from replug_jax.models.weights import fingerprint, resolve, weight_files
    from replug_jax.train.release import comparison_from_eval

    workdir = pathlib.Path(workdir)
    out = pathlib.Path(out_dir)
    dev_path = workdir / "dev_metrics.json"
    dev = json.loads(dev_path.read_text()) if dev_path.exists() else None
    staged = out.with_name(out.name + ".staged")
    # one encoder for both: other libraries cut every input as passages are cut (the
    # queries' own limit, kept from the end, is in replug.json and applies in Retriever.load)
    export_retriever(dataclasses.replace(model, encoder=encoder), staged,
                     {"replug.json": json.dumps(retriever_settings(cfg), indent=2) + "\n"},
                     dtype=dtype, max_length=cfg.doc_max_length, truncation_side="right")
    try:
        tested = None if comparison is None else comparison_from_eval(
            comparison, fingerprint(weight_files(resolve(staged))), metric)
        write_text_atomic(model_card(cfg, step, dev, workdir, staged, dtype, tested,
                                     model.pooling), staged / "README.md")
    except BaseException:
        import shutil

        shutil.rmtree(staged, ignore_errors=True)
        raise
    replace_dir(staged, out)
    return out, step, tested


def write_two_towers(query, passages, out_dir: str | pathlib.Path, settings: dict, card: str,
                     *, dtype: str = "float16") -> pathlib.Path:
    """A retriever whose query tower alone was trained, as one folder: the folder itself is
    the query encoder (it loads with ``transformers.AutoModel`` and
    ``sentence_transformers.SentenceTransformer`` as any BERT), ``passage_encoder/`` the
    document encoder, and ``replug.json`` (``settings`` + ``passage_encoder``) makes
    :meth:`~replug_jax.retrieval.encoder.Retriever.load` use both. ``query`` and
    ``passages`` are :class:`~replug_jax.models.RetrieverModel` s; with cosine similarity
    both declare their normalisation, so every library's embeddings are unit vectors as
    REPLUG's are. Written atomically."""
    import shutil

    from replug_jax.fileio import replace_dir

    out = pathlib.Path(out_dir)
    tmp = out.with_name(out.name + ".two-towers")
    shutil.rmtree(tmp, ignore_errors=True)
    settings = {**settings, "passage_encoder": "passage_encoder"}
    if settings.get("similarity") == "cosine":  # other libraries then embed as REPLUG does
        query = dataclasses.replace(query, normalize=True)
        passages = dataclasses.replace(passages, normalize=True)
    # each tower cuts its inputs as it was trained to: queries to their last
    # query_max_length tokens, passages to their first doc_max_length
    export_retriever(query, tmp, {"MODEL_CARD.md": card,
                                  "replug.json": json.dumps(settings, indent=2) + "\n"},
                     dtype=dtype, max_length=settings.get("query_max_length"),
                     truncation_side=settings.get("query_truncation", "left"))
    export_retriever(passages, tmp / "passage_encoder", dtype=dtype,
                     max_length=settings.get("doc_max_length"), truncation_side="right")
    replace_dir(tmp, out)
    return out


def model_card(cfg: LSRConfig, step: int, dev: dict | None, workdir, folder: pathlib.Path,
               dtype: str, comparison: dict | None, pooling: str = "mean") -> str:
    """A release's ``README.md``: metadata, the verdict against its base (the release rule
    of :mod:`replug_jax.train.release`), how it was trained, the lengths and truncation it
    must be used with, the weights' SHA-256, and how to load it."""
    from replug_jax.train.release import verdict, weight_digests

    lines = ["---", "library_name: sentence-transformers", "pipeline_tag: sentence-similarity",
             "tags: [replug, retrieval, sentence-transformers, feature-extraction]",
             *([f"base_model: {cfg.retriever}"] if "/" in cfg.retriever
               and not pathlib.Path(cfg.retriever).exists() else []), "---", "",
             f"# REPLUG LSR retriever trained from `{cfg.retriever}` by `{cfg.lm}`", "",
             verdict(comparison), ""]
    if comparison is not None:
        lines += ["| metric | trained − base | interval | items |", "|---|---:|---|---:|",
                  *(f"| {c['metric']} | {c['difference']:+.4f} | [{c['low']:+.4f}, "
                    f"{c['high']:+.4f}] | {c['items']} |" for c in comparison["all"]), ""]
    lines += ["## Training", "",
              f"- base retriever: `{cfg.retriever}` ({cfg.similarity} similarity, "
              f"{pooling} pooling)",
              f"- supervising LM: `{cfg.lm}`"
              + (f" via {cfg.lm_api_base}" if cfg.lm_api_base else ""),
              f"- task: {cfg.task}; data: `{cfg.data}`; corpus: `{cfg.corpus}`",
              f"- steps: {step} of {cfg.total_steps}; batch {cfg.batch_size}; k={cfg.k}; "
              f"γ={cfg.gamma}, β={cfg.beta}; {cfg.direction}; LM score {cfg.lm_score}; "
              f"objective {cfg.objective}; {cfg.optimizer} lr {cfg.learning_rate}",
              f"- index refresh every {cfg.refresh_every} steps ({cfg.refresh_mode})",
              f"- trained in `{workdir}`", "",
              "## Lengths and truncation", "",
              f"Queries keep their last {cfg.query_max_length} tokens; passages their first "
              f"{cfg.doc_max_length} (with [CLS] and [SEP]). `Retriever.load` applies both "
              "(from `replug.json`); sentence-transformers and the tokenizer here cut every "
              f"input to its first {cfg.doc_max_length} tokens, as passages are cut.", "",
              f"## Weights ({dtype})", "",
              *(f"- `{name}`: SHA-256 `{digest}`"
                for name, digest in weight_digests(folder).items()), "",
              "## Use", "", "```python",
              "from replug_jax.retrieval.encoder import Retriever",
              "retriever = Retriever.load(\"<this folder>\")  # lengths from replug.json", "",
              "from sentence_transformers import SentenceTransformer",
              "model = SentenceTransformer(\"<this folder>\")"
              + ("  # unit vectors: cosine = dot" if cfg.similarity == "cosine" else ""),
              "embeddings = model.encode([\"a passage\", \"a question?\"])", "",
              "from transformers import AutoModel, AutoTokenizer",
              "tok = AutoTokenizer.from_pretrained(\"<this folder>\")",
              "bert = AutoModel.from_pretrained(\"<this folder>\")",
              "batch = tok([\"a passage\"], padding=True, truncation=True, "
              f"max_length={cfg.doc_max_length}, return_tensors=\"pt\")",
              *(["mask = batch[\"attention_mask\"].unsqueeze(-1)",
                 "vec = (bert(**batch).last_hidden_state * mask).sum(1) / mask.sum(1)"]
                if pooling == "mean" else
                ["vec = bert(**batch).last_hidden_state[:, 0]  # [CLS] pooling"]),
              *(["vec = vec / vec.norm(dim=-1, keepdim=True)  # cosine similarity"]
                if cfg.similarity == "cosine" else []),
              "```", "", "## Dev metrics", "", "```json", json.dumps(dev or {}, indent=2),
              "```", "", "## Config", "", "```json", json.dumps(cfg.to_json(), indent=2),
              "```"]
    return "\n".join(lines) + "\n"


TEMPERATURE_SECTION = "## Inference temperature"


def record_temperature(folder: str | pathlib.Path, temperature: float, evidence: dict,
                       summary: str) -> None:
    """Store a fitted inference τ with an exported retriever: ``replug.json`` gains
    ``temperature`` (which :class:`~replug_jax.replug.Replug` then uses by default) and
    ``temperature_fit`` (``evidence``: data, bounds, dev log-likelihoods), and the model card
    gains (or has replaced) an "Inference temperature" section holding ``summary``."""
    from replug_jax.fileio import write_text_atomic

    folder = pathlib.Path(folder)
    settings_path = folder / "replug.json"
    if not settings_path.is_file():
        raise ValueError(f"{folder}: no replug.json, not a retriever exported by replug-jax")
    if not temperature > 0:
        raise ValueError(f"the retrieval temperature must be > 0, got {temperature}")
    settings = json.loads(settings_path.read_text())
    settings.update(temperature=float(temperature), temperature_fit=evidence)
    write_text_atomic(json.dumps(settings, indent=2) + "\n", settings_path)
    card_path = folder / "README.md"  # an export's card; checkpoints/ folders keep MODEL_CARD.md
    if not card_path.exists() and (folder / "MODEL_CARD.md").exists():
        card_path = folder / "MODEL_CARD.md"
    card = card_path.read_text() if card_path.exists() else "# Retriever\n"
    if TEMPERATURE_SECTION in card:  # replace the old section, up to the next one
        head, _, rest = card.partition(TEMPERATURE_SECTION)
        nxt = rest.find("\n## ")
        card = head + (rest[nxt + 1:] if nxt >= 0 else "")
    card = card.rstrip("\n") + f"\n\n{TEMPERATURE_SECTION}\n\n{summary.strip()}\n"
    write_text_atomic(card, card_path)
