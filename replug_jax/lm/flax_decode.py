"""Coordinated ensemble decoding for the in-process LM (paper §3.2): the K document branches
of a query decode together and receive the same token at every step, chosen from the mixture
``Σ_k λ_k p(·|d_k ∘ x, y_<t)``. A jitted decode loop with a KV cache (sharded over the mesh's
kv-head axis when the LM is), in chunks of ``chunk`` tokens between which stop strings are
checked.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replug_jax.core.ensemble import mixture_logprobs
from replug_jax.core.sampling import choose_token
from replug_jax.lm.batching import rows_for
from replug_jax.lm.scorer import stop_position
from replug_jax.process import Timer


@dataclasses.dataclass
class EnsembleGeneration:
    token_ids: list[list[int]]  # [G][T] chosen tokens per prompt
    texts: list[str]
    mixture_logprobs: list[np.ndarray]  # [G][T] log p_mix(chosen token)
    branch_logprobs: list[np.ndarray]  # [G][K, T] log p_k(chosen token) in each branch
    stopped_by: list[str]  # "eos", "stop", or "length"


class EnsembleDecoding:
    """Mixed into :class:`~replug_jax.lm.flax_scorer.FlaxLM`: ``generate_ensemble``."""

    # The cache is donated: each program updates it in place, so it is held once, not twice.
    @partial(jax.jit, static_argnames=("self", "capacity", "k"), donate_argnames=("cache",))
    def _decode(self, state, cache, logp_BV, log_w_GK, pos_B, done_G, rng, sampling_temperature,
                top_p, n_steps, *, capacity: int, k: int):
        """Up to ``n_steps <= capacity`` coordinated decoding steps in one compiled
        ``lax.while_loop``, which also stops as soon as every group has emitted EOS. Returns the
        carry, ``[capacity, G]`` tokens (EOS after the last step), mixture log-probs,
        ``[capacity, G, K]`` branch log-probs and the number of steps run. ``n_steps`` is traced,
        so one compilation serves every length up to ``capacity``."""
        with self.place.precision_scope():
            return self._decode_loop(state, cache, logp_BV, log_w_GK, pos_B, done_G, rng,
                                     sampling_temperature, top_p, n_steps, capacity, k)

    def _decode_loop(self, state, cache, logp_BV, log_w_GK, pos_B, done_G, rng,
                     sampling_temperature, top_p, n_steps, capacity, k):
        model_graphdef = self._graphdef
        eos = -1 if self.eos_id is None else self.eos_id
        g = log_w_GK.shape[0]

        def cond(c):
            i, done_G = c[0], c[4]
            return (i < n_steps) & ~jnp.all(done_G)

        def body(c):
            i, cache, logp_BV, pos_B, done_G, rng, (toks, mix_lps, branch_lps) = c
            rng, sub = jax.random.split(rng)
            logp_GKV = logp_BV.reshape(g, k, -1)
            mix_GV = mixture_logprobs(logp_GKV, log_w_GK)
            tok_G = choose_token(mix_GV, sub, sampling_temperature, top_p)
            tok_G = jnp.where(done_G, eos if eos >= 0 else 0, tok_G)
            mix_lp_G = jnp.take_along_axis(mix_GV, tok_G[:, None], -1)[:, 0]
            branch_lp_GK = jnp.take_along_axis(logp_GKV, tok_G[:, None, None].repeat(k, 1),
                                               -1)[..., 0]
            tok_B = jnp.repeat(tok_G, k)  # the same token to every branch
            logits, cache = nnx.merge(model_graphdef, state)(tok_B[:, None], pos_B[:, None],
                                                             cache)
            cache = self.place.constrain_cache(cache)
            new_logp = jax.nn.log_softmax(logits[:, 0], axis=-1)
            done_G = done_G | (tok_G == eos)
            outs = (toks.at[i].set(tok_G), mix_lps.at[i].set(mix_lp_G),
                    branch_lps.at[i].set(branch_lp_GK))
            return i + 1, cache, new_logp, pos_B + 1, done_G, rng, outs

        outs = (jnp.full((capacity, g), eos if eos >= 0 else 0, jnp.int32),
                jnp.zeros((capacity, g), jnp.float32), jnp.zeros((capacity, g, k), jnp.float32))
        i, cache, logp_BV, pos_B, done_G, rng, outs = jax.lax.while_loop(
            cond, body, (jnp.int32(0), cache, logp_BV, pos_B, done_G, rng, outs))
        outs = jax.tree.map(self.place.replicated, outs)  # read back by every process
        return (cache, logp_BV, pos_B, done_G, rng), outs, i

    @partial(jax.jit, static_argnames=("self",), donate_argnames=("cache",))
    def _prefill(self, state, tokens_BL, positions_BL, cache):
        """The prompts (left-padded: every row ends at ``L - 1``) into ``cache``, and the
        next-token log-probs ``[B, V]``: the head runs on the last position only."""
        with self.place.precision_scope():
            model = nnx.merge(self._graphdef, state)
            x_BLD, cache = model.hidden(tokens_BL, positions_BL, cache)
            logits_BV = model.project(x_BLD[:, -1])
        return jax.nn.log_softmax(logits_BV, axis=-1), self.place.constrain_cache(cache)

    def __hash__(self):  # jit's static `self`: identity semantics
        return id(self)

    def __eq__(self, other):
        return self is other

    def generate_ensemble(self, prompts: Sequence[Sequence[str]], log_weights: np.ndarray, *,
                          max_new_tokens: int = 32, sampling_temperature: float = 0.0,
                          top_p: float = 1.0, stop: Sequence[str] = (), seed: int = 0
                          ) -> EnsembleGeneration:
        """Coordinated decoding over ``G`` groups of ``K`` branch prompts.

        At each step the next token is chosen from ``Σ_k λ_k p(·|d_k ∘ x, y_<t)`` (greedy when
        ``sampling_temperature == 0``, else temperature / nucleus sampling) and appended to all
        K branches of its group. ``log_weights`` is ``[G, K]``. Groups decode in batches of at
        most ``decode_tokens_per_batch`` cache slots (prompt bucket + new tokens per branch);
        each batch samples from its own stream of ``seed``.
        """
        g, k = np.asarray(log_weights).shape
        if any(len(p) != k for p in prompts) or len(prompts) != g:
            raise ValueError(f"prompts must be {g} groups of {k} branches")
        flat = [self.bos + self.encode(p) for group in prompts for p in group]
        empty = [i for i, seq in enumerate(flat) if not seq]
        if empty:
            raise ValueError(f"cannot generate after an empty prompt (prompt {empty[0] // k}, "
                             f"branch {empty[0] % k}) on a model without a BOS token: give it "
                             "some text")
        limit = self.lm.config.max_position
        for i, seq in enumerate(flat):  # each request on its own (bucketing pads only slots)
            if len(seq) + max_new_tokens > limit:
                raise ValueError(f"prompt {i // k} (branch {i % k}: {len(seq)} tokens) plus "
                                 f"{max_new_tokens} new tokens exceeds the model's {limit} "
                                 "positions")
        # Whole groups at a time, as many as `decode_tokens_per_batch` cache slots hold (at
        # least one group): the prefill and the cache of every branch at once is what bounds
        # the memory of a call over many prompts.
        slots = self._bucket(max(map(len, flat))) + max_new_tokens
        per = max(1, rows_for(slots, self.decode_tokens_per_batch, self.batch_size) // k)
        log_weights = np.asarray(log_weights, np.float32)
        parts = [self._generate_groups(flat[lo * k:(lo + per) * k], log_weights[lo:lo + per],
                                       k, max_new_tokens, sampling_temperature, top_p, stop,
                                       jax.random.fold_in(jax.random.PRNGKey(seed), lo))
                 for lo in range(0, g, per)]
        return EnsembleGeneration(*(sum((getattr(p, f.name) for p in parts), [])
                                    for f in dataclasses.fields(EnsembleGeneration)))

    def _generate_groups(self, flat, log_weights, k, max_new_tokens, sampling_temperature,
                         top_p, stop, rng) -> EnsembleGeneration:
        """:meth:`generate_ensemble` for one batch of groups: ``flat`` holds their ``G·K``
        token-id prompts, ``log_weights`` is ``[G, K]``."""
        g = len(log_weights)
        # On a mesh the G·K rows split over the batch axes: copies of group 0 fill them out.
        g_asked = g
        while (g * k) % self.place.row_multiple:
            flat, g = flat + flat[:k], g + 1
        log_weights = np.concatenate([log_weights, np.repeat(log_weights[:1], g - g_asked, 0)])
        L = self._bucket(max(map(len, flat)))
        # Without stop strings the whole generation is one compiled loop (no host round trip
        # per token or per chunk); with them, chunks of `chunk` steps between which the text
        # is checked. The capacity is a power of two, so few shapes are ever compiled. Cache
        # slots are not positions (each row's positions start at 0 after its left padding),
        # so the bucketed cache may be longer than the model's positions.
        capacity = self.chunk if stop else max(16, 1 << (max_new_tokens - 1).bit_length())
        n_chunks = -(-max_new_tokens // capacity)
        total = L + n_chunks * capacity
        b = g * k
        tokens, positions = self._pack(flat, L, b, left=True)  # every branch ends at L-1
        pos_B = np.array([len(s) for s in flat], np.int32)
        stopped = ["length"] * g  # final once set: a group that stopped decodes no further
        with Timer() as t:
            log_w = jnp.asarray(log_weights, jnp.float32)
            cache = self.place.new_cache(self.lm.config, b, total)
            logp, cache = self._prefill(self.state, self.place.rows(tokens),
                                        self.place.rows(positions), cache)
            carry = (cache, logp, self.place.rows(pos_B), jnp.zeros(g, bool), rng)
            toks, mix_lps, branch_lps = [], [], []
            for c in range(n_chunks):
                cache, logp, pos, done, rng = carry
                carry, (tok, mix_lp, br_lp), ran = self._decode(
                    self.state, cache, logp, log_w, pos, done, rng, sampling_temperature, top_p,
                    jnp.int32(min(capacity, max_new_tokens - c * capacity)), capacity=capacity,
                    k=k)
                ran = int(ran)
                toks.append(np.asarray(tok)[:ran].T)
                mix_lps.append(np.asarray(mix_lp)[:ran].T)
                branch_lps.append(np.asarray(br_lp)[:ran].transpose(1, 2, 0))
                all_toks = np.concatenate(toks, axis=1)[:, :max_new_tokens]
                for gi in range(g):
                    if stopped[gi] != "length":
                        continue
                    seq = self._until_eos(all_toks[gi])
                    if stop_position(self.tokenizer.decode(seq), stop) is not None:
                        stopped[gi] = "stop"  # a stop string before any EOS wins
                    elif len(seq) < len(all_toks[gi]):
                        stopped[gi] = "eos"
                if all(s != "length" for s in stopped):
                    break
                cache, logp, pos, done, rng = carry  # rows that stopped emit EOS from now on
                carry = (cache, logp, pos, done | jnp.asarray([s != "length" for s in stopped]),
                         rng)
        all_toks = np.concatenate(toks, axis=1)[:, :max_new_tokens]
        mix_all = np.concatenate(mix_lps, axis=1)[:, :max_new_tokens]
        br_all = np.concatenate(branch_lps, axis=2)[:, :, :max_new_tokens]
        texts, out_ids, out_mix, out_br = [], [], [], []
        for gi in range(g_asked):
            seq = self._until_eos(all_toks[gi])
            n, text = len(seq), self.tokenizer.decode(seq)
            if stopped[gi] == "stop":  # cut the text at the stop string, and the tokens with it
                cut = stop_position(text, stop)
                text = text[:cut]
                while n > 0 and len(self.tokenizer.decode(seq[:n - 1])) >= cut:
                    n -= 1
            texts.append(text)
            out_ids.append(seq[:n])
            out_mix.append(mix_all[gi, :n])
            out_br.append(br_all[gi, :, :n])
        steps_run = all_toks.shape[1]
        self.cost.add(b, int(sum(map(len, flat))), steps_run * b, t.seconds)
        return EnsembleGeneration(out_ids, texts, out_mix, out_br, stopped[:g_asked])

    def _until_eos(self, ids: np.ndarray) -> list[int]:
        ids = [int(x) for x in ids]
        if self.eos_id is not None and self.eos_id in ids:
            return ids[: ids.index(self.eos_id)]
        return ids
