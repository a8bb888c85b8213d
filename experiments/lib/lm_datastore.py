"""Language modelling against a real datastore (Table 1 and Figure 4 on WikiText-103 test with
Wikipedia passages): the evaluated windows, the datastores, the n-gram leakage check, and the
per-window branch log-probabilities, each pair scored once (the score store).

**Windows.** Every article of the evaluated text is cut into sliding windows
(:func:`replug_jax.eval.perplexity.sliding_windows`: ``context_tokens`` of LM input before
``stride`` target tokens, the prior ``query_tokens`` as retrieval query); ``windows`` of them are
taken in rounds over the articles, each article's windows spread evenly over its length, so no
article gives more than one window more than any other (the cap) and every article counts.

**Scored once.** Each window is scored per *source*: the LM alone, the top-``k`` retrieved
documents, ``k`` random ones, their concatenation, and (the format control) the top-``k`` and
``k`` random passages of a second datastore. A source's per-branch, per-token target
log-probabilities ``[K, T]`` and retrieval scores ``[K]`` are kept as
:class:`~replug_jax.branches.ScoredBranches`, so every REPLUG variant (any k ≤ K: the top-k of
the top-K is the top-k; any τ of ``λ = softmax(s/τ)``; top-1; τ cross-fitted over articles by
:func:`~replug_jax.eval.temperature.cross_fit_logliks`) is an exact function of them and costs
no further LM call. Every (branch, target) pair the LM scores goes to the cache root's
``lm_scores/`` (:class:`~replug_jax.lm.score_store.StoredLM`, the store ``replug eval`` and
the LSR pools use): an interrupted run resumes by pair, and another configuration of the same
windows (a larger ``k``, a control) or another experiment scores only the pairs it adds.

**Leakage.** A window leaks into a passage when its target shares a word ``leak_ngram``-gram
(lower-cased ``\\w+`` words; WikiText's ``@-@`` joins undone) with the passage. The rate is
reported; ``drop_leaking`` removes the leaking passages from that window's retrieval.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import re

import numpy as np

from experiments.lib.common import ROOT, load_retriever, require_data
from replug_jax.branches import ScoredBranches
from replug_jax.eval.perplexity import WindowSettings, sliding_windows, split_wikitext
from replug_jax.lm.score_store import ScoreStore, StoredLM, scorer_identity
from replug_jax.replug import Replug
from replug_jax.retrieval.build import build_index
from replug_jax.retrieval.corpus import (
    Document,
    chunk_documents,
    corpus_checksum,
    leakage_exclusions,
)
from replug_jax.retrieval import Index, index_in_memory

SOURCES = ("none", "replug", "random", "concat", "control_replug", "control_random")
_CONTROL = {"control_replug": "replug", "control_random": "random"}
_WIKITEXT_JOINS = re.compile(r" @(.)@ ")


@dataclasses.dataclass
class Setup:
    """What a run evaluates: windows with their article index, and the pipelines."""
    documents: list[Document]
    windows: list  # [N] perplexity.Window
    article_of: np.ndarray  # [N] index into documents
    pipes: dict  # source -> Replug
    exclusions: dict  # source -> [N] lists of excluded passage ids
    leakage: dict
    datastore_passages: int
    control_passages: int


def evaluated_documents(name: str, limit: int = 0) -> list[Document]:
    """The articles of ``wikitext103`` (test, tokenised: ``wiki.test.tokens``) or
    ``wikitext2`` (test, raw); the first ``limit`` (0: all)."""
    files = {"wikitext103": ("wikitext103", "wiki.test.tokens"),
             "wikitext2": ("wikitext2", "wiki.test.raw")}
    if name not in files:
        raise ValueError(f"eval_text must be one of {sorted(files)}, got {name!r}")
    docs = split_wikitext(require_data(*files[name]).read_text(encoding="utf-8"))
    return docs[:limit] if limit else docs


def select_windows(docs, tokenizer, settings: WindowSettings, total: int):
    """``total`` windows taken in rounds over the articles (see the module docstring); returns
    ``(windows, article_of)``. Fewer when the articles hold fewer."""
    per_doc = [sliding_windows(d, tokenizer, settings) for d in docs]
    available = sum(map(len, per_doc))
    total = min(total, available) if total else available
    cap = 0
    while sum(min(len(w), cap) for w in per_doc) < total:
        cap += 1
    spread = [[ws[int(i)] for i in np.unique(np.linspace(0, len(ws) - 1, min(len(ws), cap))
                                             .round())] if ws else [] for ws in per_doc]
    chosen = []
    for rnd in range(cap):
        for a, ws in enumerate(spread):
            if rnd < len(ws) and len(chosen) < total:
                chosen.append((a, rnd))
    chosen.sort()
    return ([spread[a][r] for a, r in chosen], np.array([a for a, _ in chosen], np.int64))


def words(text: str) -> list[str]:
    """Lower-cased ``\\w+`` words, WikiText's ``" @-@ "`` joins undone: the unit the leakage
    check's n-grams are made of."""
    return re.findall(r"\w+", _WIKITEXT_JOINS.sub(r"\1", text).lower())


def ngrams(text: str, n: int) -> set[int]:
    w = words(text)
    return {hash(tuple(w[i:i + n])) for i in range(len(w) - n + 1)}


def leaking_passages(windows, passages, n: int, progress: bool = True) -> list[set[int]]:
    """Per window, the ids of ``passages`` (any iterable, a store's stream included) whose
    text shares a word ``n``-gram with the window's target."""
    from tqdm.auto import tqdm

    owner: dict[int, set[int]] = {}
    for wi, w in enumerate(windows):
        for g in ngrams(w.target, n):
            owner.setdefault(g, set()).add(wi)
    out: list[set[int]] = [set() for _ in windows]
    for p in tqdm(passages, desc="leakage n-grams", unit="passage", disable=not progress):
        for g in ngrams(p.text, n) & owner.keys():
            for wi in owner[g]:
                out[wi].add(p.id)
    return out


def _enwiki_documents(limit: int) -> list[Document]:
    from replug_jax.retrieval.corpus import iter_documents

    path = require_data("enwiki2015", "enwiki_2015_sample10k.jsonl.gz")
    return list(itertools.islice(iter_documents(path), limit))


def enwiki_passages(articles: int) -> list:
    """The first ``articles`` articles of the enwiki sample in 100-word passages with titles
    (what ``replug index build --chunk-unit words --chunk-size 100`` makes of the whole)."""
    return chunk_documents(_enwiki_documents(articles), size=100, unit="words")


class LazyIndex:
    """The exact index of ``passages`` at ``path`` (:func:`cached_index`), loaded or built
    on its first search only: a run whose retrievals are all cached reads the passages by id
    (``passages[id]``) and never encodes the datastore."""

    def __init__(self, passages, retriever, path: pathlib.Path, progress: bool):
        from replug_jax.retrieval.store import PassageStore

        self.passages = PassageStore.from_passages(passages)
        self._args = (passages, retriever, path, progress)
        self._index = None

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, queries_BD, k: int):
        if self._index is None:
            self._index = cached_index(*self._args)
        return self._index.search(queries_BD, k)


def cached_index(passages, retriever, path: pathlib.Path, progress: bool,
                 lazy: bool = False) -> Index:
    """The exact index of ``passages`` at ``path``: loaded if an earlier run built it with
    this retriever from the same passages, else built (resumably); ``lazy``: a
    :class:`LazyIndex`, built at its first search."""
    if lazy:
        return LazyIndex(passages, retriever, path, progress)
    try:
        return Index.load(path, expect_encoder=retriever.identity,
                          expect_corpus_checksum=corpus_checksum(passages))
    except (ValueError, FileNotFoundError):
        return build_index(passages, retriever, path, progress=progress)


def open_datastore(spec: str, retriever, lm, passage_tokens: int, control_documents: int = 0,
                   cache: pathlib.Path | None = None, progress: bool = True,
                   lazy: bool = False):
    """``(index, leakage policy)`` for a datastore spec: an index directory built by ``replug
    index build``; ``enwiki:N`` (the first N articles of the enwiki sample in 100-word
    passages: in memory, or with ``cache`` indexed once in ``cache/index_enwikiN``, at its
    first search if ``lazy``);
    ``wikitext103`` (WikiText-103 test in ``passage_tokens``-token passages, every passage
    of the evaluated article excluded)."""
    if spec.startswith("enwiki:"):
        n = int(spec.split(":", 1)[1])
        if cache is not None:
            return cached_index(enwiki_passages(n), retriever,
                                pathlib.Path(cache) / f"index_enwiki{n}", progress,
                                lazy), "none"
        return index_in_memory(enwiki_passages(n), retriever), "none"
    if spec == "wikitext103":
        docs = evaluated_documents("wikitext103", control_documents)
        passages = chunk_documents(docs, size=passage_tokens, unit="tokens",
                                   tokenizer=lm.tokenizer)
        return index_in_memory(passages, retriever), "document"
    path = pathlib.Path(spec)
    if not path.is_absolute():
        path = ROOT / path
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path}: no index here; build it with `replug index build --corpus "
            f"../shared/data/enwiki2015/enwiki_2015_sample10k.jsonl.gz --out {spec} "
            "--chunk-unit words --chunk-size 100` (resumable), or set datastore=enwiki:N")
    return Index.load(path, expect_encoder=retriever.identity), "none"


def setup(cfg, lm, progress: bool = True, sources=SOURCES) -> Setup:
    """The windows and a pipeline per source; only the datastores ``sources`` need are opened
    (the LM alone and the control can be scored before the main datastore's index exists)."""
    settings = WindowSettings(cfg.context_tokens, cfg.stride, cfg.query_tokens, cfg.skip_first,
                              "none", None)
    docs = evaluated_documents(cfg.eval_text, cfg.num_documents)
    windows, article_of = select_windows(docs, lm.tokenizer, settings, cfg.windows)
    if not windows:
        raise ValueError("no evaluated article is longer than skip_first tokens")
    retriever = load_retriever(cfg.retriever)
    lm = StoredLM(lm, ScoreStore(cache_root(cfg) / "lm_scores", scorer_identity(lm)))
    pipes = {"none": Replug(lm, k=cfg.k, mode="none")}
    exclusions = {"none": [[] for _ in windows]}
    leakage, main_n, control_n = {}, 0, 0
    if any(s in sources for s in ("replug", "random", "concat")):
        index, policy = open_datastore(cfg.datastore, retriever, lm, cfg.passage_tokens)
        main_n = len(index)
        leaks = leaking_passages(windows, index.passages, cfg.leak_ngram, progress)
        main_excl = [sorted(s) if cfg.drop_leaking else [] for s in leaks]
        if policy != "none":
            main_excl = [sorted(set(a) | set(b)) for a, b in zip(
                main_excl, leakage_exclusions(windows, index.passages, policy))]
        for s in ("replug", "random", "concat"):
            pipes[s] = Replug(lm, retriever, index, k=cfg.k, retrieval_temperature=1.0,
                              seed=cfg.seed)
            exclusions[s] = main_excl
        leakage = {"ngram": cfg.leak_ngram, "drop_leaking": cfg.drop_leaking,
                   "windows_with_a_leaking_passage": float(np.mean([bool(s) for s in leaks])),
                   "leaking_passages_per_window": float(np.mean([len(s) for s in leaks])),
                   "per_window": [len(s) for s in leaks]}
    if cfg.control_datastore and any(s in sources for s in _CONTROL):
        control, cpolicy = open_datastore(cfg.control_datastore, retriever, lm,
                                          cfg.passage_tokens, cfg.control_documents)
        control_n = len(control)
        cexcl = leakage_exclusions(windows, control.passages, cpolicy)
        for s in _CONTROL:
            pipes[s] = Replug(lm, retriever, control, k=source_k(cfg, s),
                              retrieval_temperature=1.0, seed=cfg.seed)
            exclusions[s] = cexcl
    return Setup(docs, windows, article_of, pipes, exclusions, leakage, main_n, control_n)


def source_k(cfg, source: str) -> int:
    """Documents per window of a source: ``control_k`` (default ``k``) for the control."""
    return (cfg.control_k or cfg.k) if source in _CONTROL else cfg.k


def cache_root(cfg) -> pathlib.Path:
    """Where the LM-score store (``lm_scores/``) and the cached indexes live."""
    return pathlib.Path(cfg.cache) if cfg.cache else ROOT / "runs" / "lm_datastore"


def score_windows(cfg, st: Setup, sources, progress: bool = True) -> dict:
    """Per source, the windows' :class:`~replug_jax.branches.ScoredBranches` (``[N, K, T]``
    target log-probs of the top-K branches; λ uniform where a source has no retrieval
    scores: the LM alone, random documents, the concatenation), scored batch by batch by the
    pipelines, whose LM reads and writes the score store: a run resumes by pair."""
    from tqdm.auto import tqdm

    n, bs = len(st.windows), cfg.batch_size
    out = {}
    for source in sources:
        if source not in st.pipes:
            raise ValueError(f"source {source!r} needs control_datastore to be set")
        mode, k = _CONTROL.get(source, source), source_k(cfg, source)
        results = []
        for start in tqdm(range(0, n, bs), desc=f"lm:{source}", disable=not progress):
            batch = st.windows[start:start + bs]
            results += st.pipes[source].score(
                [w.context for w in batch], [w.target for w in batch],
                [w.query for w in batch], mode=mode, k=k,
                exclude_ids=st.exclusions[source][start:start + bs], reliance=False)
        out[source] = ScoredBranches.from_results(
            results, [f"{w.source_id}@{w.target_span[0]}" for w in st.windows],
            unscored="uniform")
    return out


def main(argv=None):
    """Score (and cache) a Table 1 config's windows for some sources only: to start before
    the datastore's index is built (the LM alone and the format control need none of it), or
    to spread the sources over machines sharing the cache folder. ``python -m
    experiments.table1_lm`` then reads them and scores the rest."""
    import argparse

    from experiments.lib.common import add_standard_args, load_lm, pick_config, run
    from experiments.configs.table1_lm import CONFIGS

    ap = argparse.ArgumentParser(description=main.__doc__)
    add_standard_args(ap, CONFIGS)
    ap.add_argument("--sources", nargs="+", choices=SOURCES, required=True,
                    help="what to score: " + ", ".join(SOURCES))
    args = ap.parse_args(argv)

    def go():
        cfg = pick_config(CONFIGS, args.config, args.set)
        st = setup(cfg, load_lm(cfg.lm, cfg.max_context), not args.no_progress, args.sources)
        score_windows(cfg, st, args.sources, progress=not args.no_progress)
        print(f"scored {len(st.windows)} windows for {', '.join(args.sources)} into "
              f"{cache_root(cfg) / 'lm_scores'}")

    run(go)


if __name__ == "__main__":
    main()
