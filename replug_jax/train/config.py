"""Typed LSR configuration: one tree of pieces, each checked where it is declared and each
handed to the code that reads it. Defaults are the paper's §5.2 values. Readable without JAX
(a test imports it in a process that has none loaded).

``--set objective.gamma=1``, ``{"objective": {"gamma": 1}}`` and Python's
``LSRConfig(objective=ObjectiveConfig(gamma=1.0))`` name the same field; the flat names of
earlier releases (``gamma``) are refused with the new one (:data:`RENAMED`), and a stored run
record in the old flat form still loads (:meth:`LSRConfig.from_record`) and hashes as it did
(:meth:`LSRConfig.fingerprint`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import ClassVar, Literal

from replug_jax import config
from replug_jax.config import parse_mesh
from replug_jax.models.registry import DEFAULT_LM
from replug_jax.train.spec import ObjectiveConfig, OptimConfig


def _check(checks, obj, piece: str) -> None:
    """Raise the first value outside its ``Literal`` choices or failed check as ``bad config:
    piece: message``."""
    for message in config.choice_errors(obj) + [m for ok, m in checks if not ok]:
        raise ValueError(f"bad config: {piece}: {message}")


@dataclasses.dataclass(frozen=True)
class RetrieverConfig:
    """The dense retriever trained (§3.1, Eq. 1): a registry name or a folder, its similarity
    (the official code used ``dot``) and the tokens kept of a query and of a passage."""

    name: str = "facebook/contriever"  # paper: Contriever
    similarity: Literal["cosine", "dot"] = "cosine"
    query_max_length: int = 128
    doc_max_length: int = 128

    def __post_init__(self):
        _check([(self.query_max_length > 0 and self.doc_max_length > 0,
                 "query_max_length and doc_max_length must be positive")], self, "retriever")


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """The frozen LM whose likelihoods supervise (§4.2; paper: GPT-3 Curie): in process, or
    served at ``api_base`` (any LMScorer works)."""

    name: str = DEFAULT_LM
    api_base: str | None = None
    # a served LM: requests in flight, and prompts per scoring request where the server
    # takes a list (probed: vLLM and `replug serve` do)
    api_concurrency: int = 4
    api_batch_size: int = 16
    # score the next step's predicted pairs while the current step trains (same scores and
    # updates; train/prefetch.py)
    prefetch: bool = True
    # the in-process LM: "auto" = bfloat16 on accelerators, float32 on CPU; a mesh such as
    # "model=8" or "data=2,model=4" shards it over the devices (every process's); a mesh of
    # fewer devices than exist takes the last ones: the LM on its own devices, apart from
    # training's first num_devices
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    mesh: str = ""
    # the in-process LM's tokens per scoring call (0: its default, 4096); on an accelerator
    # raise it so that every device gets many rows (under data=8, 4096 leaves one 448-token
    # row per device)
    tokens_per_batch: int = 0
    # every branch d ∘ x is cut to fit this many tokens
    max_context: int = 1024

    def __post_init__(self):
        _check([(self.max_context > 0, "max_context must be positive"),
                (self.tokens_per_batch >= 0, "tokens_per_batch must be >= 0 (0: default)"),
                (self.api_concurrency > 0 and self.api_batch_size > 0,
                 "api_concurrency and api_batch_size must be positive"),
                (isinstance(self.prefetch, bool),
                 f"prefetch must be true or false, got {self.prefetch!r}")], self, "lm")
        if self.mesh:
            try:
                parse_mesh(self.mesh)
            except ValueError as err:
                raise ValueError(f"bad config: lm: mesh: {err}") from None


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The examples and the retrieval corpus (§5.2)."""

    task: Literal["qa", "lm"] = "qa"
    # JSONL: qa {"id","question","answer","gold_doc"? | "gold_passage"?} (the corpus's
    # document id, or passage ids of the store); lm {"id","text"}
    train: str = ""
    dev: str = ""
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
    separator: str = "\n\n"
    # The LM prompt, built as at inference (replug_jax.prompts): qa examples follow these
    # few-shot {"question","answer"} JSONL demonstrations. Match the evaluation's prompt so Q
    # is the distribution REPLUG mixes.
    qa_demonstrations: str = ""

    def __post_init__(self):
        _check([(self.dev_examples >= 0, "dev_examples must be >= 0")], self, "data")


@dataclasses.dataclass(frozen=True)
class SupervisionConfig:
    """Where Q comes from. ``online``: each batch retrieved from the index and new pairs
    scored by the LM (``prescore_pool``: the top-n of the initial index of every example
    scored up front, in large batches: the same math, cheaper). ``pool``: pre-scored pools
    (DESIGN.md "LSR on a pre-scored pool": each query's pool re-ranked by the current
    retriever, its top-k the retrieved set; no LM and no index in the loop)."""

    kind: Literal["online", "pool"] = "online"
    train_pool: str = ""  # pool: the train pool's folder (train.pool.ScoredPool)
    dev_pool: str = ""  # pool: the dev pool's folder: the dev curve, τ and fitted γ/β
    # "shared": one encoder for queries and documents (the paper's Contriever); "query" (pool
    # supervision): only the query tower learns, documents keep the base encoder's embeddings
    # (an index built with the base stays valid; released as two towers)
    towers: Literal["shared", "query"] = "shared"
    shuffle_q: bool = False  # the control: Q permuted within each pool (pool supervision)
    prescore_pool: int = 0  # online: 0 = off
    # online: the score store (replug_jax.lm.score_store) the LM's pair scores go to and are
    # read from; "" = the work directory's lm_scores/. Runs, pool builds and `replug eval
    # --lm-scores` pointed at one folder score each pair once (several processes: DIR.p<i>)
    lm_scores: str = ""

    def __post_init__(self):
        _check([(self.kind == "pool" or (self.towers == "shared" and not self.shuffle_q),
                 "towers='query' and shuffle_q need kind='pool'"),
                (self.kind == "online" or bool(self.train_pool),
                 "kind='pool' needs train_pool (a pool folder)"),
                (self.prescore_pool >= 0, "prescore_pool must be >= 0")], self, "supervision")


@dataclasses.dataclass(frozen=True)
class SelectionConfig:
    """Which step is kept (pool supervision). Every ``every`` steps the dev curve is read
    (0: only at the end); ``metric`` "last" keeps the last step (a fixed budget),
    "pool_loglik" the best dev-pool REPLUG log-likelihood, "recall@1" the best dev recall@1
    over the whole datastore among the steps whose dev-pool log-likelihood is not below the
    base's; ``patience``: evaluations without a new best before stopping (0: never)."""

    metric: Literal["last", "pool_loglik", "recall@1"] = "last"
    patience: int = 0
    every: int = 0
    # metric="recall@1" from `replug train-lsr`: the questions (JSONL with gold_doc) whose
    # recall@1 over the index selects the step ("": data.dev, the dev pool's own questions);
    # thousands of them cost no LM pair, where the dev pool's every question is LM-scored
    recall_data: str = ""
    # τ of λ on the dev curve (§3.2: 1); 0: fitted on the dev pool at each evaluation over
    # tau_grid (the τ an end-to-end test with a fitted τ uses)
    tau: float = 0.0
    tau_grid: tuple = (0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0)
    beta_grid: tuple = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)  # objective.beta="fitted"

    def __post_init__(self):
        _check([(self.patience >= 0, "patience must be >= 0"),
                (self.every >= 0, "every must be >= 0"),
                (self.tau >= 0 and (self.tau > 0 or len(self.tau_grid) > 0),
                 "tau must be > 0, or 0 with a tau_grid to fit"),
                (all(isinstance(t, (int, float)) and t > 0 for t in (*self.tau_grid,
                                                                      *self.beta_grid)),
                 "tau_grid and beta_grid must hold positive numbers")], self, "selection")


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    """The index retrieved from during training and its refresh (§4.4)."""

    # "faiss": a FAISS index rebuilt at each refresh (index_factory); "jax": exact top-k over
    # the corpus embeddings held as an index_dtype array sharded along N over the mesh (no
    # FAISS rebuild; every device searches its rows, replicas merge the top-k); "auto": "jax"
    # for a Flat index on GPUs and TPUs (a 64-query search over 21M passages: milliseconds on
    # the devices, seconds in FAISS on the host), "faiss" on a CPU or for other factories
    index_factory: str = "Flat"
    index_backend: Literal["auto", "faiss", "jax"] = "auto"
    # "auto": float32 on CPU (faster there), bfloat16 on accelerators (retrieval.storage_dtype)
    index_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    refresh_every: int = 3_000
    refresh_mode: Literal["background", "sync"] = "background"
    refresh_lag: int = 0  # background: swap at refresh step + lag (0 = refresh_every // 10)
    # devices that re-embed the corpus at a refresh: 0 = the retriever's (every local device
    # on GPU/TPU, shared with training); n = the last n local devices of each process, a share
    # set apart (give training the others with num_devices). Not with index_backend="jax",
    # whose corpus rows live on the training mesh.
    refresh_devices: int = 0

    def __post_init__(self):
        _check([(self.refresh_every > 0, "refresh_every must be positive"),
                (self.refresh_lag < self.refresh_every,
                 f"refresh_lag ({self.refresh_lag}) must be smaller than refresh_every "
                 f"({self.refresh_every}): a longer lag would silently skip refreshes"),
                (self.refresh_devices >= 0, "refresh_devices must be >= 0"),
                (not (self.refresh_devices and self.index_backend == "jax"),
                 "refresh_devices needs index_backend='faiss': the JAX index embeds the "
                 "corpus rows on the training mesh that holds them")], self, "retrieval")

    @property
    def lag(self) -> int:
        if self.refresh_mode == "sync":
            return 0
        return self.refresh_lag or max(1, self.refresh_every // 10)

    def resolved_backend(self, backend: str | None = None) -> str:
        """``index_backend`` with "auto" decided for ``backend`` (default: JAX's): the exact
        JAX index for a Flat index on an accelerator when no separate refresh devices are
        set, else FAISS."""
        if self.index_backend != "auto":
            return self.index_backend
        import jax

        on_device = (backend or jax.default_backend()) != "cpu"
        return "jax" if on_device and self.index_factory == "Flat" and \
            not self.refresh_devices else "faiss"


def _piece(cls):
    return dataclasses.field(default_factory=cls)


@dataclasses.dataclass(frozen=True)
class LSRConfig:
    """One LSR run (§4, §5.2): its pieces and the run's own numbers."""

    # the flat names of earlier releases -> their place in the tree (refused, naming it)
    RENAMED: ClassVar[dict] = {
        "retriever": "retriever.name", "similarity": "retriever.similarity",
        "query_max_length": "retriever.query_max_length",
        "doc_max_length": "retriever.doc_max_length",
        "lm": "lm.name", "lm_api_base": "lm.api_base",
        "lm_api_concurrency": "lm.api_concurrency", "lm_api_batch_size": "lm.api_batch_size",
        "lm_prefetch": "lm.prefetch", "lm_dtype": "lm.dtype", "lm_mesh": "lm.mesh",
        "lm_tokens_per_batch": "lm.tokens_per_batch", "lm_max_context": "lm.max_context",
        "task": "data.task", "data": "data.train", "dev_data": "data.dev",
        "dev_examples": "data.dev_examples", "corpus": "data.corpus",
        "chunk_size": "data.chunk_size", "chunk_unit": "data.chunk_unit",
        "leakage": "data.leakage", "context_tokens": "data.context_tokens",
        "continuation_tokens": "data.continuation_tokens", "separator": "data.separator",
        "qa_demonstrations": "data.qa_demonstrations",
        "objective": "objective.kind", "gamma": "objective.gamma", "beta": "objective.beta",
        "direction": "objective.direction", "lm_score": "objective.lm_score",
        "gamma_learning_rate": "objective.gamma_learning_rate",
        "supervision": "supervision.kind", "train_pool": "supervision.train_pool",
        "dev_pool": "supervision.dev_pool", "towers": "supervision.towers",
        "shuffle_q": "supervision.shuffle_q", "prescore_pool": "supervision.prescore_pool",
        "select_on": "selection.metric", "patience": "selection.patience",
        "eval_every": "selection.every", "recall_data": "selection.recall_data",
        "eval_tau": "selection.tau", "tau_grid": "selection.tau_grid",
        "beta_grid": "selection.beta_grid",
        "optimizer": "optim.optimizer", "learning_rate": "optim.learning_rate",
        "weight_decay": "optim.weight_decay", "warmup_ratio": "optim.warmup_ratio",
        "grad_clip": "optim.grad_clip",
        "refresh_every": "retrieval.refresh_every", "refresh_mode": "retrieval.refresh_mode",
        "refresh_lag": "retrieval.refresh_lag", "refresh_devices": "retrieval.refresh_devices",
        "index_factory": "retrieval.index_factory", "index_backend": "retrieval.index_backend",
        "index_dtype": "retrieval.index_dtype",
    }

    retriever: RetrieverConfig = _piece(RetrieverConfig)
    lm: LMConfig = _piece(LMConfig)
    data: DataConfig = _piece(DataConfig)
    objective: ObjectiveConfig = _piece(ObjectiveConfig)
    supervision: SupervisionConfig = _piece(SupervisionConfig)
    selection: SelectionConfig = _piece(SelectionConfig)
    optim: OptimConfig = _piece(OptimConfig)
    retrieval: RetrievalConfig = _piece(RetrievalConfig)
    k: int = 20  # documents retrieved per example (§5.2)
    batch_size: int = 64
    total_steps: int = 25_000
    # recompute encoder activations in the backward pass (a third more compute, activation
    # memory of one layer); None: on for accelerators (64 x 20 passages do not fit a GPU or a
    # v5e chip without it), off on a CPU
    remat: bool | None = None
    seed: int = 0
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    num_devices: int = 0  # 0 = all

    def __post_init__(self):
        sup, sel, objective = self.supervision, self.selection, self.objective
        _check([(self.k > 0, "k must be positive"),
                (self.batch_size > 0, "batch_size must be positive"),
                (self.total_steps > 0, "total_steps must be positive"),
                (self.checkpoint_every > 0, "checkpoint_every must be positive"),
                (self.keep_checkpoints > 0, "keep_checkpoints must be positive"),
                (self.remat is None or isinstance(self.remat, bool),
                 f"remat must be true, false or null (auto), got {self.remat!r}"),
                (sup.kind == "pool" or sel.metric == "last",
                 "selection.metric other than 'last' needs supervision.kind='pool'"),
                (bool(sup.dev_pool) or not (sel.metric != "last" or objective.needs_fit),
                 "selection.metric, or objective.gamma or beta fitted/learned, need "
                 "supervision.dev_pool")], self, "run")

    @classmethod
    def from_tree(cls, tree: dict) -> "LSRConfig":
        """From a tree as a JSON config gives it, pieces nested or dotted:
        ``LSRConfig.from_tree({"retriever.name": "minilm", "objective": {"gamma": 0.05}})``."""
        return config.build(cls, tree)

    def updated(self, changes: dict) -> "LSRConfig":
        """This config with ``{dotted key: value}`` changes applied together:
        ``cfg.updated({"total_steps": 4, "retrieval.refresh_every": 2})``."""
        return config.updated(self, changes)

    @classmethod
    def from_record(cls, record: dict) -> "LSRConfig":
        """A stored run's config (its ``config.json``'s ``"config"``): the tree, or the flat
        form of runs written before the pieces (read here only, as it was written)."""
        return config.from_record(cls, record)

    def flat(self) -> dict:
        """This config in the flat form of earlier releases (what :meth:`fingerprint`
        hashes, so that every stored run keeps its hash)."""
        tree = self.to_json()
        out = {}
        for old, new in self.RENAMED.items():
            piece, name = new.split(".")
            out[old] = tree[piece][name]
        out.update({k: v for k, v in tree.items() if not isinstance(v, dict)})
        return out

    def to_json(self) -> dict:
        """The tree, as ``config.json`` stores it and a JSON config gives it."""
        return dataclasses.asdict(self)

    def fingerprint(self, ignore=("total_steps", "checkpoint_every",
                                  "keep_checkpoints", "remat", "prescore_pool",
                                  "dev_examples", "lm_mesh", "lm_tokens_per_batch",
                                  "lm_api_concurrency",
                                  "lm_api_batch_size", "lm_prefetch")) -> str:
        """A hash of everything that changes the training trajectory (not where the LM runs:
        a sharded LM scores as one device does), over the flat form (:meth:`flat`, names in
        ``ignore`` are flat names). Fields added since a run was made count only when set
        away from their defaults, so older work directories keep their hashes; the
        evaluation cadence counts only where it selects the step (pool supervision)."""
        d = {k: v for k, v in self.flat().items() if k not in ignore}
        if d["lm_dtype"] == "auto":  # as every run was before the field: old hashes hold
            del d["lm_dtype"]
        defaults = LSRConfig().flat()
        for name in LATER_FIELDS:
            if d[name] == defaults[name]:
                del d[name]
        if self.supervision.kind == "online":
            del d["eval_every"]
        d["index_backend"] = self.retrieval.resolved_backend()  # what the run uses
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# fields added with pool supervision and the temperatures as research variables (issue 65, 66)
LATER_FIELDS = ("gamma_learning_rate", "supervision", "train_pool", "dev_pool", "towers",
                "shuffle_q", "select_on", "patience", "eval_tau", "tau_grid", "beta_grid",
                "recall_data")


def load_config(spec: str, overrides: list[str] = ()) -> tuple[LSRConfig, str]:
    """``path/to/config.py[:variant]`` -> (config, variant); see :mod:`replug_jax.config`."""
    return config.load(spec, overrides, cls=LSRConfig)
