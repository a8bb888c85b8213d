"""The REPLUG pipeline (paper §3): retrieve -> weights -> K branches -> ensemble.

``Replug(lm, retriever, index)`` offers ``score`` (per-token ensemble log-probs, perplexity,
bits per byte), ``generate`` (coordinated decoding: every branch receives the token chosen from
the mixture), ``answer_choice`` (multiple choice by mixture likelihood), and the baselines of
the paper under the same interface (``mode``):

* ``"replug"`` — the ensemble of §3.2 over the top-k documents, ``λ = softmax(s / τ)``;
* ``"none"`` — the LM alone;
* ``"concat"`` — all k documents in one prompt, highest-ranked first, documents dropped or cut
  from the lowest-ranked end until the prompt fits the LM context;
* ``"top1"`` — only the top document (the ensemble with k = 1);
* ``"random"`` — k passages drawn uniformly from the corpus (seeded per query), mixed with
  uniform weights: the §7.1 control.

Every result records the mode, k, τ, the separator, the LM and retriever identities, the
retrieved ids and weights, per-token document responsibilities, the retrieval reliance
(ensemble log-likelihood minus the LM alone), and the cost: LM calls, tokens, times.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from typing import Sequence

import numpy as np

from replug_jax.core.ensemble import (
    doc_responsibility,
    mixture_logprobs,
    retrieval_log_weights,
)
from replug_jax.lm.scorer import (
    ENSEMBLE_DECODE,
    NEXT_TOKEN,
    SCORE,
    require,
)
from replug_jax.lm.stepwise import generate_stepwise
from replug_jax.prompts import document_budget, document_prompt
from replug_jax.results import (  # noqa: F401 (the pipeline's result types, re-exported)
    Branches,
    GenerationResult,
    ScoreResult,
    source_of,
    summarize,
)
from replug_jax.retrieval import corpus_text, per_query_exclusions

MODES = ("replug", "none", "concat", "top1", "random")


@dataclasses.dataclass
class _Call:
    """One call of a pipeline entry point: its settings, branches and cost baseline."""

    mode: str
    k: int
    groups: list
    t_wall: float
    before: dict
    retrieval_s: float


class Replug:
    """Retrieval-augmented black-box LM. ``retriever``/``index`` may be None for mode 'none'."""

    def __init__(self, lm, retriever=None, index=None, *, k: int = 10,
                 retrieval_temperature: float | None = None, separator: str = "\n\n",
                 mode: str = "replug", seed: int = 0, top_n: int = 20,
                 nprobe: int | None = None, rerank: int | None = None):
        """``retrieval_temperature`` is τ of λ = softmax(s/τ) (Eq. 2)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        if mode != "none" and (retriever is None or index is None):
            raise ValueError(f"mode {mode!r} needs a retriever and an index")
        # τ: explicit, else the one fitted for the retriever (stored with its index or in its
        # replug.json), else the paper's 1.
        fitted = getattr(retriever, "retrieval_temperature", None)
        tau = retrieval_temperature
        self.retrieval_temperature_source = (
            "argument" if tau is not None else
            getattr(retriever, "retrieval_temperature_source", None) or "retriever"
            if fitted is not None else "the paper's default (1)")
        tau = tau if tau is not None else fitted or 1.0
        if not tau > 0:
            raise ValueError(f"the retrieval temperature τ of λ must be > 0, got {tau}")
        self.lm, self.retriever, self.index = lm, retriever, index
        self.k, self.retrieval_temperature, self.separator = k, tau, separator
        self.mode, self.seed, self.top_n = mode, seed, top_n
        # search-time knobs of an approximate index (None: the index manifest's defaults)
        self.search_options = {k: v for k, v in (("nprobe", nprobe), ("rerank", rerank))
                               if v is not None}
        self.truncated_documents = 0

    # -- retrieval and branches -----------------------------------------------------------------

    def settings(self, mode: str, k: int) -> dict:
        """What a result was computed with; ``k`` is the number of documents used (at most
        the index's passages: a larger request is kept as ``k_requested``, with a note)."""
        used = {"k": 1 if mode == "top1" else k}  # top1 answers from one passage
        if self.index is not None and mode not in ("none", "top1") and k > len(self.index):
            used = {"k": len(self.index), "k_requested": k,
                    "note": f"k={k} asked, but the index holds {len(self.index)} passages: "
                            f"all {len(self.index)} were used"}
        return {"mode": mode, **used, "retrieval_temperature": self.retrieval_temperature,
                "retrieval_temperature_source": self.retrieval_temperature_source,
                "separator": self.separator, "lm": getattr(self.lm, "name", "?"),
                "max_context": getattr(self.lm, "max_context", None),
                "search": dict(self.search_options),  # nprobe / rerank of an approximate index
                # an in-process LM's dtype, matmul precision, mesh and backend
                "lm_placement": (self.lm.place.describe() if hasattr(self.lm, "place")
                                 else None),
                "retriever": None if self.retriever is None else self.retriever.identity,
                "index": None if self.index is None else {
                    "n": len(self.index), "factory": self.index.manifest.get("factory"),
                    "corpus_checksum": self.index.manifest.get("corpus_checksum")}}

    def retrieve(self, queries: Sequence[str], k: int, exclude_ids=None):
        t0 = time.perf_counter()
        res = self.index.search(self.retriever.encode_queries(list(queries)), k, exclude_ids,
                                **self.search_options)
        return res, time.perf_counter() - t0

    def _fit_document(self, doc: str, budget: int) -> str:
        if budget <= 0:
            return ""
        cut = self.lm.truncate(doc, budget)
        if cut != doc:
            self.truncated_documents += 1
        return cut

    def _compose(self, doc: str, context: str, budget: int, reserve: int, prefix: str = ""
                 ) -> str:
        """``prefix ∘ doc ∘ separator ∘ context`` fitted to the LM context
        (:func:`document_prompt`)."""
        prompt, cuts = document_prompt(self.lm, doc, context, separator=self.separator,
                                       reserve=reserve, budget=budget, prefix=prefix)
        self.truncated_documents += cuts
        return prompt

    @staticmethod
    def _random_passages(store, k: int, excluded: set[int], rng) -> list:
        """Up to ``k`` distinct passages drawn uniformly from the store, none in ``excluded``:
        rows are drawn in a random order without materialising the corpus."""
        n = len(store)
        if len(excluded) < n // 2:  # rejection sampling: cheap for any N
            picks, seen = [], set()
            while len(picks) < k and len(seen) < n:
                row = int(rng.integers(n))
                if row in seen:
                    continue
                seen.add(row)
                p = store.row(row)
                if p.id not in excluded:
                    picks.append(p)
            return picks
        allowed = [p for p in store if p.id not in excluded]
        pick = rng.choice(len(allowed), size=min(k, len(allowed)), replace=False)
        return [allowed[int(i)] for i in pick]

    def _budget(self, context: str, reserve: int) -> int:
        return document_budget(self.lm, context, self.separator, reserve)

    def branches(self, contexts: Sequence[str], queries: Sequence[str] | None = None, *,
                 mode: str | None = None, k: int | None = None, exclude_ids=None,
                 reserve: Sequence[int] | int = 0, prefixes: Sequence[str] | None = None
                 ) -> tuple[list[Branches], float]:
        """The per-query branch prompts and log-weights for ``mode``; returns retrieval time.

        ``prefixes`` (one per context) go before the document in every branch (and before the
        context alone in mode ``none``): the demonstrations-first QA layout
        (``prompts.QA_LAYOUTS``); by default branches are ``d ∘ x`` as in the paper."""
        mode = mode or self.mode
        k = k or self.k
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        queries = list(queries) if queries is not None else list(contexts)
        if len(queries) != len(contexts):
            raise ValueError(f"{len(queries)} queries for {len(contexts)} contexts")
        reserves = [reserve] * len(contexts) if isinstance(reserve, int) else list(reserve)
        prefixes = [""] * len(contexts) if prefixes is None else list(prefixes)
        if len(prefixes) != len(contexts):
            raise ValueError(f"{len(prefixes)} prefixes for {len(contexts)} contexts")
        if mode == "none":
            return [Branches([f + c], np.zeros(1, np.float32), [], np.full(1, np.nan))
                    for f, c in zip(prefixes, contexts)], 0.0
        if mode == "random":
            out = []
            excluded = per_query_exclusions(exclude_ids, len(contexts))
            store = self.index.passages
            for qi, (c, r) in enumerate(zip(contexts, reserves)):
                # seeded by (seed, query): the same query draws the same documents in any
                # batch or call order, and different queries draw different ones
                rng = np.random.default_rng(
                    [self.seed, zlib.crc32(queries[qi].encode("utf-8"))])
                ps = self._random_passages(store, k, excluded[qi], rng)
                if not ps:
                    raise ValueError(f"query {qi}: every passage is excluded")
                budget = self._budget(prefixes[qi] + c, r)
                out.append(Branches([self._compose(corpus_text(p), c, budget, r, prefixes[qi])
                                     for p in ps],
                                    np.full(len(ps), -np.log(len(ps)), np.float32), ps,
                                    np.full(len(ps), np.nan)))
            return out, 0.0
        res, seconds = self.retrieve(queries, 1 if mode == "top1" else k, exclude_ids)
        out = []
        for i, (c, r) in enumerate(zip(contexts, reserves)):
            ps = res.passages[i]
            if not ps:
                raise ValueError(f"retrieval returned no passage for query {i}")
            scores = res.scores[i, :len(ps)].astype(np.float32)
            budget = self._budget(prefixes[i] + c, r)
            if mode == "concat":
                docs, left = [], budget
                for p in ps:
                    text = self._fit_document(corpus_text(p), left)
                    if not text:
                        break
                    docs.append(text)
                    left -= self.lm.count_tokens(text + self.separator)
                prompt = self._compose(self.separator.join(docs), c, budget, r, prefixes[i])
                out.append(Branches([prompt], np.zeros(1, np.float32), ps[:len(docs)], scores))
                continue
            log_w = np.asarray(retrieval_log_weights(scores[None], self.retrieval_temperature))[0]
            prompts = [self._compose(corpus_text(p), c, budget, r, prefixes[i]) for p in ps]
            out.append(Branches(prompts, log_w, ps, scores))
        return out, seconds

    # -- scoring --------------------------------------------------------------------------------

    def score(self, contexts: Sequence[str], continuations: Sequence[str],
              queries: Sequence[str] | None = None, *, mode: str | None = None,
              k: int | None = None, exclude_ids=None, reliance: bool = True,
              prefixes: Sequence[str] | None = None) -> list[ScoreResult]:
        """Ensemble log-likelihood of each continuation given its context (teacher forcing).

        The per-token mixture ``log Σ_k λ_k p(y_t | d_k ∘ x, y_<t)`` is the REPLUG next-token
        probability of §3.2 evaluated at the gold tokens. ``prefixes``: see :meth:`branches`.
        """
        require(self.lm, SCORE, "REPLUG scoring")
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts for {len(continuations)} continuations")
        call = self._start(contexts, queries, mode, k, exclude_ids,
                           reserve=[self.lm.count_tokens(c) for c in continuations],
                           prefixes=prefixes)
        mode, k, groups = call.mode, call.k, call.groups
        prompts = [p for g in groups for p in g.prompts]
        conts = [c for g, c in zip(groups, continuations) for _ in g.prompts]
        if reliance and mode != "none":
            prompts += [f + c for f, c in zip(prefixes or [""] * len(contexts), contexts)]
            conts += list(continuations)
        scored = self.lm.score_continuations(prompts, conts)
        results, pos = [], 0
        plain = scored[len(scored) - len(contexts):] if reliance and mode != "none" else None
        for qi, g in enumerate(groups):
            branch = scored[pos:pos + len(g.prompts)]
            pos += len(g.prompts)
            lengths = {len(s.logprobs) for s in branch}
            if len(lengths) != 1:
                raise ValueError(f"query {qi}: the continuation tokenised differently across "
                                 f"document branches ({sorted(lengths)} tokens); put a space "
                                 "or newline at the start of the continuation")
            lp_KT = np.stack([s.logprobs for s in branch])
            mix_T = np.asarray(mixture_logprobs(lp_KT[None], g.log_weights[None]))[0]
            resp_KT = np.asarray(doc_responsibility(lp_KT[None], g.log_weights[None]))[0]
            ll = float(mix_T.sum())
            results.append(ScoreResult(
                contexts[qi], continuations[qi], branch[0].tokens, mix_T, ll, len(mix_T),
                len(continuations[qi].encode("utf-8")), [p.id for p in g.passages],
                [p.title for p in g.passages], np.exp(g.log_weights).tolist(), resp_KT,
                None if plain is None else ll - plain[qi].total if mode != "none" else 0.0,
                self.settings(mode, k), {}, lp_KT, g.scores,
                [source_of(p) for p in g.passages]))
        cost = self._cost(call, len(results))
        for r in results:
            r.cost = cost
        return results

    def _start(self, texts, queries, mode, k, exclude_ids, reserve, prefixes=None) -> "_Call":
        """What every entry point opens with: the mode and k in force, the cost meter's
        reading and the clock, then retrieval and the branches."""
        mode, k = mode or self.mode, k or self.k
        t_wall, before = time.perf_counter(), self.lm.cost.snapshot()
        groups, retrieval_s = self.branches(texts, queries, mode=mode, k=k,
                                            exclude_ids=exclude_ids, reserve=reserve,
                                            prefixes=prefixes)
        return _Call(mode, k, groups, t_wall, before, retrieval_s)

    def _cost(self, call: "_Call", n: int) -> dict:
        """The LM cost, retrieval and wall time of ``call`` (shared by ``n`` results)."""
        from replug_jax.lm.scorer import CostMeter

        c = CostMeter.diff(self.lm.cost.snapshot(), call.before)
        c["retrieval_seconds"] = round(call.retrieval_s, 4)
        c["wall_seconds"] = round(time.perf_counter() - call.t_wall, 4)
        c["shared_by"] = n  # the cost covers this many results together
        return c

    def next_token(self, contexts: Sequence[str], queries: Sequence[str] | None = None, *,
                   mode: str | None = None, k: int | None = None, exclude_ids=None
                   ) -> tuple[np.ndarray, list[Branches], dict]:
        """The REPLUG next-token distribution ``p(y | x, D') = Σ_d λ(d, x) p(y | d ∘ x)``
        (§3.2) over the whole vocabulary: ``([B, V] log-probs, branches, cost)``.

        Needs an LM that exposes full next-token distributions (``NEXT_TOKEN``); an API that
        returns only top-n log-probs cannot give this exactly (see ``generate``)."""
        require(self.lm, NEXT_TOKEN, "the REPLUG next-token distribution")
        call = self._start(contexts, queries, mode, k, exclude_ids, reserve=1)
        groups = call.groups
        lp_NV = self.lm.next_token_logprobs([p for g in groups for p in g.prompts])
        out_BV, pos = [], 0
        for g in groups:
            lp_KV = lp_NV[pos:pos + len(g.prompts)]
            pos += len(g.prompts)
            out_BV.append(np.asarray(mixture_logprobs(lp_KV[None], g.log_weights[None]))[0])
        return np.stack(out_BV), groups, self._cost(call, len(groups))

    def answer_choice(self, prompt: str, options: Sequence[str], query: str | None = None, *,
                      mode: str | None = None, k: int | None = None,
                      normalize: bool = False) -> dict:
        """Pick the option with the highest ensemble likelihood (mean per token if
        ``normalize``). Retrieval uses ``query`` (default: the prompt) once for all options.

        When every option is one token after the prompt (MMLU's " A" … " D") and the LM gives
        full next-token distributions, one mixture over the vocabulary scores all options
        (one LM pass per branch instead of one per branch and option); the result is the
        same log-likelihood."""
        single = self._single_token_options(prompt, options)
        if single is not None:
            lp_BV, [g], cost = self.next_token([prompt], [query or prompt], mode=mode, k=k)
            scores = [float(lp_BV[0, t]) for t in single]
            best = int(np.argmax(scores))
            return {"choice": best, "option": options[best], "scores": scores,
                    "doc_ids": [p.id for p in g.passages],
                    "weights": np.exp(g.log_weights).tolist(),
                    "settings": self.settings(mode or self.mode, k or self.k), "cost": cost}
        results = self.score([prompt] * len(options), list(options),
                             [query or prompt] * len(options), mode=mode, k=k, reliance=False)
        scores = [r.loglik / max(r.num_tokens, 1) if normalize else r.loglik for r in results]
        best = int(np.argmax(scores))
        return {"choice": best, "option": options[best], "scores": scores,
                "doc_ids": results[0].doc_ids, "weights": results[0].weights,
                "settings": results[0].settings, "cost": results[0].cost}

    def _single_token_options(self, prompt: str, options: Sequence[str]) -> list[int] | None:
        """Token ids of ``options`` if each is exactly one token after ``prompt``."""
        if NEXT_TOKEN not in getattr(self.lm, "capabilities", ()) or not hasattr(
                self.lm, "split_continuation"):
            return None
        ids = []
        for opt in options:
            head, tail = self.lm.split_continuation(prompt, opt)
            if len(tail) != 1 or self.lm.split_continuation(prompt, "")[0] != head:
                return None
            ids.append(tail[0])
        return ids

    # -- generation -----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str], max_new_tokens: int = 32, *,
                 sampling_temperature: float = 0.0, top_p: float = 1.0,
                 stop: Sequence[str] = (), queries: Sequence[str] | None = None,
                 mode: str | None = None, k: int | None = None, exclude_ids=None,
                 seed: int | None = None,
                 prefixes: Sequence[str] | None = None) -> list[GenerationResult]:
        """Coordinated decoding: each step's token comes from the mixture over the branches
        and is appended to every branch (§3.2). Greedy when ``sampling_temperature == 0``.
        ``prefixes``: see :meth:`branches`."""
        call = self._start(prompts, queries, mode, k, exclude_ids, reserve=max_new_tokens,
                           prefixes=prefixes)
        mode, k, groups = call.mode, call.k, call.groups
        seed = self.seed if seed is None else seed
        approximation = None
        if ENSEMBLE_DECODE in self.lm.capabilities:
            outs = []
            by_k: dict[int, list[int]] = {}
            for i, g in enumerate(groups):
                by_k.setdefault(len(g.prompts), []).append(i)
            results: dict[int, tuple] = {}
            for kk, idx in by_k.items():
                gen = self.lm.generate_ensemble(
                    [groups[i].prompts for i in idx],
                    np.stack([groups[i].log_weights for i in idx]),
                    max_new_tokens=max_new_tokens, sampling_temperature=sampling_temperature,
                    top_p=top_p,
                    stop=stop, seed=seed)
                for j, i in enumerate(idx):
                    results[i] = (gen.texts[j], gen.token_ids[j], gen.mixture_logprobs[j],
                                  gen.branch_logprobs[j], gen.stopped_by[j])
            decode = self.lm.tokenizer.decode
            for i in range(len(groups)):
                text, ids, mix, br, stopped = results[i]
                outs.append((text, [decode([t]) for t in ids], mix, br, stopped))
        else:
            outs, approximation = generate_stepwise(self.lm, groups, self.top_n,
                                                    max_new_tokens, sampling_temperature,
                                                    top_p, stop, seed)
        cost = self._cost(call, len(groups))
        final = []
        for prompt, g, (text, toks, mix, br, stopped) in zip(prompts, groups, outs):
            resp = (np.asarray(doc_responsibility(br[None], g.log_weights[None]))[0]
                    if br.shape[-1] else np.zeros((len(g.prompts), 0)))
            final.append(GenerationResult(
                prompt, text, toks, mix, [p.id for p in g.passages],
                [p.title for p in g.passages], [p.text for p in g.passages],
                np.exp(g.log_weights).tolist(), resp, stopped, approximation,
                self.settings(mode, k), cost, [source_of(p) for p in g.passages],
                list(g.prompts)))
        return final
