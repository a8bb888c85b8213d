"""REPLUG LSR on SQuAD, cross-fitted: a retriever the LM taught, tested on questions of
articles it never trained on (pre-registration in ``experiments/configs/lsr_qa.py``).

1. **Datastore**: every SQuAD paragraph (train and the dev articles here) plus the enwiki
   sample's passages as distractors, searched exactly as one index
   (:class:`experiments.squad.MergedDatastore`; the SQuAD part is built in the work folder).
2. **Pools**: each question's top-``pool_size`` passages by the base retriever, scored once
   by the frozen LM (``log p(answer | d ∘ question)`` per token; document KV reuse shares each
   paragraph across the questions that retrieve it; resumable part by part).
3. **Diagnostics at no LM cost**: the oracle ceiling (the LM's own top-k of each pool) against
   the base on dev and test; the shuffled-Q control trained like the first variant.
4. **Training** on the train pool for every objective × (γ, β), early-stopped on dev
   (:func:`replug_jax.train.pool.train_on_pool`, only the query tower learning by default).
5. **Test, end to end**: every retriever (base, each variant) retrieves its top-k for every
   test question from the whole datastore; pairs missing from the test pool are scored; τ is
   fitted on the dev pool per retriever; the primary endpoint, recall@k and EM/F1 are compared
   with the base, intervals bootstrapped over test articles.

Usage: ``python -m experiments.lsr_qa [--config default|tiny] [--set key=value ...]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import numpy as np

from experiments import lm_datastore, squad
from experiments.common import (
    load_lm,
    new_figure,
    parse_experiment_args,
    provenance,
    run,
    save_figure,
    write_results,
)
from experiments.configs.lsr_qa import CONFIGS, PRIMARY_ENDPOINT
from experiments.lsr_common import label, min_detectable, save_params, slug, variants
from replug_jax.core.ensemble import retrieval_log_weights
from replug_jax.eval.qa import exact_match, f1_score, first_line
from replug_jax.eval.stats import format_interval, paired_bootstrap
from replug_jax.fileio import write_json_atomic
from replug_jax.prompts import qa_prompt
from replug_jax.retrieval.build import build_index
from replug_jax.retrieval.corpus import corpus_checksum
from replug_jax.retrieval.index import Index
from replug_jax.retrieval.encoder import Retriever
from replug_jax.timing import Timer
from replug_jax.train.data import Example
from replug_jax.train.pool import (
    build_pool,
    embed_pool,
    oracle_logliks,
    pool_logliks,
    train_on_pool,
)
from replug_jax.train.refresh import unflatten_params
from replug_jax.train.supervision import branch_prompts

DIFFERENCES = (
    "The paper trains Contriever with GPT-3 Curie's likelihoods on Pile text and evaluates QA "
    "with Codex on NQ/TriviaQA over a 2018 Wikipedia dump. Here all-MiniLM-L6-v2 learns from "
    "SmolLM2-135M's answer likelihoods on SQuAD v1.1 training questions; the datastore is "
    "every SQuAD paragraph plus a 10,000-article sample of the 2015 English Wikipedia in "
    "100-word passages (distractors); only the query tower learns (documents keep the base "
    "embeddings, so the datastore is embedded once), retrieval during training is the top-k "
    "within each question's pre-scored pool, and the test retrieves from the whole datastore.")


def examples_of(questions) -> list[Example]:
    """x = the plain QA prompt, y = " " + the first reference answer, query = the question."""
    return [Example(q.id, q.question, qa_prompt(q.question, chat=False), " " + q.answers[0],
                    q.paragraph) for q in questions]


def open_datastore(cfg, retriever, lm, work: pathlib.Path, progress: bool):
    train_paras, train_qs = squad.load_squad("train-v1.1.json")
    test_paras, test_qs = squad.load_squad("dev-v1.1.half_a.json", first_id=len(train_paras))
    paragraphs = train_paras + test_paras
    squad_index = cached_index(paragraphs, retriever, work / "squad_index", progress)
    if cfg.distractors.startswith("enwiki:"):  # the first N enwiki articles, indexed once
        passages = lm_datastore.enwiki_passages(int(cfg.distractors.split(":", 1)[1]))
        distractors = cached_index(passages, retriever, work / "distractor_index", progress)
    else:
        distractors = (lm_datastore.open_datastore(cfg.distractors, retriever, lm, 128)[0]
                       if cfg.distractors else None)
    return squad.MergedDatastore(squad_index, distractors), train_qs, test_qs


def cached_index(passages, retriever, path: pathlib.Path, progress: bool) -> Index:
    """The exact index of ``passages`` at ``path``: loaded if an earlier run built it with
    this retriever from the same passages, else built (resumably)."""
    try:
        return Index.load(path, expect_encoder=retriever.identity,
                          expect_corpus_checksum=corpus_checksum(passages))
    except (ValueError, FileNotFoundError):
        return build_index(passages, retriever, path, progress=progress)


def retrieve(store, retriever, params, questions, k: int):
    return store.search(retriever.encode_queries([q.question for q in questions], params), k)


def fit_tau(pool, scores_EM, k: int, grid) -> tuple[float, float]:
    """(τ, dev mean log-likelihood at τ): the τ of ``grid`` that maximises REPLUG's mean dev
    log-likelihood of the retriever's top-k within the dev pools."""
    means = [float(np.mean(pool_logliks(pool, scores_EM, k, t))) for t in grid]
    best = int(np.argmax(means))
    return float(grid[best]), means[best]


def pool_scores(retriever, params, pool, examples, by_id, frozen: dict) -> np.ndarray:
    """``[E, M]`` similarities of each question (``params``) to its pool's passages (base
    document embeddings, kept in ``frozen``)."""
    q, d = embed_pool(retriever, params, pool, examples, by_id, None, frozen)
    return np.einsum("ed,emd->em", q, d)


def end_to_end(name, res, examples, pool, lm, by_id, work, tau, k, progress,
               part_size: int = 32) -> np.ndarray:
    """``[E]`` REPLUG log-likelihoods of the gold answers with the top-``k`` of ``res``
    (retrieved from the whole datastore) and ``λ = softmax(s/τ)``; pairs that the test pool
    lacks are scored (resumably) into ``work/extra_<name>``."""
    e_n = len(examples)
    where = {(i, int(pid)): j for (i, j), pid in np.ndenumerate(pool.doc_ids_EM) if pid >= 0}
    missing = [[int(pid) for pid in res.ids[i, :k] if pid >= 0 and (i, int(pid)) not in where]
               for i in range(e_n)]
    width = max((len(m) for m in missing), default=0)
    extra = None
    if width:
        by_id.update({p.id: p for ps in res.passages for p in ps})
        cand = np.array([m + [-1] * (width - len(m)) for m in missing], np.int64)
        digest = hashlib.sha256(cand.tobytes()).hexdigest()[:10]
        extra = build_pool(examples, cand, np.zeros(cand.shape, np.float32), by_id, lm,
                           work / f"extra_{slug(name)}_{digest}", {"retrieved_by": name},
                           part_size=part_size, progress=progress)
    t = pool.branches.logprobs_NKT.shape[-1]
    if extra is not None:
        t = max(t, extra.branches.logprobs_NKT.shape[-1])
    lp = np.zeros((e_n, k, t), np.float32)
    for i in range(e_n):
        for slot, pid in enumerate(res.ids[i, :k]):
            if (i, int(pid)) in where:
                row = pool.branches.logprobs_NKT[i, where[i, int(pid)]]
            else:
                row = extra.branches.logprobs_NKT[i, missing[i].index(int(pid))]
            lp[i, slot, :len(row)] = row
    scored = {"lp": lp, "length": pool.branches.token_mask_NT.sum(1),
              "branches": (res.ids[:, :k] >= 0).sum(1), "scores": res.scores[:, :k]}
    return lm_datastore.window_logliks(scored, tau=tau)


def generate_answers(lm, examples, res, by_id, tau, k, max_new_tokens) -> list[str]:
    """Greedy REPLUG answers (coordinated decoding over the top-``k`` branches, §3.2)."""
    prompts = [branch_prompts([e] * len(ps[:k]), ps[:k], lm)
               for e, ps in zip(examples, res.passages)]
    log_w = np.asarray(retrieval_log_weights(res.scores[:, :k], tau))
    out = lm.generate_ensemble(prompts, log_w,
                               max_new_tokens=max_new_tokens, sampling_temperature=0.0)
    return [first_line(t) for t in out.texts]


def compare(a, b, articles, cfg) -> dict:
    """Mean of ``a`` − mean of ``b`` over the same questions, 95 % interval resampling whole
    articles (questions, if they all come from one article)."""
    return paired_bootstrap(np.asarray(a, np.float64), np.asarray(b, np.float64),
                            clusters=articles if len(set(articles)) > 1 else None,
                            resamples=cfg.bootstrap_resamples, seed=cfg.seed)


def main(argv=None):
    args, cfg = parse_experiment_args(argv, __doc__, CONFIGS)
    if cfg.k > cfg.pool_size:
        raise ValueError(f"k={cfg.k} exceeds the pool of {cfg.pool_size} candidates")
    if cfg.towers != "query":
        raise ValueError("lsr_qa trains the query tower only (towers=query): a shared encoder "
                         "would re-embed the whole datastore for every variant's test")
    progress = not args.no_progress
    work = pathlib.Path(cfg.workdir) / args.config
    (work / "runs").mkdir(parents=True, exist_ok=True)
    with Timer() as sw:
        lm = load_lm(cfg.lm, cfg.lm_max_context)
        retriever = Retriever.load(cfg.retriever)
        store, train_qs, test_qs = open_datastore(cfg, retriever, lm, work, progress)
        train_qs, dev_qs = squad.split_articles(train_qs, cfg.dev_articles, cfg.seed)
        if 0 < cfg.train_articles < len({q.article for q in train_qs}):  # seeded, whole articles
            train_qs = squad.split_articles(train_qs, cfg.train_articles, cfg.seed + 1)[1]
        qs = {"train": squad.sample_questions(train_qs, cfg.max_train, cfg.seed),
              "dev": squad.sample_questions(dev_qs, cfg.max_dev, cfg.seed),
              "test": squad.sample_questions(test_qs, cfg.max_test, cfg.seed)}
        examples = {s: examples_of(v) for s, v in qs.items()}
        articles = {s: [q.article for q in v] for s, v in qs.items()}
        by_id, pools, base_res = {}, {}, {}
        for s in qs:
            res = retrieve(store, retriever, None, qs[s], max(cfg.pool_size, *cfg.recall_ks))
            base_res[s] = res
            by_id.update({p.id: p for ps in res.passages for p in ps})
            pools[s] = build_pool(
                examples[s], res.ids[:, :cfg.pool_size], res.scores[:, :cfg.pool_size], by_id,
                lm, work / f"pool_{s}", {"lm": lm.name, "retriever": retriever.identity,
                                         "split": s, "examples": [e.id for e in examples[s]],
                                         "distractors": cfg.distractors,
                                         "datastore": len(store), "pool_size": cfg.pool_size},
                part_size=cfg.part_size, progress=progress)
        frozen: dict = {}  # base embeddings of the pool passages, encoded once
        for s in ("train", "dev"):
            embed_pool(retriever, None, pools[s], examples[s], by_id, None, frozen)
        base_scores = {s: pools[s].branches.scores_NK for s in ("dev", "test")}
        base_ll = {s: pool_logliks(pools[s], base_scores[s], cfg.k) for s in ("dev", "test")}
        oracle = {s: oracle_logliks(pools[s], cfg.k) for s in ("dev", "test")}
        headroom = {s: compare(oracle[s], base_ll[s], articles[s], cfg) for s in ("dev", "test")}
        if cfg.require_headroom and not headroom["dev"]["low"] > 0:
            write_json_atomic({"config": vars(cfg), "oracle_vs_base": headroom},
                              work / "diagnostics.json")
            print("lsr_qa: no headroom on dev (the oracle is not better than the base)")
            return
        runs = {}
        for v in variants(cfg):
            name = label(v)
            out = work / "runs" / f"{slug(name)}.json"
            params_file = out.with_suffix(".npz")
            if not (out.exists() and json.loads(out.read_text()).get("config") == vars(v)):
                fit = train_on_pool(retriever, pools["train"], examples["train"], pools["dev"],
                                    examples["dev"], by_id, v, progress=progress,
                                    frozen_docs=frozen)
                save_params(fit["params"], params_file, {"variant": name})
                write_json_atomic({"config": vars(v), "best_step": fit["best_step"],
                                   "steps_run": fit["steps_run"], "curve": fit["curve"],
                                   "seconds": round(fit["seconds"], 1)}, out)
            runs[name] = json.loads(out.read_text())
            runs[name]["params"] = unflatten_params(
                dict(np.load(params_file, allow_pickle=False)), retriever.params)
        systems = {"base retriever": None} | {n: r["params"] for n, r in runs.items()}
        rows, ll_test, taus, hits, answers = {}, {}, {}, {}, {}
        # EM / F1 on max_generate test questions spread evenly over the (article-grouped) list
        n_gen = min(cfg.max_generate, len(qs["test"]))
        gen_rows = np.unique(np.linspace(0, len(qs["test"]) - 1, n_gen).round().astype(int))
        for name, params in systems.items():
            dev_s = (base_scores["dev"] if params is None else
                     pool_scores(retriever, params, pools["dev"], examples["dev"], by_id,
                                 frozen))
            taus[name], dev_ll = fit_tau(pools["dev"], dev_s, cfg.k, cfg.tau_grid)
            res = base_res["test"] if params is None else retrieve(
                store, retriever, params, qs["test"], max(cfg.k, *cfg.recall_ks))
            ll_test[name] = end_to_end(name, res, examples["test"], pools["test"], lm, by_id,
                                       work, taus[name], cfg.k, progress, cfg.part_size)
            gold = np.array([q.paragraph for q in qs["test"]])
            hits[name] = {r: (res.ids[:, :r] == gold[:, None]).any(1).astype(float)
                          for r in cfg.recall_ks}
            if gen_rows.size and (params is None or name == chosen_name(runs)):
                sub = dataclasses.replace(res, ids=res.ids[gen_rows],
                                          scores=res.scores[gen_rows],
                                          passages=[res.passages[i] for i in gen_rows])
                answers[name] = generate_answers(lm, [examples["test"][i] for i in gen_rows],
                                                 sub, by_id, taus[name], cfg.k,
                                                 cfg.max_new_tokens)
            rows[name] = {"tau": taus[name], "dev_loglik": dev_ll,
                          "test_loglik": float(np.mean(ll_test[name])),
                          **{f"recall@{r}": float(h.mean()) for r, h in hits[name].items()}}
        alone = np.array([r.total for r in lm.score_continuations(
            [e.context for e in examples["test"]],
            [e.continuation for e in examples["test"]])], np.float64)
    chosen = chosen_name(runs)
    art = articles["test"]
    base = "base retriever"
    for name in systems:
        if name == base:
            continue
        rows[name]["vs_base"] = compare(ll_test[name], ll_test[base], art, cfg)
        for r in cfg.recall_ks:
            rows[name][f"recall@{r}_vs_base"] = compare(hits[name][r], hits[base][r], art, cfg)
    primary = rows[chosen]["vs_base"]
    passes = primary["low"] > 0
    qa = {}
    for name, preds in answers.items():
        refs = [qs["test"][i].answers for i in gen_rows]
        qa[name] = {"em": [exact_match(p, a) for p, a in zip(preds, refs)],
                    "f1": [f1_score(p, a) for p, a in zip(preds, refs)], "predictions": preds,
                    "test_rows": gen_rows.tolist()}
    if len(qa) == 2:
        gen_art = [art[i] for i in gen_rows]
        qa["chosen_vs_base"] = {m: compare(qa[chosen][m], qa[base][m], gen_art, cfg)
                                for m in ("em", "f1")}
    pairs = sum(p.provenance["pairs"] for p in pools.values())
    rates = [p.provenance.get("pairs_per_second") for p in pools.values()]
    payload = {
        "config": vars(cfg), "primary_endpoint": PRIMARY_ENDPOINT, "chosen": chosen,
        "primary": primary, "min_detectable_nats": min_detectable(primary),
        "detectable_effect_stated": cfg.detectable_effect,
        "release_rule": ("passes: the chosen retriever beats its base with a 95 % interval "
                         "excluding zero" if passes else "fails: not better than its base "
                         "with an interval excluding zero; nothing is released"),
        "systems": {n: {k: v for k, v in r.items()} for n, r in rows.items()},
        "oracle_vs_base": headroom, "lm_alone_test_loglik": float(alone.mean()),
        "qa": qa, "questions": {s: len(v) for s, v in qs.items()},
        "articles": {s: len(set(a)) for s, a in articles.items()},
        "datastore_passages": len(store), "lm_pairs_scored": pairs,
        "pairs_per_second": [r for r in rates if r is not None],
        "runs": {n: {k: v for k, v in r.items() if k != "params"} for n, r in runs.items()},
        "per_example": {"test": {"ids": [q.id for q in qs["test"]], "articles": art,
                                 "lm_alone": alone.tolist(),
                                 "loglik": {n: np.round(v, 5).tolist()
                                            for n, v in ll_test.items()},
                                 "hits": {n: {str(r): h.astype(int).tolist()
                                              for r, h in hs.items()}
                                          for n, hs in hits.items()}}},
        "seconds": sw.seconds, "provenance": provenance()}
    if passes and cfg.release:
        payload["released"] = str(release(retriever, runs[chosen]["params"], cfg, chosen,
                                          rows, payload))
    write_report(payload, rows, cfg, args, chosen)


def release(retriever, params, cfg, chosen: str, rows: dict, payload: dict) -> pathlib.Path:
    """The chosen retriever as two towers in float16 (its trained query encoder, the base
    passage encoder: the datastore's embeddings stay valid), with its card and the τ fitted
    on dev; the card gives every number with its interval and the weights' SHA-256."""
    from replug_jax.models.params import split_params, to_module
    from replug_jax.train.export import write_two_towers

    graphdef, template, _ = split_params(retriever.model.encoder)
    query = dataclasses.replace(retriever.model, encoder=to_module(graphdef, template, params))
    r, p = rows[chosen], payload
    settings = {"similarity": retriever.similarity, "query_max_length":
                retriever.query_max_length, "doc_max_length": retriever.max_length,
                "trained_from": cfg.retriever, "temperature": r["tau"],
                "temperature_fit": {"data": "SQuAD train dev-split articles", "grid":
                                    list(cfg.tau_grid)}}
    card = "\n".join([
        "# REPLUG LSR retriever: all-MiniLM-L6-v2, query tower trained on SQuAD v1.1", "",
        f"Trained by REPLUG LSR from `{cfg.lm}`'s answer likelihoods ({chosen}), query tower "
        "only; the passage encoder is the base (`passage_encoder/`), so an index built with "
        f"`{cfg.retriever}` serves it. Inference τ = {r['tau']:g}, fitted on dev.", "",
        f"On {p['questions']['test']} questions of {p['articles']['test']} SQuAD dev articles "
        "no retriever trained on (datastore: every SQuAD paragraph plus "
        f"{p['datastore_passages']:,} passages in all), REPLUG k = {cfg.k}:", "",
        f"- gold-answer log-likelihood per question: {r['test_loglik']:.3f}, "
        f"{format_interval(r['vs_base'], 3)} vs the base retriever (95 % CI over articles)",
        *(f"- recall@{k}: {r[f'recall@{k}']:.3f}, "
          f"{format_interval(r[f'recall@{k}_vs_base'], 3)} vs the base" for k in cfg.recall_ks),
        "", "Made by `python -m experiments.lsr_qa`; every number is in "
        "`experiments/results/lsr_qa/`. Load with `Retriever.load(<this folder>)`, or the "
        "query encoder with `SentenceTransformer(<this folder>)` and the passage encoder "
        "with `SentenceTransformer(<this folder>/passage_encoder)`.", ""])
    out = write_two_towers(query, retriever.model, cfg.release, settings, card)
    digests = {f"{sub}model.safetensors": hashlib.sha256(
        (out / sub / "model.safetensors").read_bytes()).hexdigest()
        for sub in ("", "passage_encoder/")}
    with open(out / "MODEL_CARD.md", "a") as f:
        f.write("\nWeights (float16 safetensors), SHA-256:\n\n" + "".join(
            f"- `{name}`: `{digest}`\n" for name, digest in digests.items()))
    return out


def chosen_name(runs: dict) -> str:
    """The variant with the best dev value (the shuffled-Q control excluded)."""
    real = {n: r for n, r in runs.items() if "shuffled-Q" not in n}
    return min(real, key=lambda n: min(c["dev_bpb"] for c in real[n]["curve"]))


def write_report(payload, rows, cfg, args, chosen) -> None:
    rk = cfg.recall_ks
    table = []
    for name, r in rows.items():
        vs = r.get("vs_base")
        table.append((name + (" (chosen)" if name == chosen else ""), f"{r['tau']:g}",
                      f"{r['dev_loglik']:.3f}", f"{r['test_loglik']:.3f}",
                      format_interval(vs, 3) if vs else "—",
                      *(f"{r[f'recall@{k}']:.3f}" for k in rk),
                      format_interval(r[f"recall@{rk[0]}_vs_base"], 3) if vs else "—"))
    p, q = payload, payload["questions"]
    h = payload["oracle_vs_base"]
    em = payload["qa"].get("chosen_vs_base")
    notes = (
        f"Primary endpoint (pre-registered): {PRIMARY_ENDPOINT}. Chosen: {chosen}; "
        f"{format_interval(p['primary'], 3)} nats per question; smallest effect this test "
        f"detects (80 % power, 5 % level): {p['min_detectable_nats']:.3f} (stated before the "
        f"run: {cfg.detectable_effect}). Release rule: {p['release_rule']}.\n\n"
        f"{q['train']} train / {q['dev']} dev / {q['test']} test questions "
        f"({p['articles']['train']} / {p['articles']['dev']} / {p['articles']['test']} "
        f"articles); datastore {p['datastore_passages']:,} passages; pools of "
        f"{cfg.pool_size} per question, {p['lm_pairs_scored']:,} LM pairs scored "
        f"({', '.join(f'{r:.1f}' for r in p['pairs_per_second'])} pairs/s); k = {cfg.k}; "
        f"towers: {cfg.towers}. LM alone (closed book): {p['lm_alone_test_loglik']:.3f} nats "
        f"per question.\n\nBefore training (no LM cost): the oracle (the LM's own top-{cfg.k} "
        f"of each pool) vs the base: dev {format_interval(h['dev'], 3)}, test "
        f"{format_interval(h['test'], 3)} nats per question."
        + (f"\n\nEM / F1 on the first {len(p['qa']['base retriever']['em'])} test questions "
           f"(greedy REPLUG): chosen − base EM {format_interval(em['em'], 3)}, F1 "
           f"{format_interval(em['f1'], 3)}." if em else ""))
    out = write_results("lsr_qa", args.config, payload, table,
                        ("retriever", "τ (dev)", "dev loglik", "test loglik",
                         "test Δ vs base [95 % CI]", *(f"recall@{k}" for k in rk),
                         f"Δ recall@{rk[0]} vs base [95 % CI]"),
                        notes=notes, root=args.out, differences=DIFFERENCES)
    fig, ax = new_figure(figsize=(6, 3.5))
    for name, r in payload["runs"].items():
        ax.plot([c["step"] for c in r["curve"]], [c["dev_bpb"] for c in r["curve"]],
                marker="o", ms=3, label=name)
    ax.set_xlabel("LSR step")
    ax.set_ylabel("dev bits per answer byte (within pool)")
    ax.legend(fontsize=6)
    save_figure(fig, out / f"{args.config}.png")


if __name__ == "__main__":
    run(main)
