"""The pure LSR training step (paper §4.1–4.3).

``train_step(state, batch) -> (state, metrics)`` re-encodes the queries and their K retrieved
documents with the current retriever parameters (so gradients reach the shared encoder through
both towers), forms ``s(d, x)`` (cosine, Eq. 1, or dot product), and minimises
``core.losses.lsr_loss`` (or the marginal-likelihood alternate) against LM scores that were
computed beforehand by the frozen LM and arrive as data. LM parameters never enter the state.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from replug_jax.core.losses import lsr_distributions, lsr_loss, marginal_nll_loss
from replug_jax.models.bert import embed
from replug_jax.models.params import split_params, to_module  # noqa: F401 (re-exported)
from replug_jax.sharding import platform
from replug_jax.train.spec import ObjectiveConfig


class TrainState(NamedTuple):
    params: Any  # the retriever's parameters as a nested dict of arrays
    opt_state: Any
    step: jax.Array


def _loss(objective: ObjectiveConfig, s_BK, lm_BK, valid_BK, gamma):
    """The LSR loss of retrieval scores against the LM's (Eq. 5 or the marginal likelihood)
    at the retriever's temperature ``gamma`` (a number, or the learned one, traced)."""
    if objective.kind == "marginal":
        return marginal_nll_loss(s_BK, lm_BK, gamma, valid_BK)
    return lsr_loss(s_BK, lm_BK, gamma, objective.beta, valid_BK,
                    direction=objective.direction)


def trainable(encoder_params, objective: ObjectiveConfig):
    """What the optimizer updates: the encoder's parameters, and with a learned γ the
    log-temperature beside them (``{"encoder": ..., "log_gamma": log γ₀}``)."""
    if not objective.learns_gamma:
        return encoder_params
    return {"encoder": encoder_params, "log_gamma": jnp.log(jnp.float32(objective.gamma))}


def encoder_params(params):
    """The encoder's parameters of a state's ``params`` (:func:`trainable`)."""
    if isinstance(params, dict) and set(params) == {"encoder", "log_gamma"}:
        return params["encoder"]
    return params


def learned_gamma(params) -> float | None:
    """γ of a state with a learned temperature, else None."""
    if isinstance(params, dict) and set(params) == {"encoder", "log_gamma"}:
        return float(jnp.exp(params["log_gamma"]))
    return None


def _gamma_of(objective: ObjectiveConfig, params):
    return jnp.exp(params["log_gamma"]) if objective.learns_gamma else objective.gamma


def build_tx(optim, objective: ObjectiveConfig, num_steps: int):
    """The optimizer of :class:`~replug_jax.train.spec.OptimConfig` over the encoder; a
    learned γ gets its own Adam at ``objective.gamma_learning_rate`` (at the encoder's 2e-5 a
    log-temperature would move by at most 0.06 in 3,000 steps), unclipped."""
    tx = optim.build(num_steps)
    if not objective.learns_gamma:
        return tx

    def labels(params):
        return {"encoder": jax.tree.map(lambda _: "encoder", params["encoder"]),
                "log_gamma": "gamma"}

    return optax.multi_transform({"encoder": tx,
                                  "gamma": optax.adam(objective.gamma_learning_rate)}, labels)


def _step_metrics(objective: ObjectiveConfig, params, s_BK, lm_BK, valid_BK) -> dict:
    """What every LSR step reports beside its loss: the entropies of P_R and Q over the k
    documents, how often their argmax agree, and γ."""
    gamma = _gamma_of(objective, params)
    log_p, log_q = lsr_distributions(s_BK, lm_BK, gamma, objective.beta, valid_BK)
    return {"entropy_retriever": jnp.mean(_entropy(log_p)),
            "entropy_lm": jnp.mean(_entropy(log_q)),
            "argmax_agreement": jnp.mean(jnp.argmax(log_p, -1) == jnp.argmax(log_q, -1)),
            "gamma": jnp.asarray(gamma, jnp.float32)}


def _entropy(log_p):
    p = jnp.exp(log_p)
    return -jnp.sum(jnp.where(p > 0, p * jnp.where(p > 0, log_p, 0.0), 0.0), axis=-1)


def resolve_remat(remat: bool | None, backend: str | None = None) -> bool:
    """``remat`` as set, or (None) on where the backend is an accelerator."""
    if remat is not None:
        return bool(remat)
    return (backend or platform()) != "cpu"


def make_train_step(graphdef, template, objective: ObjectiveConfig,
                    tx: optax.GradientTransformation, pooling: str, normalize: bool, *,
                    schedule: optax.Schedule, remat: bool | None = None):
    """Build the jitted ``train_step`` and a jitted ``scores_fn``.

    ``graphdef``/``template`` are the retriever's static structure (see :func:`split_params`);
    ``pooling`` and ``normalize`` must be the retriever's (``Retriever.normalize``), so that
    the step scores documents exactly as the index does.

    Batch fields: ``query_ids/query_mask [B, Lq]``, ``doc_ids/doc_mask [B, K, Ld]``,
    ``doc_valid [B, K]`` (False for padding documents), ``lm_scores [B, K]``.

    ``objective`` is the loss; ``tx`` the optimizer (``OptimConfig.build``) and ``schedule``
    its learning rate, reported per step; ``remat`` recomputes the encoder's activations in
    the backward pass (None: on accelerators, :func:`resolve_remat`).

    ``train_step`` donates the state it is given (its parameter and optimizer buffers are
    updated in place: on a CPU, allocating fresh ones each step cost as much as 15 % of the
    step); use the state it returns.
    """
    remat = resolve_remat(remat)

    def scores_fn(params, batch):
        encoder = to_module(graphdef, template, encoder_params(params))
        b, k, ld = batch["doc_ids"].shape
        kw = dict(pooling=pooling, normalize=normalize, remat=remat)
        q_BD = embed(encoder, batch["query_ids"], batch["query_mask"], **kw)
        d_ids = batch["doc_ids"].reshape(b * k, ld)
        d_mask = batch["doc_mask"].reshape(b * k, ld)
        d_BKD = embed(encoder, d_ids, d_mask, **kw).reshape(b, k, -1)
        return jnp.einsum("bd,bkd->bk", q_BD, d_BKD)

    def loss_fn(params, batch):
        s_BK, lm_BK, valid_BK = scores_fn(params, batch), batch["lm_scores"], batch["doc_valid"]
        loss = _loss(objective, s_BK, lm_BK, valid_BK, _gamma_of(objective, params))
        return loss, (s_BK, lm_BK, valid_BK)

    return _jitted_step(loss_fn, tx, objective, schedule), jax.jit(scores_fn)


def _jitted_step(loss_fn, tx, objective: ObjectiveConfig, schedule):
    """The update around ``loss_fn(params, batch) -> (loss, (s_BK, lm_BK, valid_BK))``,
    jitted, donating the state, with the step's metrics (:func:`_step_metrics`, the gradient
    norm and the learning rate)."""
    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(state: TrainState, batch: dict):
        (loss, picked), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1), {
            "loss": loss, **_step_metrics(objective, state.params, *picked),
            "grad_norm": optax.tree.norm(grads), "learning_rate": schedule(state.step)}

    return step


def init_state(params, tx) -> TrainState:
    """A fresh state over a copy of ``params`` (``train_step`` donates its state's buffers,
    so the caller's ``params`` stay usable)."""
    params = jax.tree.map(jnp.array, params)
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))


def make_query_step(graphdef, template, objective: ObjectiveConfig, tx, pooling: str,
                    normalize: bool, k: int, *, schedule: optax.Schedule):
    """The jitted LSR step with the query tower trained against given document embeddings
    of each query's whole pool (``batch["doc_emb"] [B, M, D]``, from the last refresh): the
    current query embeddings re-rank the pool, its top ``k`` (ties to the earlier candidate)
    are the retrieved documents, and the loss of :func:`~replug_jax.train.lsr.make_train_step`
    (KL either way, or the marginal likelihood) is taken over them on
    ``s(d, x) = E(x) · E_stale(d)``. The choice of the top ``k`` carries no gradient (as
    retrieval from an index does not)."""

    def loss_fn(params, batch):
        encoder = to_module(graphdef, template, encoder_params(params))
        q_BD = embed(encoder, batch["query_ids"], batch["query_mask"], pooling=pooling,
                     normalize=normalize)
        s_BM = jnp.einsum("bd,bmd->bm", q_BD, batch["doc_emb"])
        ranked_BM = jnp.where(batch["doc_valid"], jax.lax.stop_gradient(s_BM), -jnp.inf)
        _, top_BK = jax.lax.top_k(ranked_BM, k)
        s_BK = jnp.take_along_axis(s_BM, top_BK, axis=1)
        lm_BK = jnp.take_along_axis(batch["lm_scores"], top_BK, axis=1)
        valid_BK = jnp.take_along_axis(batch["doc_valid"], top_BK, axis=1)
        loss = _loss(objective, s_BK, lm_BK, valid_BK, _gamma_of(objective, params))
        return loss, (s_BK, lm_BK, valid_BK)

    return _jitted_step(loss_fn, tx, objective, schedule)
