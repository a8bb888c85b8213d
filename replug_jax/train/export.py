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
import jax.numpy as jnp

from replug_jax.models import export_retriever, load_retriever
from replug_jax.models.params import split_params, to_module
from replug_jax.retrieval import fitted_tau
from replug_jax.train.checkpoint import Checkpoints
from replug_jax.train.config import LSRConfig, RetrieverConfig
from replug_jax.train.lsr import build_tx, encoder_params, init_state
from replug_jax.train.selection import Curve


def saved_config(workdir: str | pathlib.Path) -> LSRConfig:
    path = pathlib.Path(workdir) / "config.json"
    if not path.exists():
        raise ValueError(f"{workdir}: no config.json, not an LSR work directory")
    return LSRConfig.from_record(json.loads(path.read_text())["config"])


def retriever_settings(retriever: RetrieverConfig) -> dict:
    """What ``replug.json`` records: how the retriever must be used to match its training."""
    return {"similarity": retriever.similarity, "query_max_length": retriever.query_max_length,
            "doc_max_length": retriever.doc_max_length, "trained_from": retriever.name}


def export_run(workdir: str | pathlib.Path, out_dir: str | pathlib.Path,
               step: int | None = None, *, dtype: str = "float16",
               comparison: str | pathlib.Path | None = None, metric: str | None = None,
               mode: str = "replug", lead: str | None = None
               ) -> tuple[pathlib.Path, int, dict | None]:
    """The retriever of ``workdir`` as a folder in ``dtype``: the step its dev selection
    kept (a run with ``selection.metric``), else the newest checkpoint, or the checkpoint of
    ``step``; with ``comparison`` (``replug eval``'s ``results.json`` of this very folder
    against its base) the card states the result and whether it passes the release rule.
    A run that trained the query tower alone (``supervision.towers="query"``) is written as
    two towers; ``lead``: a study's own result, which then leads the card in place of the
    comparison. Returns ``(path, step, comparison or None)``."""
    workdir = pathlib.Path(workdir)
    cfg = saved_config(workdir)
    check_export_target(out_dir, workdir)
    model = load_retriever(cfg.retriever.name)
    graphdef, template, params = split_params(model.encoder)
    objective = cfg.objective
    like = ({"encoder": params, "log_gamma": jnp.zeros((), jnp.float32)}
            if objective.learns_gamma else params)
    if step is None and (workdir / "best.json").exists():
        entry, kept = Curve(workdir, None).best(like)
        step, trained = int(entry["step"]), encoder_params(kept)
    else:
        state_like = init_state(like, build_tx(cfg.optim, objective, cfg.total_steps))
        step, state, _ = Checkpoints(workdir / "checkpoints", cfg.keep_checkpoints).restore(
            state_like, step)
        if state is None:
            raise ValueError(f"{workdir}: no checkpoint to export")
        trained = encoder_params(jax.device_get(state.params))
    encoder = to_module(graphdef, template, trained)
    return write_retriever(model, encoder, out_dir, cfg, step, workdir, dtype=dtype,
                           comparison=comparison, metric=metric, mode=mode, lead=lead)


def check_export_target(out_dir: str | pathlib.Path, workdir: str | pathlib.Path) -> None:
    """Refuse, before any work, an ``out_dir`` whose replacement would lose work: the work
    directory itself or a folder holding it, a file, or an existing folder that is not a
    retriever exported by replug-jax (no ``replug.json``)."""
    out, work = pathlib.Path(out_dir).resolve(), pathlib.Path(workdir).resolve()
    if out == work or out in work.parents:
        raise ValueError(f"--out {out_dir} is, or holds, the work directory {workdir}: "
                         "exporting there would delete the run; name another folder")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out_dir} is a file; name a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "replug.json").is_file():
        raise ValueError(f"--out {out_dir} is a folder that is not a retriever exported by "
                         "replug-jax (no replug.json): it would be replaced; name a new or "
                         "an exported folder")


def write_retriever(model, encoder, out_dir, cfg: LSRConfig, step: int,
                    workdir: str | pathlib.Path, *, dtype: str = "float16",
                    comparison: str | pathlib.Path | None = None, metric: str | None = None,
                    mode: str = "replug", lead: str | None = None):
    """``model`` with the trained ``encoder`` in HF layout (weights in ``dtype``; two towers
    when only the query tower was trained), its ``README.md`` card and ``replug.json``;
    returns ``(path, step, comparison)``. The folder is staged and checked before it
    replaces ``out_dir``: a comparison of other weights is refused and nothing is lost. A τ
    that ``replug fit-tau --store retriever`` recorded in ``out_dir`` for the same weights
    is kept (a re-export with a comparison keeps its fit)."""
    from replug_jax.fileio import replace_dir, write_text_atomic
    from replug_jax.models.weights import fingerprint, resolve, weight_files
    from replug_jax.train.release import comparison_from_eval

    check_export_target(out_dir, workdir)
    workdir = pathlib.Path(workdir)
    out = pathlib.Path(out_dir)
    dev_path = workdir / "dev_metrics.json"
    dev = json.loads(dev_path.read_text()) if dev_path.exists() else None
    staged = out.with_name(out.name + ".staged")
    trained = dataclasses.replace(model, encoder=encoder)
    _stage(trained, model if cfg.supervision.towers == "query" else None, staged,
           retriever_settings(cfg.retriever), dtype)
    try:
        weights = fingerprint(weight_files(resolve(staged)))
        tested = None if comparison is None else comparison_from_eval(
            comparison, weights, metric, base_fingerprint=model.fingerprint or None,
            mode=mode)
        write_text_atomic(model_card(cfg, step, dev, workdir, staged, dtype, tested,
                                     model.pooling, lead), staged / "README.md")
        _keep_temperature(out, staged, weights)
    except BaseException:
        import shutil

        shutil.rmtree(staged, ignore_errors=True)
        raise
    replace_dir(staged, out)
    return out, step, tested


def _stage(trained, base, folder: pathlib.Path, settings: dict, dtype: str,
           files: dict | None = None) -> None:
    """Write ``trained`` into ``folder`` (replaced): one encoder for queries and passages,
    or with ``base`` two towers (``trained`` the query tower at the top, ``base`` in
    ``passage_encoder/``, named in ``replug.json``). Each tower cuts inputs as it was
    trained to: queries to their last ``query_max_length`` tokens, passages to their first
    ``doc_max_length``; with one encoder, other libraries cut every input as passages are
    cut (the queries' own limit is in ``replug.json`` and applies in ``Retriever.load``)."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    if base is None:
        export_retriever(trained, folder, {**(files or {}), "replug.json": json.dumps(
            settings, indent=2) + "\n"}, dtype=dtype, max_length=settings.get(
            "doc_max_length"), truncation_side="right")
        return
    settings = {**settings, "passage_encoder": "passage_encoder"}
    if settings.get("similarity") == "cosine":  # other libraries then embed as REPLUG does
        trained = dataclasses.replace(trained, normalize=True)
        base = dataclasses.replace(base, normalize=True)
    export_retriever(trained, folder, {**(files or {}),
                                       "replug.json": json.dumps(settings, indent=2) + "\n"},
                     dtype=dtype, max_length=settings.get("query_max_length"),
                     truncation_side=settings.get("query_truncation", "left"))
    export_retriever(base, folder / "passage_encoder", dtype=dtype,
                     max_length=settings.get("doc_max_length"), truncation_side="right")


def _keep_temperature(out: pathlib.Path, staged: pathlib.Path, weights: str) -> None:
    """Carry ``out``'s recorded τ (``replug.json`` and the card's section) into ``staged``
    when both hold the same weights; else say that a τ fitted for other weights is dropped."""
    from replug_jax.models.weights import fingerprint, resolve, weight_files

    old_path = out / "replug.json"
    if not old_path.is_file():
        return
    old = fitted_tau.in_settings(json.loads(old_path.read_text()))
    if old is None:
        return
    if fingerprint(weight_files(resolve(out))) != weights:
        import warnings

        warnings.warn(f"{out}: τ = {old['temperature']:g} was fitted for the weights this "
                      "export replaces: not kept; run `replug fit-tau --store retriever` "
                      "again", stacklevel=3)
        return
    card = ""
    for name in ("README.md", "MODEL_CARD.md"):
        if (out / name).is_file() and TEMPERATURE_SECTION in (out / name).read_text():
            card = (out / name).read_text().partition(TEMPERATURE_SECTION)[2]
            card = card[:card.find("\n## ")] if "\n## " in card else card
    record_temperature(staged, old["temperature"], old.get("fit", {}), card)


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
    from replug_jax.fileio import replace_dir

    out = pathlib.Path(out_dir)
    tmp = out.with_name(out.name + ".two-towers")
    _stage(query, passages, tmp, settings, dtype, {"README.md": card})
    replace_dir(tmp, out)
    return out


# What a base retriever was itself trained on, where it matters for what a card claims: a
# base trained on a task's own (question, paragraph) pairs is no neutral starting point there
BASE_TRAINING_DATA = {
    "all-minilm-l6-v2": (
        "The base, all-MiniLM-L6-v2, was itself trained (by sentence-transformers) on about 1B "
        "text pairs that include SQuAD, Natural Questions and TriviaQA (question, paragraph) "
        "pairs: on these tasks it is not a neutral starting point.")}


def base_training_data(retriever: str) -> str | None:
    """The statement of :data:`BASE_TRAINING_DATA` for a base named by its packaged alias,
    hub id or folder name, else None."""
    from replug_jax.models.registry import PACKAGED_ALIASES

    name = PACKAGED_ALIASES.get(retriever.lower(), retriever.lower())
    name = "all-minilm-l6-v2" if name == "minilm" else name
    return next((text for key, text in BASE_TRAINING_DATA.items() if key in name), None)


def model_card(cfg: LSRConfig, step: int, dev: dict | None, workdir, folder: pathlib.Path,
               dtype: str, comparison: dict | None, pooling: str = "mean",
               lead: str | None = None) -> str:
    """A release's ``README.md``: metadata, the verdict against its base (the release rule
    of :mod:`replug_jax.train.release`), how it was trained, the lengths and truncation it
    must be used with, the weights' SHA-256, and how to load it."""
    from replug_jax.train.release import verdict, weight_digests

    temps_path = pathlib.Path(workdir) / "temperatures.json"
    temps = json.loads(temps_path.read_text()) if temps_path.is_file() else None
    lines = ["---", "library_name: sentence-transformers", "pipeline_tag: sentence-similarity",
             "tags: [replug, retrieval, sentence-transformers, feature-extraction]",
             *([f"base_model: {cfg.retriever.name}"] if "/" in cfg.retriever.name
               and not pathlib.Path(cfg.retriever.name).exists() else []), "---", "",
             f"# REPLUG LSR retriever trained from `{cfg.retriever.name}` by `{cfg.lm.name}`", "",
             lead.strip() if lead else verdict(comparison), ""]
    if comparison is not None:
        lines += ["| metric | trained − base | interval | items |", "|---|---:|---|---:|",
                  *(f"| {c['metric']} | {c['difference']:+.4f} | [{c['low']:+.4f}, "
                    f"{c['high']:+.4f}] | {c['items']} |" for c in comparison["all"]), ""]
    base_data, o = base_training_data(cfg.retriever.name), cfg.objective
    if base_data and lead and base_data.rstrip(".") in lead:  # the lead says it already
        base_data = None
    lines += ["## Training", "",
              *([base_data, ""] if base_data else []),
              f"- base retriever: `{cfg.retriever.name}` ({cfg.retriever.similarity} "
              f"similarity, {pooling} pooling)",
              f"- supervising LM: `{cfg.lm.name}`"
              + (f" via {cfg.lm.api_base}" if cfg.lm.api_base else ""),
              f"- task: {cfg.data.task}; data: `{cfg.data.train}`; corpus: `{cfg.data.corpus}`",
              f"- steps: {step} of {cfg.total_steps}; batch {cfg.batch_size}; k={cfg.k}; "
              f"γ={o.gamma}, β={o.beta}; {o.direction}; LM score {o.lm_score}; "
              f"objective {o.kind}; {cfg.optim.optimizer} lr {cfg.optim.learning_rate}",
              *([f"- temperatures as trained: `{json.dumps(temps)}`"] if temps else []),
              "- towers: " + ("the query tower alone (passages keep the base encoder: "
                              "passage_encoder/)" if cfg.supervision.towers == "query"
                              else "one encoder")
              + (f"; supervision: pre-scored pools `{cfg.supervision.train_pool}`"
                 if cfg.supervision.kind == "pool" else ""),
              f"- index refresh every {cfg.retrieval.refresh_every} steps "
              f"({cfg.retrieval.refresh_mode})",
              f"- trained in `{workdir}`", "",
              "## Lengths and truncation", "",
              f"Queries keep their last {cfg.retriever.query_max_length} tokens; passages "
              f"their first {cfg.retriever.doc_max_length} (with [CLS] and [SEP]). "
              "`Retriever.load` applies both (from `replug.json`); " + (
                  "sentence-transformers and the tokenizer of this folder (the query tower) "
                  f"keep a query's last {cfg.retriever.query_max_length} tokens, those of "
                  f"`passage_encoder/` a passage's first {cfg.retriever.doc_max_length}."
                  if cfg.supervision.towers == "query" else
                  "sentence-transformers and the tokenizer here cut every input to its first "
                  f"{cfg.retriever.doc_max_length} tokens, as passages are cut."), "",
              f"## Weights ({dtype})", "",
              *(f"- `{name}`: SHA-256 `{digest}`"
                for name, digest in weight_digests(folder).items()), "",
              "## Use", "", "```python",
              "from replug_jax.retrieval.encoder import Retriever",
              "retriever = Retriever.load(\"<this folder>\")  # lengths from replug.json", "",
              "from sentence_transformers import SentenceTransformer",
              "model = SentenceTransformer(\"<this folder>\")"
              + ("  # unit vectors: cosine = dot" if cfg.retriever.similarity == "cosine" else ""),
              "embeddings = model.encode([\"a passage\", \"a question?\"])", "",
              "from transformers import AutoModel, AutoTokenizer",
              "tok = AutoTokenizer.from_pretrained(\"<this folder>\")",
              "bert = AutoModel.from_pretrained(\"<this folder>\")",
              "batch = tok([\"a passage\"], padding=True, truncation=True, "
              f"max_length={cfg.retriever.doc_max_length}, return_tensors=\"pt\")",
              *(["mask = batch[\"attention_mask\"].unsqueeze(-1)",
                 "vec = (bert(**batch).last_hidden_state * mask).sum(1) / mask.sum(1)"]
                if pooling == "mean" else
                ["vec = bert(**batch).last_hidden_state[:, 0]  # [CLS] pooling"]),
              *(["vec = vec / vec.norm(dim=-1, keepdim=True)  # cosine similarity"]
                if cfg.retriever.similarity == "cosine" else []),
              "```", "", "## Dev metrics", "", "```json", json.dumps(dev or {}, indent=2),
              "```", "", "## Config", "", "```json", json.dumps(cfg.to_json(), indent=2),
              "```"]
    return "\n".join(lines) + "\n"


TEMPERATURE_SECTION = "## Inference temperature"


def record_temperature(folder: str | pathlib.Path, temperature: float, evidence: dict,
                       summary: str) -> None:
    """Store a fitted inference τ with an exported retriever: ``replug.json`` gains its τ
    record (``retrieval_temperature``, :func:`replug_jax.retrieval.fitted_tau.record`, the
    format an index keeps; ``evidence``: data, bounds, dev log-likelihoods), which
    :class:`~replug_jax.replug.Replug` then uses by default, and the model card gains (or has
    replaced) an "Inference temperature" section holding ``summary``."""
    from replug_jax.fileio import write_text_atomic

    folder = pathlib.Path(folder)
    settings_path = folder / "replug.json"
    if not settings_path.is_file():
        raise ValueError(f"{folder}: no replug.json, not a retriever exported by replug-jax")
    settings = json.loads(settings_path.read_text())
    for old in ("temperature", "temperature_fit"):  # earlier releases' keys
        settings.pop(old, None)
    settings[fitted_tau.SETTINGS_KEY] = fitted_tau.record(temperature, evidence)
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
