"""Language modelling against a real datastore (Table 1 and Figure 4 on WikiText-103 test with
Wikipedia passages): the evaluated windows, the datastores, the n-gram leakage check, and the
per-window branch log-probabilities, scored once and cached on disk.

**Windows.** Every article of the evaluated text is cut into sliding windows
(:func:`replug_jax.eval.perplexity.sliding_windows`: ``context_tokens`` of LM input before
``stride`` target tokens, the prior ``query_tokens`` as retrieval query); ``windows`` of them are
taken in rounds over the articles, each article's windows spread evenly over its length, so no
article gives more than one window more than any other (the cap) and every article counts.

**Scored once.** Each window is scored per *source*: the LM alone, the top-``k`` retrieved
documents, ``k`` random ones, their concatenation, and (the format control) the top-``k`` and
``k`` random passages of a second datastore. A source's per-branch, per-token target
log-probabilities ``[K, T]`` and retrieval scores ``[K]`` are kept, so every REPLUG variant
(any k ≤ K: the top-k of the top-K is the top-k; any τ of ``λ = softmax(s/τ)``; top-1) is an
exact function of them and costs no further LM call. Batches are written atomically as
``.npz`` (arrays only, read with ``allow_pickle=False``) under a folder named by the digest of
everything that decides the numbers: an interrupted run resumes where it stopped. Beneath
them, every (branch, target) pair the LM scores goes to the cache root's ``lm_scores/``
(:class:`~replug_jax.lm.score_store.StoredLM`, the store the LSR pools use): another
configuration of the same windows (a larger ``k``, a control) scores only the pairs it adds.

**Leakage.** A window leaks into a passage when its target shares a word ``leak_ngram``-gram
(lower-cased ``\\w+`` words; WikiText's ``@-@`` joins undone) with the passage. The rate is
reported; ``drop_leaking`` removes the leaking passages from that window's retrieval.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import pathlib
import re

import numpy as np

from experiments.lib.common import ROOT, load_retriever, require_data
from replug_jax.core.ensemble import mixture_logprobs, retrieval_log_weights
from replug_jax.eval.perplexity import WindowSettings, sliding_windows, split_wikitext
from replug_jax.eval.temperature import fit_tau
from replug_jax.fileio import atomic_path, write_text_atomic
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


_NOT_SCORES = ("ks", "batch_size", "tau_grid", "tau_folds", "cache", "modes")
_CONTROL_FIELDS = ("control_datastore", "control_documents", "control_k")


def source_k(cfg, source: str) -> int:
    """Documents per window of a source: ``control_k`` (default ``k``) for the control."""
    return (cfg.control_k or cfg.k) if source in _CONTROL else cfg.k


def cache_folder(cfg, st: Setup, source: str = "none") -> pathlib.Path:
    """The folder of a source's scored batches: named by the digest of the config fields that
    decide its scores (the control's settings only for the control) and of the windows."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in _NOT_SCORES and (source in _CONTROL or k not in _CONTROL_FIELDS)}
    spec = json.dumps({"config": fields, "windows": [(w.source_id, w.span) for w in st.windows]},
                      sort_keys=True, default=str)
    return cache_root(cfg) / hashlib.sha256(spec.encode()).hexdigest()[:16]


def cache_root(cfg) -> pathlib.Path:
    """Where the scored batches (one folder per configuration) and the LM-score store live."""
    return pathlib.Path(cfg.cache) if cfg.cache else ROOT / "runs" / "lm_datastore"


def _save_npz(path: pathlib.Path, **arrays) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)


def score_windows(cfg, st: Setup, sources, progress: bool = True) -> dict:
    """Per source: ``lp`` [N, K, T] branch target log-probs (padded with 0), ``length`` [N]
    target tokens, ``branches`` [N], ``scores`` [N, K] (NaN: random), ``ids`` [N, K] (−1: none),
    ``bytes`` [N]; computed batch by batch and cached (module docstring)."""
    from tqdm.auto import tqdm

    n, bs = len(st.windows), cfg.batch_size
    out = {}
    for source in sources:
        mode, k = _CONTROL.get(source, source), source_k(cfg, source)
        if source not in st.pipes:
            raise ValueError(f"source {source!r} needs control_datastore to be set")
        folder = cache_folder(cfg, st, source)
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(json.dumps({"windows": len(st.windows), "config": dataclasses.asdict(
            cfg)}, indent=1, default=str), folder / "spec.json")
        parts = []
        bar = tqdm(total=n, desc=f"lm:{source}", unit="window", disable=not progress)
        for start in range(0, n, bs):
            path = folder / f"{source}-{start:06d}-{bs}.npz"
            if not path.exists():
                batch = st.windows[start:start + bs]
                res = st.pipes[source].score(
                    [w.context for w in batch], [w.target for w in batch],
                    [w.query for w in batch], mode=mode, k=k,
                    exclude_ids=st.exclusions[source][start:start + bs], reliance=False)
                _save_npz(path, **_pack(res, k, cfg.stride))
            with np.load(path, allow_pickle=False) as z:
                parts.append({key: z[key] for key in z.files})
            bar.update(min(bs, n - start))
        bar.close()
        out[source] = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    return out


def _pack(results, k: int, stride: int) -> dict:
    b = len(results)
    lp = np.zeros((b, k, stride), np.float32)
    scores = np.full((b, k), np.nan, np.float32)
    ids = np.full((b, k), -1, np.int64)
    length, branches, nbytes = (np.zeros(b, np.int64) for _ in range(3))
    for i, r in enumerate(results):
        blp = r.branch_logprobs
        kk, t = blp.shape
        lp[i, :kk, :t] = blp
        length[i], branches[i], nbytes[i] = t, kk, r.num_bytes
        if r.doc_scores is not None:
            scores[i, :len(r.doc_scores)] = r.doc_scores
        ids[i, :len(r.doc_ids)] = r.doc_ids
    return {"lp": lp, "length": length, "branches": branches, "scores": scores, "ids": ids,
            "bytes": nbytes}


def window_logliks(scored: dict, k: int | None = None, tau: float | np.ndarray = 1.0
                   ) -> np.ndarray:
    """[N] per-window log-likelihood of the mixture of each window's first ``k`` branches
    (all: None) with ``λ = softmax(s/τ)`` (uniform where scores are NaN: random documents);
    ``tau`` may be one per window. REPLUG's Eq. of §3.2 at the gold tokens, summed
    (:func:`~replug_jax.core.ensemble.retrieval_log_weights`,
    :func:`~replug_jax.core.ensemble.mixture_logprobs`)."""
    lp, length = scored["lp"], scored["length"]
    n, kmax, t = lp.shape
    member = np.arange(kmax)[None, :] < np.minimum(scored["branches"], k or kmax)[:, None]
    tau_N = np.broadcast_to(np.asarray(tau, np.float64), (n,))
    log_w = retrieval_log_weights(np.nan_to_num(scored["scores"]) / tau_N[:, None], 1.0, member)
    mix = np.asarray(mixture_logprobs(lp, log_w), np.float64)
    return np.where(np.arange(t)[None, :] < length[:, None], mix, 0.0).sum(1)


def fitted_tau(scored: dict, article_of: np.ndarray, grid, folds: int, seed: int = 0):
    """τ cross-fitted over articles: articles in ``folds`` seeded folds; each fold's windows
    use the τ of ``grid`` that maximises the log-likelihood of the other folds' windows.
    Returns ``(per-window τ [N], per-fold τ list)``."""
    arts = np.unique(article_of)
    fold_of_article = dict(zip(np.random.default_rng(seed).permutation(arts),
                               itertools.cycle(range(folds))))
    fold = np.array([fold_of_article[a] for a in article_of])
    ll_of = {float(t): window_logliks(scored, tau=t) for t in grid}
    tau_N, chosen = np.ones(len(article_of)), []
    for f in range(folds):
        train = fold != f
        best = fit_tau(lambda t: float(ll_of[t][train].sum()), grid=grid)["temperature"] \
            if train.any() else 1.0
        tau_N[fold == f] = best
        chosen.append(best)
    return tau_N, chosen


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
              f"{cache_folder(cfg, st, args.sources[0]).parent}")

    run(go)


if __name__ == "__main__":
    main()
