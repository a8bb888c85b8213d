"""The LSR temperature study: γ × β × objective on pools already scored, one command (the
design and its reasons in ``experiments/configs/lsr_temperature.py``).

1. The ``study`` config's train and dev pools, rebuilt from its carry folder (no LM pair is
   scored: ``lsr_qa --pool-sets train,dev``), and the base embeddings of their passages.
2. The measured temperatures: entropies of P_R over the base's top-k at each γ (and at the
   fitted τ) and of Q at each β, on the train pools.
3. Every variant trained by the one trainer (:class:`replug_jax.train.loop.LSRTrainer`,
   ``supervision="pool"``, query tower, each resumable in its own work folder) for a fixed
   budget, its dev curve read every ``eval_every`` steps; the kept step's dev recall@1 (over
   the whole datastore, ``recall_dev`` questions) and dev-pool log-likelihood (τ fitted)
   against the base, 95 % intervals clustered by article.
4. ``experiments/results/lsr_temperature/<config>.{json,md,png}``: the table and a figure of
   γ against both dev endpoints; each finished run's JSON in ``<config>_runs/`` (committed
   as the study grows, so a study longer than a session resumes on another machine).

These are dev numbers, for choosing what a registered study tests: the kept step is chosen
on the same dev questions it is reported on (an optimistic reading, by design).

Usage: ``python -m experiments.lsr_temperature [--config default|tiny] [--set key=value]``.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import shutil
import types

import numpy as np

from experiments.configs.lsr_qa import CONFIGS as QA_CONFIGS
from experiments.configs.lsr_temperature import CONFIGS
from experiments.lib import squad
from experiments.lib.common import (
    new_figure,
    parse_experiment_args,
    provenance,
    run,
    save_figure,
    write_results,
)
from experiments.lib.lsr_common import BASE_DATA, label, variants
from experiments.lib.pool_study import Fold, train_variants
from experiments.lsr_qa import QATask, pool_scores, retrieve
from replug_jax.config import apply_overrides
from replug_jax.eval.stats import paired_bootstrap
from replug_jax.train.config import LSRConfig, SelectionConfig
from replug_jax.train.pool import (
    fit_pool_tau,
    masked_log_softmax,
    pool_logliks,
    top_k_in_pool,
)

NAME = "lsr_temperature"


def entropy(log_p: np.ndarray, valid: np.ndarray) -> np.ndarray:
    p = np.where(valid, np.exp(log_p), 0.0)
    return -np.sum(np.where(valid, p * np.where(valid, log_p, 0.0), 0.0), axis=-1)


def measured_entropies(pool, k: int, gammas, betas) -> dict:
    """Mean entropies (nats) over the base's top-``k`` of each train pool: P_R = softmax(s/γ)
    at each γ, Q = softmax(score/β) at each β for the summed and the mean log-probability;
    and the median gap between the base's top-1 and top-``k`` cosine. Uniform: ln k."""
    c = pool.branches
    top = top_k_in_pool(c.scores_NK, c.doc_mask_NK, k)
    pick = lambda a: np.take_along_axis(a, top, axis=1)  # noqa: E731
    valid, s = pick(c.doc_mask_NK), pick(c.scores_NK.astype(np.float64))
    full = valid.all(1)
    out = {"uniform": float(np.log(k)), "top1_topk_gap_median": float(np.median(
        (s[:, 0] - s[:, k - 1])[full])), "retriever": {}, "lm": {}}
    for g in gammas:
        out["retriever"][f"{g:g}"] = float(np.mean(
            entropy(masked_log_softmax(s / g, valid), valid)))
    for reduction in ("sum", "mean"):
        lm = pick(pool.lm_scores(reduction).astype(np.float64))
        for b in betas:
            out["lm"][f"{reduction}/β={b:g}"] = float(np.mean(
                entropy(masked_log_softmax(lm / b, valid), valid)))
    return out


@dataclasses.dataclass
class Runs:
    """What :func:`experiments.lib.pool_study.train_variants` needs of a task: the grid
    config, the models and passages, and what each run stores (its dev values per question)."""
    cfg: object
    retriever: object
    by_id: dict
    progress: bool
    frozen: dict
    measure_fn: object

    def measure(self, fold, params) -> dict:
        return self.measure_fn(params)


def open_pools(cfg, args):
    """The lsr_qa study's task with its train and dev pools (from the carry; nothing scored)."""
    qa_cfg = apply_overrides(dataclasses.replace(QA_CONFIGS[cfg.study], workdir=cfg.workdir),
                             list(cfg.study_overrides))
    ns = types.SimpleNamespace(config=cfg.study, no_progress=args.no_progress,
                               carry=pathlib.Path(cfg.carry) if cfg.carry else None,
                               pool_sets="train,dev")
    task = QATask.open(qa_cfg, ns)
    task.build_pools()
    pools = {s: task.pools[s] for s in ("train", "dev")}
    examples = {s: task.examples[s] for s in ("train", "dev")}
    task.embed_base({s: (pools[s], examples[s]) for s in pools})  # kept on disk
    return qa_cfg, task, pools, examples


def dev_measures(task, train, pools, examples, recall_qs):
    """``measure(params)``: each recall question's hit at rank 1 of the whole datastore and
    each dev-pool question's REPLUG log-likelihood (``train.k`` documents) at the τ fitted on
    the dev pool (over ``train.selection.tau_grid``)."""
    gold = np.array([q.paragraph for q in recall_qs])

    def hits(params) -> np.ndarray:
        return retrieve(task.study.store, task.retriever, params, recall_qs,
                        1).ids[:, 0] == gold

    def measure(params) -> dict:
        s = pool_scores(task.retriever, params, pools["dev"], examples["dev"], task.by_id,
                        task.frozen)
        tau, _ = fit_pool_tau(pools["dev"], s, train.k, train.selection.tau_grid)
        return {"dev_recall_hits": hits(params).astype(int).tolist(), "dev_tau": tau,
                "dev_pool_logliks": pool_logliks(pools["dev"], s, train.k, tau).tolist()}
    return hits, measure


def by_article(articles: list[str]) -> list[str] | None:
    """Cluster labels for an interval over articles; None (over questions) when one article
    holds them all (stated in the results as ``interval_unit``)."""
    return articles if len(set(articles)) > 1 else None


def summarize(runs: dict, base: dict, recall_arts, pool_arts, cfg) -> list[dict]:
    rows = []
    kw = dict(resamples=cfg.bootstrap_resamples, seed=cfg.seed)
    recall_arts, pool_arts = by_article(recall_arts), by_article(pool_arts)
    for name, r in runs.items():
        hits, ll = np.array(r["dev_recall_hits"], float), np.array(r["dev_pool_logliks"])
        kept = next(c for c in r["curve"] if c["step"] == r["best_step"])
        trained = r["curve"][1:]
        settings = LSRConfig.from_record(r["config"])
        o = settings.objective
        rows.append({
            "variant": name, "config": {
                "objective": o.kind, "direction": o.direction, "gamma": o.gamma,
                "beta": o.beta, "lm_score": o.lm_score, "total_steps": settings.total_steps},
            "temperatures": r["temperatures"], "best_step": r["best_step"],
            "steps_run": r["steps_run"], "seconds": r["seconds"],
            "dev_recall@1": float(hits.mean()),
            "dev_recall@1_vs_base": paired_bootstrap(
                hits, np.array(base["dev_recall_hits"], float), clusters=recall_arts, **kw),
            "dev_pool_loglik": float(ll.mean()), "dev_tau": r["dev_tau"],
            "dev_pool_loglik_vs_base": paired_bootstrap(
                ll, np.array(base["dev_pool_logliks"]), clusters=pool_arts, **kw),
            "kept_point": kept,
            "train_entropy_retriever": float(np.mean([c["entropy_retriever"] for c in trained])),
            "train_entropy_lm": float(np.mean([c["entropy_lm"] for c in trained])),
            "curve": [{k: c[k] for k in ("step", "dev_recall@1", "dev_loglik", "tau", "loss",
                                         "gamma") if k in c} for c in r["curve"]]})
    return rows


def _fmt(d: dict, digits: int = 3) -> str:
    return f"{d['difference']:+.{digits}f} [{d['low']:+.{digits}f}, {d['high']:+.{digits}f}]"


def plot(rows: list[dict], cfg, path: pathlib.Path) -> str:
    xs = [str(g) if isinstance(g, str) else f"{g:g}" for g in cfg.gammas]
    fig, axes = new_figure(2, figsize=(11, 4.2))
    series: dict = {}
    for r in rows:
        c = r["config"]
        key = "marginal" if c["objective"] == "marginal" else f"KL(P_R‖Q), β={c['beta']}"
        g = c["gamma"]
        series.setdefault(key, []).append((xs.index(str(g) if isinstance(g, str) else f"{g:g}"),
                                           r))
    for i, (key, pts) in enumerate(sorted(series.items())):
        pts.sort()
        off = (i - (len(series) - 1) / 2) * 0.08
        for ax, metric in zip(axes, ("dev_recall@1_vs_base", "dev_pool_loglik_vs_base")):
            d = [p[1][metric] for p in pts]
            x = np.array([p[0] for p in pts]) + off
            ax.errorbar(x, [v["difference"] for v in d],
                        yerr=[[v["difference"] - v["low"] for v in d],
                              [v["high"] - v["difference"] for v in d]],
                        marker="o", capsize=3, label=key)
    for ax, title in zip(axes, ("dev recall@1 over the datastore, LSR − base",
                                "dev-pool gold-answer log-likelihood (τ fitted), LSR − base")):
        ax.axhline(0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(xs)), xs)
        ax.set_xlim(-0.5, len(xs) - 0.5)
        ax.set_xlabel("γ (retriever temperature in training)")
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle("LSR temperature study (kept step of each run; 95 % intervals over articles)",
                 fontsize=10)
    save_figure(fig, path)
    return path.name


def main(argv=None):
    args, cfg = parse_experiment_args(argv, __doc__, CONFIGS, extra=lambda ap: ap.add_argument(
        "--report-only", action="store_true",
        help="train nothing: report the variants finished so far (a partial result while "
             "the study runs, stated as such)"))
    qa_cfg, task, pools, examples = open_pools(cfg, args)
    recall_qs = squad.sample_questions(task.study.dev_all, cfg.recall_dev, cfg.seed)
    hits, measure = dev_measures(task, cfg.train, pools, examples, recall_qs)
    grid_cfg = dataclasses.replace(
        qa_cfg, train=cfg.train, grid=tuple(itertools.product(cfg.gammas, cfg.betas)),
        objectives=tuple(cfg.objectives), shuffled_control=False)
    fold = Fold(0, pools, examples, pathlib.Path(cfg.workdir) / f"{NAME}_{args.config}",
                dev_recall=lambda params: float(np.mean(hits(params))))
    base = measure(None)
    # finished runs' JSONs (curve, temperatures, dev values per question) are kept in
    # the results folder, committed as the study grows: a run found there is not trained
    # again on another machine (its weights are not kept: the study reports dev values)
    kept = pathlib.Path(args.out) / NAME / f"{args.config}_runs"
    fold.run_dir.mkdir(parents=True, exist_ok=True)
    for js in kept.glob("*.json"):
        if not (fold.run_dir / js.name).exists():
            shutil.copy(js, fold.run_dir / js.name)
    context = dict(args=args, cfg=cfg, qa_cfg=qa_cfg, task=task, pools=pools,
                   recall_qs=recall_qs, base=base, grid_cfg=grid_cfg)

    reported = []  # the run count of the last report written (after a finished run)

    def keep(path: pathlib.Path, runs: dict) -> None:
        kept.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, kept / path.name)
        report(runs, **context)  # the result so far, stated as partial until the last
        reported.append(len(runs))

    runs = train_variants(Runs(grid_cfg, task.retriever, task.by_id, task.progress,
                               task.frozen, measure), fold, on_run=keep,
                          only_finished=args.report_only)
    if runs and reported[-1:] != [len(runs)]:  # nothing trained now, or read back after
        report(runs, **context)


def report(runs: dict, *, args, cfg, qa_cfg, task, pools, recall_qs, base, grid_cfg) -> None:
    """The study's table, JSON and figure from the runs finished so far (all of them, or a
    partial result that says how many)."""
    rows = summarize(runs, base, [q.article for q in recall_qs],
                     [q.article for q in task.study.pool_sets["dev"]], cfg)
    base_fit = next(iter(runs.values()))["temperatures"].get("base_fitted", {})
    ent = measured_entropies(pools["train"], cfg.train.k,
                             sorted({base_fit.get("tau", 0.02), 0.02, 0.05, 0.1, 1.0}),
                             sorted({1.0, 0.1, base_fit.get("beta", 1.0)}))
    names = [label(v) for v in variants(grid_cfg)]
    payload = {"config": dataclasses.asdict(cfg), "study": cfg.study, "variants": names,
               "finished": f"{len(runs)} of {len(names)} variants"
                           + ("" if len(runs) == len(names) else " (partial result)"),
               "questions": {"train": len(pools["train"]), "dev_pool": len(pools["dev"]),
                             "dev_recall": len(recall_qs)},
               "datastore_passages": len(task.study.store),
               "base": {"dev_recall@1": float(np.mean(base["dev_recall_hits"])),
                        "dev_pool_loglik": float(np.mean(base["dev_pool_logliks"])),
                        "dev_tau": base["dev_tau"], "fitted": base_fit},
               "interval_unit": {name: "articles" if by_article(arts) else "questions"
                                 for name, arts in (("dev_recall", [q.article for q in
                                                                    recall_qs]),
                                                    ("dev_pool", [q.article for q in
                                                                  task.study.pool_sets["dev"]]))},
               "entropies": ent, "rows": rows,
               # the variants' training time, summed over sessions (a run resumes)
               "seconds": round(sum(r["seconds"] for r in runs.values()), 1),
               "provenance": provenance()}
    out_dir = pathlib.Path(args.out) / NAME
    out_dir.mkdir(parents=True, exist_ok=True)
    payload["plot"] = plot(rows, cfg, out_dir / f"{args.config}.png")
    write_report(args, cfg, payload, rows, cfg.train.k, len(pools["dev"]))


def write_report(args, cfg, payload: dict, rows: list[dict], k: int, dev_pool: int) -> None:
    """The results table, its notes and the JSON (:func:`write_results`)."""
    ent, base, base_fit = payload["entropies"], payload["base"], payload["base"]["fitted"]
    table = [(r["variant"], f"{r['temperatures']['gamma_used']:.3g}"
              + (f" → {r['temperatures']['gamma_now']:.3g}" if "gamma_now" in
                 r["temperatures"] else ""),
              f"{r['temperatures']['beta_used']:.3g}" if r["config"]["objective"] != "marginal"
              else "—", f"{r['best_step']}/{r['steps_run']}",
              f"{r['train_entropy_retriever']:.3f}", f"{r['train_entropy_lm']:.3f}",
              f"{r['dev_recall@1']:.3f}", _fmt(r["dev_recall@1_vs_base"]),
              f"{r['dev_pool_loglik']:.3f}", _fmt(r["dev_pool_loglik_vs_base"]))
             for r in rows]
    q = payload["questions"]
    notes = (f"**{payload['finished']}.** "
             f"Dev numbers of `{cfg.study}`'s pools ({q['train']} train questions; dev "
             f"recall@1 over the whole datastore of {payload['datastore_passages']:,} "
             f"passages on {q['dev_recall']:,} questions of the held-out dev articles; dev-pool "
             f"log-likelihood on its {dev_pool} dev-pool questions, τ fitted per "
             f"retriever; 95 % intervals over {payload['interval_unit']['dev_recall']} and "
             f"{payload['interval_unit']['dev_pool']}). Base: recall@1 "
             f"{base['dev_recall@1']:.3f}, dev-pool log-likelihood "
             f"{base['dev_pool_loglik']:.3f} at τ = "
             f"{base['dev_tau']:g}; fitted on the dev pool: τ = {base_fit.get('tau')}, "
             f"β = {base_fit.get('beta')}"
             + (" (on a bound of beta_grid: the mean KL(P_R‖Q) still falls there)"
                if base_fit.get("beta") in (min(SelectionConfig.beta_grid),
                                            max(SelectionConfig.beta_grid))
                else "") + f". Each run's step is kept by {cfg.train.selection.metric} on "
             "these same dev questions (optimistic: for choosing what to register, not a "
             "result). Entropies (nats; uniform over k = "
             f"{k}: {ent['uniform']:.3f}) of P_R over the base's top-k on the train "
             "pools: " + ", ".join(f"γ={g}: {v:.3f}" for g, v in ent["retriever"].items())
             + "; of Q: " + ", ".join(f"{g}: {v:.3f}" for g, v in ent["lm"].items())
             + f"; median top-1 − top-{k} cosine gap "
             f"{ent['top1_topk_gap_median']:.3f}.")
    write_results(NAME, args.config, payload, table,
                  ("variant", "γ (used → learned)", "β", "kept step / run",
                   "H(P_R) in training", "H(Q) in training", "dev recall@1",
                   "Δ recall@1 [95 % CI]", "dev-pool loglik", "Δ loglik [95 % CI]"),
                  notes=notes, root=pathlib.Path(args.out),
                  differences=("Paper: Contriever under GPT-3 Curie, γ = β = 0.1 on dot "
                               "products, the whole index retrieved, 25k steps. Here: "
                               "all-MiniLM-L6-v2 (cosine) under SmolLM2-135M, only the query "
                               "tower trained, pools of the base's top-8 re-ranked, "
                               f"{cfg.train.total_steps} steps. " + BASE_DATA))


if __name__ == "__main__":
    run(main)
