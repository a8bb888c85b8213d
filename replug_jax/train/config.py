"""Typed LSR configuration. Defaults are the paper's §5.2 values. Readable without JAX
(a test imports it in a process that has none loaded)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import ClassVar, Literal

from replug_jax import config
from replug_jax.mesh_spec import parse_mesh
from replug_jax.models.registry import DEFAULT_LM
from replug_jax.train.spec import (  # noqa: F401 (MARGINAL_NEEDS_SUM re-exported)
    MARGINAL_NEEDS_SUM,
    ObjectiveConfig,
    OptimConfig,
    marginal_score_ok,
)


@dataclasses.dataclass(frozen=True)
class LSRConfig:
    # the typed pieces (train/spec.py) and the settings of the LM and the index, as dotted
    # keys: `--set objective.gamma=1`, `lm.dtype=bfloat16`, `index.factory=IVF4096,Flat`
    PIECES: ClassVar[dict] = {
        "objective": {f.name: f.name for f in dataclasses.fields(ObjectiveConfig)},
        "supervision": {"kind": "supervision", "train_pool": "train_pool",
                        "dev_pool": "dev_pool", "towers": "towers", "shuffle_q": "shuffle_q"},
        "selection": {"metric": "select_on", "patience": "patience", "every": "eval_every",
                      "recall_data": "recall_data",
                      "tau": "eval_tau", "tau_grid": "tau_grid", "beta_grid": "beta_grid"},
        "optim": {f.name: f.name for f in dataclasses.fields(OptimConfig)},
        "lm": {"name": "lm", "api_base": "lm_api_base", "api_concurrency": "lm_api_concurrency",
               "api_batch_size": "lm_api_batch_size", "prefetch": "lm_prefetch",
               "dtype": "lm_dtype", "mesh": "lm_mesh", "tokens_per_batch": "lm_tokens_per_batch",
               "max_context": "lm_max_context"},
        "index": {"factory": "index_factory", "backend": "index_backend",
                  "dtype": "index_dtype", "refresh_every": "refresh_every",
                  "refresh_mode": "refresh_mode", "refresh_lag": "refresh_lag",
                  "refresh_devices": "refresh_devices", "prescore_pool": "prescore_pool"},
    }
    # models
    retriever: str = "facebook/contriever"  # paper: Contriever
    lm: str = DEFAULT_LM  # paper: GPT-3 Curie (any LMScorer works; an API via lm_api_base)
    lm_api_base: str | None = None
    # a served LM: requests in flight, and prompts per scoring request where the server
    # takes a list (probed: vLLM and `replug serve` do)
    lm_api_concurrency: int = 4
    lm_api_batch_size: int = 16
    # score the next step's predicted pairs while the current step trains (same scores and
    # updates; train/prefetch.py)
    lm_prefetch: bool = True
    # the in-process LM: "auto" = bfloat16 on accelerators, float32 on CPU; a mesh such as
    # "model=8" or "data=2,model=4" shards it over the devices (every process's); a mesh of
    # fewer devices than exist takes the last ones: the LM on its own devices, apart from
    # training's first num_devices
    lm_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    lm_mesh: str = ""
    # the in-process LM's tokens per scoring call (0: its default, 4096); on an accelerator
    # raise it so that every device gets many rows (under data=8, 4096 leaves one 448-token
    # row per device)
    lm_tokens_per_batch: int = 0
    similarity: Literal["cosine", "dot"] = "cosine"  # Eq. 1; the official code used dot
    # data
    task: Literal["qa", "lm"] = "qa"
    # JSONL: qa {"id","question","answer","gold_doc"? | "gold_passage"?} (the corpus's
    # document id, or passage ids of the store); lm {"id","text"}
    data: str = ""
    dev_data: str = ""
    dev_examples: int = 0  # evaluate on the first N dev examples (0 = all)
    # the retrieval corpus (disjoint from the LM data): a JSONL/text/parquet/TSV file chunked
    # below, or an index folder / its passages.arrow, read by id without loading it
    corpus: str = ""
    chunk_size: int = 100  # 0: every corpus record is one passage
    chunk_unit: Literal["words", "tokens"] = "words"  # tokens: the LM's tokenizer (§5.2: 128)
    # lm task: passages of an example's own document that overlap its window ("window"), all
    # of that document's passages ("document") or none ("none") are never retrieved for it
    leakage: Literal["window", "document", "none"] = "document"
    context_tokens: int = 128  # lm task: x = first 128 tokens, y = next 128 (§5.2)
    continuation_tokens: int = 128
    query_max_length: int = 128
    doc_max_length: int = 128
    separator: str = "\n\n"
    # The LM prompt, built as at inference (replug_jax.prompts): qa examples follow these
    # few-shot {"question","answer"} JSONL demonstrations; every branch d ∘ x is cut to fit
    # lm_max_context tokens. Match the evaluation's prompt so Q is the distribution REPLUG mixes.
    qa_demonstrations: str = ""
    lm_max_context: int = 1024
    # objective (§4): γ a number, "fitted" or "learned"; β a number or "fitted" (pool
    # supervision: fitted on the dev pool; spec.ObjectiveConfig); Q from the continuation's
    # summed log-probability (the paper's P_LM(y|d,x)), or its mean (spec.LM_SCORE_MEAN_NOTE)
    k: int = 20
    gamma: float | str = 0.1
    beta: float | str = 0.1
    direction: Literal["retriever_to_lm", "lm_to_retriever"] = "retriever_to_lm"
    lm_score: Literal["mean", "sum"] = "sum"
    objective: Literal["kl", "marginal"] = "kl"
    gamma_learning_rate: float = 1e-3  # gamma="learned" only: its own Adam
    # supervision: "online" (retrieve from the index, score new pairs with the LM) or "pool"
    # (pre-scored pools, DESIGN.md "LSR on a pre-scored pool": each query's pool re-ranked by
    # the current retriever, its top-k the retrieved set; no LM and no index in the loop)
    supervision: Literal["online", "pool"] = "online"
    train_pool: str = ""  # pool: the train pool's folder (train.pool.ScoredPool)
    dev_pool: str = ""  # pool: the dev pool's folder: the dev curve, τ and fitted γ/β
    # "shared": one encoder for queries and documents (the paper's Contriever); "query" (pool
    # supervision): only the query tower learns, documents keep the base encoder's embeddings
    # (an index built with the base stays valid; released as two towers)
    towers: Literal["shared", "query"] = "shared"
    shuffle_q: bool = False  # the control: Q permuted within each pool (pool supervision)
    # selection (pool supervision): every eval_every steps the dev curve is read; "last" keeps
    # the last step (a fixed budget), "pool_loglik" the best dev-pool REPLUG log-likelihood,
    # "recall@1" the best dev recall@1 over the whole datastore among the steps whose dev-pool
    # log-likelihood is not below the base's; patience: evaluations without a new best before
    # stopping (0: never stop early)
    select_on: Literal["last", "pool_loglik", "recall@1"] = "last"
    patience: int = 0
    # select_on="recall@1" from `replug train-lsr`: the questions (JSONL with gold_doc) whose
    # recall@1 over the index selects the step ("": dev_data, the dev pool's own questions);
    # thousands of them cost no LM pair, where the dev pool's every question is LM-scored
    recall_data: str = ""
    # τ of λ on the dev curve (§3.2: 1); 0: fitted on the dev pool at each evaluation over
    # tau_grid (the τ an end-to-end test with a fitted τ uses)
    eval_tau: float = 0.0
    tau_grid: tuple = (0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0)
    beta_grid: tuple = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)  # beta="fitted"
    # optimisation (§5.2)
    optimizer: Literal["adam", "adamw"] = "adam"
    learning_rate: float = 2e-5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.1
    grad_clip: float = 1.0
    # recompute encoder activations in the backward pass (a third more compute, activation
    # memory of one layer); None: on for accelerators (64 x 20 passages do not fit a GPU or a
    # v5e chip without it), off on a CPU
    remat: bool | None = None
    batch_size: int = 64
    total_steps: int = 25_000
    # index refresh (§4.4)
    refresh_every: int = 3_000
    refresh_mode: Literal["background", "sync"] = "background"
    refresh_lag: int = 0  # background: swap at refresh step + lag (0 = refresh_every // 10)
    # devices that re-embed the corpus at a refresh: 0 = the retriever's (every local device
    # on GPU/TPU, shared with training); n = the last n local devices of each process, a share
    # set apart (give training the others with num_devices). Not with index_backend="jax",
    # whose corpus rows live on the training mesh.
    refresh_devices: int = 0
    index_factory: str = "Flat"
    # Cheaper supervision, same math: before the first step, score the top-`prescore_pool`
    # candidates of the initial index for every example the run will see, in large batches;
    # steps then only score pairs that retrieval brings in after a refresh (0 = off).
    prescore_pool: int = 0
    # "faiss": a FAISS index rebuilt at each refresh (index_factory); "jax": exact top-k over
    # the corpus embeddings held as an index_dtype array sharded along N over the mesh (no
    # FAISS rebuild; every device searches its rows, replicas merge the top-k); "auto": "jax"
    # for a Flat index on GPUs and TPUs (a 64-query search over 21M passages: milliseconds on
    # the devices, seconds in FAISS on the host), "faiss" on a CPU or for other factories
    index_backend: Literal["auto", "faiss", "jax"] = "auto"
    # "auto": float32 on CPU (faster there), bfloat16 on accelerators (retrieval.storage_dtype)
    index_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # bookkeeping
    seed: int = 0
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    eval_every: int = 0  # 0 = only at the end
    num_devices: int = 0  # 0 = all

    def __post_init__(self):
        checks = [
            (self.k > 0, "k must be positive"),
            (self.patience >= 0, "patience must be >= 0"),
            (self.eval_tau >= 0 and (self.eval_tau > 0 or len(self.tau_grid) > 0),
             "eval_tau must be > 0, or 0 with a tau_grid to fit"),
            (all(isinstance(t, (int, float)) and t > 0 for t in (*self.tau_grid,
                                                                  *self.beta_grid)),
             "tau_grid and beta_grid must hold positive numbers"),
            (self.supervision == "pool" or (self.towers == "shared" and not self.shuffle_q
                                            and self.select_on == "last"),
             "towers='query', shuffle_q and select_on other than 'last' need "
             "supervision='pool'"),
            (self.supervision == "online" or bool(self.train_pool),
             "supervision='pool' needs train_pool (a pool folder)"),
            (bool(self.dev_pool) or not (self.select_on != "last" or isinstance(
                self.gamma, str) or isinstance(self.beta, str)),
             "select_on, gamma or beta fitted/learned need dev_pool"),
            (self.learning_rate > 0, "learning_rate must be > 0"),
            (0 <= self.warmup_ratio < 1, "warmup_ratio must be in [0, 1)"),
            (self.batch_size > 0, "batch_size must be positive"),
            (self.lm_max_context > 0, "lm_max_context must be positive"),
            (self.lm_tokens_per_batch >= 0, "lm_tokens_per_batch must be >= 0 (0: default)"),
            (self.lm_api_concurrency > 0 and self.lm_api_batch_size > 0,
             "lm_api_concurrency and lm_api_batch_size must be positive"),
            (self.prescore_pool >= 0 and self.dev_examples >= 0,
             "prescore_pool and dev_examples must be >= 0"),
            (self.total_steps > 0, "total_steps must be positive"),
            (self.refresh_every > 0, "refresh_every must be positive"),
            (self.checkpoint_every > 0, "checkpoint_every must be positive"),
            (self.keep_checkpoints > 0, "keep_checkpoints must be positive"),
            (self.remat is None or isinstance(self.remat, bool),
             f"remat must be true, false or null (auto), got {self.remat!r}"),
            (isinstance(self.lm_prefetch, bool),
             f"lm_prefetch must be true or false, got {self.lm_prefetch!r}"),
            (self.refresh_lag < self.refresh_every,
             f"refresh_lag ({self.refresh_lag}) must be smaller than refresh_every "
             f"({self.refresh_every}): a longer lag would silently skip refreshes"),
            (marginal_score_ok(self.objective, self.lm_score), MARGINAL_NEEDS_SUM),
            (self.refresh_devices >= 0, "refresh_devices must be >= 0"),
            (not (self.refresh_devices and self.index_backend == "jax"),
             "refresh_devices needs index_backend='faiss': the JAX index embeds the corpus "
             "rows on the training mesh that holds them"),
        ]
        for literal, allowed in (("similarity", ("cosine", "dot")), ("task", ("qa", "lm")),
                                 ("chunk_unit", ("words", "tokens")),
                                 ("leakage", ("window", "document", "none")),
                                 ("direction", ("retriever_to_lm", "lm_to_retriever")),
                                 ("lm_score", ("mean", "sum")),
                                 ("objective", ("kl", "marginal")),
                                 ("supervision", ("online", "pool")),
                                 ("towers", ("shared", "query")),
                                 ("select_on", ("last", "pool_loglik", "recall@1")),
                                 ("optimizer", ("adam", "adamw")),
                                 ("refresh_mode", ("background", "sync")),
                                 ("index_backend", ("auto", "faiss", "jax")),
                                 ("index_dtype", ("auto", "bfloat16", "float32")),
                                 ("lm_dtype", ("auto", "float32", "bfloat16"))):
            checks.append((getattr(self, literal) in allowed,
                           f"{literal} must be one of {allowed}, got {getattr(self, literal)!r}"))
        for ok, message in checks:
            if not ok:
                raise ValueError(f"bad config: {message}")
        try:
            self.objective_config  # γ and β: a number or a name, checked once, there
        except ValueError as err:
            raise ValueError(f"bad config: {err}") from None
        if self.lm_mesh:
            try:
                parse_mesh(self.lm_mesh)
            except ValueError as err:
                raise ValueError(f"bad config: lm_mesh: {err}") from None

    def resolved_index_backend(self, backend: str | None = None) -> str:
        """``index_backend`` with "auto" decided for ``backend`` (default: JAX's): the exact
        JAX index for a Flat index on an accelerator when no separate refresh devices are
        set, else FAISS."""
        if self.index_backend != "auto":
            return self.index_backend
        import jax

        on_device = (backend or jax.default_backend()) != "cpu"
        return "jax" if on_device and self.index_factory == "Flat" and \
            not self.refresh_devices else "faiss"

    @property
    def objective_config(self) -> ObjectiveConfig:
        """The loss's piece of this config (what :func:`~replug_jax.train.lsr.make_train_step`
        reads)."""
        return ObjectiveConfig(self.objective, self.direction, self.gamma, self.beta,
                               self.lm_score, self.gamma_learning_rate)

    def with_objective(self, objective: ObjectiveConfig) -> "LSRConfig":
        """This config minimising ``objective`` instead (its fields stored flat)."""
        return dataclasses.replace(self, **dataclasses.asdict(objective))

    @property
    def optim_config(self) -> OptimConfig:
        """The optimizer's piece (``optim_config.build(total_steps)``)."""
        return OptimConfig(self.optimizer, self.learning_rate, self.weight_decay,
                           self.warmup_ratio, self.grad_clip)

    @property
    def lag(self) -> int:
        if self.refresh_mode == "sync":
            return 0
        return self.refresh_lag or max(1, self.refresh_every // 10)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint(self, ignore=("total_steps", "checkpoint_every",
                                  "keep_checkpoints", "remat", "prescore_pool",
                                  "dev_examples", "lm_mesh", "lm_tokens_per_batch",
                                  "lm_api_concurrency",
                                  "lm_api_batch_size", "lm_prefetch")) -> str:
        """A hash of everything that changes the training trajectory (not where the LM runs:
        a sharded LM scores as one device does). Fields added since a run was made count only
        when set away from their defaults, so older work directories keep their hashes; the
        evaluation cadence counts only where it selects the step (pool supervision)."""
        d = {k: v for k, v in self.to_json().items() if k not in ignore}
        if d["lm_dtype"] == "auto":  # as every run was before the field: old hashes hold
            del d["lm_dtype"]
        defaults = LSRConfig.__dataclass_fields__
        for name in LATER_FIELDS:
            if d[name] == defaults[name].default:
                del d[name]
        if self.supervision == "online":
            del d["eval_every"]
        d["index_backend"] = self.resolved_index_backend()  # what the run uses
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# fields added with pool supervision and the temperatures as research variables (issue 65, 66)
LATER_FIELDS = ("gamma_learning_rate", "supervision", "train_pool", "dev_pool", "towers",
                "shuffle_q", "select_on", "patience", "eval_tau", "tau_grid", "beta_grid",
                "recall_data")


def apply_overrides(cfg: LSRConfig, overrides: list[str]) -> LSRConfig:
    return config.apply_overrides(cfg, overrides)


def load_config(spec: str, overrides: list[str] = ()) -> tuple[LSRConfig, str]:
    """``path/to/config.py[:variant]`` -> (config, variant); see :mod:`replug_jax.config`."""
    return config.load(spec, overrides, cls=LSRConfig)
