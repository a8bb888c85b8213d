"""The in-process backend: any ``load_lm`` model, batched ``[B·K, L]`` and jitted.

Sequences are padded to a fine grid of length buckets, with rows per batch from a token budget
and a short last batch padded to a power of two (``lm.batching``), so ``jit`` compiles a
handful of shapes and never per call. Padding uses position -1 (see ``models.decoder``), so it
never changes a result. Scoring computes the keys and values of a prefix shared by several
sequences once (document KV reuse, ``lm.kv_reuse``: every branch ``d ∘ x`` of a passage
starts with the same tokens), with the same log-probs as scoring each sequence whole.
Generation runs a jitted decode loop with a KV cache, in chunks of
``chunk`` tokens between which stop strings are checked; the K document branches of a query
decode together and receive the same token at every step (coordinated decoding, §3.2).
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
from replug_jax.lm.batching import (
    batch_rows,
    bucket,
    bucket_lengths,
    padding_fraction,
    PrefixGroup,
    plan_prefixes,
    rows_for,
)
from replug_jax.lm.kv_reuse import PrefixKV, compile_fns, score_grouped
from replug_jax.lm.scorer import (
    ENSEMBLE_DECODE,
    NEXT_TOKEN,
    SCORE,
    TOP_LOGPROBS,
    ContinuationScore,
    CostMeter,
    stop_position,
)
from replug_jax.models import (
    DEFAULT_LM,
    LanguageModel,
    init_cache,
    load_lm,
    target_logprobs,
)
from replug_jax.timing import Timer


def _on_accelerator() -> bool:
    return jax.default_backend() != "cpu"


@dataclasses.dataclass
class ScoringStats:
    """Token slots of every scoring batch: real tokens, padded slots, and the tokens a call
    would have processed without prefix reuse."""

    real_tokens: int = 0
    padded_tokens: int = 0
    whole_tokens: int = 0  # Σ len(sequence): the tokens without reuse
    reused_prefixes: int = 0  # prefixes computed once for several sequences (or taken cached)
    shared_rows: int = 0  # sequences scored after a shared prefix

    def tally(self, real: int, padded: int) -> None:
        self.real_tokens += real
        self.padded_tokens += padded

    def summary(self) -> dict:
        return {"real_tokens": self.real_tokens, "padded_tokens": self.padded_tokens,
                "padding_fraction": round(padding_fraction(self.real_tokens,
                                                           self.padded_tokens), 4),
                "tokens_without_reuse": self.whole_tokens,
                "reuse_saving": round(1 - self.real_tokens / self.whole_tokens, 4)
                if self.whole_tokens else 0.0,
                "reused_prefixes": self.reused_prefixes, "shared_rows": self.shared_rows}


@dataclasses.dataclass
class EnsembleGeneration:
    token_ids: list[list[int]]  # [G][T] chosen tokens per prompt
    texts: list[str]
    mixture_logprobs: list[np.ndarray]  # [G][T] log p_mix(chosen token)
    branch_logprobs: list[np.ndarray]  # [G][K, T] log p_k(chosen token) in each branch
    stopped_by: list[str]  # "eos", "stop", or "length"


class FlaxLM:
    """An :class:`~replug_jax.lm.scorer.LMScorer` over an in-process Flax causal LM."""

    capabilities = frozenset({NEXT_TOKEN, SCORE, TOP_LOGPROBS, ENSEMBLE_DECODE})

    def __init__(self, lm: LanguageModel, *, max_context: int = 2048,
                 batch_size: int | None = None, tokens_per_batch: int = 4096,
                 kv_reuse: bool = True, min_shared_tokens: int = 32,
                 reuse_bytes: int | None = None, prefix_cache_bytes: int | None = None,
                 chunk: int = 16):
        """``batch_size``: the most rows of a batch (default: as many as ``tokens_per_batch``
        tokens allow); ``kv_reuse``: compute a prefix shared by ``min_shared_tokens`` or more
        tokens of several scored sequences once; ``reuse_bytes``: the device memory for the
        shared prefixes' keys and values in use at once (default 1 GiB on a CPU, 8 GiB on an
        accelerator); ``prefix_cache_bytes``: the most kept across calls (default half of
        ``reuse_bytes``; 0 keeps none)."""
        self.lm = lm
        self.name = lm.source or "flax-lm"
        self.tokenizer = lm.tokenizer
        self.max_context = min(max_context, lm.config.max_position)
        self.batch_size = batch_size
        self.tokens_per_batch = tokens_per_batch
        self.kv_reuse = kv_reuse
        self.min_shared_tokens = min_shared_tokens
        self.reuse_bytes = reuse_bytes or ((8 << 30) if _on_accelerator() else (1 << 30))
        cache_bytes = self.reuse_bytes // 2 if prefix_cache_bytes is None else prefix_cache_bytes
        self.prefix_cache = PrefixKV(cache_bytes) if cache_bytes > 0 else None
        self.stats = ScoringStats()
        self.chunk = chunk
        self.cost = CostMeter()
        self.buckets = bucket_lengths(self.max_context)
        cfg = lm.config
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_token_id or 0)
        self.eos_id = cfg.eos_token_id
        with_special = self.tokenizer("a")["input_ids"]
        without = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        self.bos = with_special[:1] if len(with_special) > len(without) else []
        graphdef, self.state = nnx.split(lm.model)
        self._graphdef = graphdef

        @jax.jit
        def score_fn(state, tokens_BL, positions_BL, targets_BL):
            model = nnx.merge(graphdef, state)
            x_BLD, _ = model.hidden(tokens_BL, positions_BL)
            return target_logprobs(model, x_BLD, targets_BL)

        @jax.jit
        def last_fn(state, tokens_BL, positions_BL, last_B):
            logits, _ = nnx.merge(graphdef, state)(tokens_BL, positions_BL)
            rows = jnp.arange(tokens_BL.shape[0])
            return jax.nn.log_softmax(logits[rows, last_B], axis=-1)

        @partial(jax.jit, static_argnames=("n",))
        def topn_fn(state, tokens_BL, positions_BL, n):
            logits, _ = nnx.merge(graphdef, state)(tokens_BL, positions_BL)
            return jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), n)

        self._score_fn = score_fn
        self._last_fn = last_fn
        self._topn_fn = topn_fn
        self._prefix_fn, self._suffix_fn = compile_fns(graphdef, lm.config,
                                                                lm.model.dtype)

    @classmethod
    def load(cls, source: str = DEFAULT_LM, dtype: str = "float32", **kwargs) -> "FlaxLM":
        return cls(load_lm(source, dtype=dtype), **kwargs)

    # -- tokens ------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def truncate(self, text: str, max_tokens: int) -> str:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) <= max_tokens:
            return text
        if max_tokens <= 0:
            return ""
        offsets = enc["offset_mapping"]
        end = offsets[max_tokens - 1][1]
        start, stop = offsets[max_tokens]
        if start < end < stop or (start < end and stop == end):
            # A character split into several byte tokens straddles the cut: drop it whole.
            end = start
        return text[:end]

    def split_continuation(self, prompt: str, continuation: str) -> tuple[list[int], list[int]]:
        """Tokenise ``prompt + continuation`` jointly; the continuation's tokens are those
        ending after the prompt (a token straddling the boundary belongs to the continuation).
        An OpenAI-compatible server that echoes the joint text makes the same split."""
        text = prompt + continuation
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        cut = next((i for i, (_, end) in enumerate(offsets) if end > len(prompt)), len(ids))
        return self.bos + list(ids[:cut]), list(ids[cut:])

    def _bucket(self, length: int) -> int:
        return bucket(length, self.buckets)

    def _batches(self, order: Sequence[int], lengths: Sequence[int]):
        """``(indices, length bucket, padded rows)`` of each batch over ``order`` (sorted by
        length): one length bucket per batch, rows from the token budget."""
        by_bucket: dict[int, list[int]] = {}
        for i in order:
            by_bucket.setdefault(self._bucket(lengths[i]), []).append(int(i))
        for length, idx in sorted(by_bucket.items()):
            start = 0
            for count, rows in batch_rows(len(idx), rows_for(length, self.tokens_per_batch,
                                                              self.batch_size)):
                yield idx[start:start + count], length, rows
                start += count

    def _pack(self, seqs: Sequence[Sequence[int]], length: int, rows: int, *,
              left: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, positions)`` ``[rows, length]``: each sequence padded on the right (or the
        left), padding marked by position -1 so that it never changes a result."""
        tokens = np.full((rows, length), self.pad_id, np.int32)
        positions = np.full((rows, length), -1, np.int32)
        for j, seq in enumerate(seqs):
            span = slice(length - len(seq), length) if left else slice(0, len(seq))
            tokens[j, span] = seq
            positions[j, span] = np.arange(len(seq))
        return tokens, positions

    # -- capabilities --------------------------------------------------------------------------

    def score_token_ids(self, prefixes: Sequence[list[int]], continuations: Sequence[list[int]]
                        ) -> list[np.ndarray]:
        """``log p(cont_t | prefix, cont_<t)`` for token-id pairs, batched and bucketed; a
        prefix shared by several pairs (a passage retrieved for several queries) is computed
        once (``kv_reuse``)."""
        if any(len(p) == 0 for p in prefixes):
            raise ValueError("cannot score a continuation after an empty prompt on a model "
                             "without a BOS token")
        seqs = [list(p) + list(c) for p, c in zip(prefixes, continuations)]
        prompt_lens = [len(p) for p in prefixes]
        for s in seqs:
            self._bucket(len(s))  # one error, before any work
        out: list[np.ndarray] = [None] * len(seqs)  # type: ignore[list-item]
        groups, singles = [], list(range(len(seqs)))
        with Timer() as t:
            if self.kv_reuse:
                groups, singles = self._plan(seqs, prompt_lens)
                score_grouped(self, self.state, seqs, prompt_lens, groups, out,
                                       self.stats.tally)
            lengths = [len(s) for s in seqs]
            order = sorted(singles, key=lambda i: lengths[i])
            for idx, length, rows in self._batches(order, lengths):
                tokens, positions = self._pack([seqs[i] for i in idx], length, rows)
                targets = np.zeros_like(tokens)
                for j, i in enumerate(idx):
                    targets[j, :lengths[i] - 1] = seqs[i][1:]
                logp = np.asarray(self._score_fn(self.state, tokens, positions, targets))
                self.stats.tally(sum(lengths[i] for i in idx), rows * length)
                for j, i in enumerate(idx):
                    p = prompt_lens[i]
                    out[i] = logp[j, p - 1:lengths[i] - 1].astype(np.float32)
        self.stats.whole_tokens += sum(map(len, seqs))
        self.stats.reused_prefixes += len(groups)
        self.stats.shared_rows += sum(len(g.members) for g in groups)
        self.cost.add(len(prefixes), sum(map(len, seqs)), 0, t.seconds)
        return out

    def _plan(self, seqs, prompt_lens):
        """Prefix groups for this call: sequences starting with a prefix kept from an
        earlier call join it; the rest are grouped by :func:`plan_prefixes`."""
        limits = [p - 1 for p in prompt_lens]
        cached: dict[tuple, list[int]] = {}
        rest = []
        for i, s in enumerate(seqs):
            n = (self.prefix_cache.longest(s, limits[i], self.min_shared_tokens)
                 if self.prefix_cache is not None else 0)
            if n:
                cached.setdefault(tuple(s[:n]), []).append(i)
            else:
                rest.append(i)
        groups, singles = plan_prefixes([seqs[i] for i in rest], [limits[i] for i in rest],
                                        min_shared=self.min_shared_tokens)
        groups = [dataclasses.replace(g, members=tuple(rest[j] for j in g.members))
                  for g in groups]
        groups += [PrefixGroup(len(key), tuple(m)) for key, m in cached.items()]
        return groups, [rest[j] for j in singles]

    def score_continuations(self, prompts, continuations) -> list[ContinuationScore]:
        pairs = [self.split_continuation(p, c) for p, c in zip(prompts, continuations)]
        logps = self.score_token_ids([a for a, _ in pairs], [b for _, b in pairs])
        return [ContinuationScore(np.array(c, np.int64),
                                  [self.tokenizer.decode([t]) for t in c], lp, len(a))
                for (a, c), lp in zip(pairs, logps)]

    def next_token_logprobs_ids(self, prefixes: Sequence[list[int]]) -> np.ndarray:
        out = np.zeros((len(prefixes), self.lm.config.vocab_size), np.float32)
        lengths = [len(p) for p in prefixes]
        with Timer() as t:
            for idx, length, rows in self._batches(np.argsort(lengths, kind="stable"),
                                                   lengths):
                tokens, positions = self._pack([prefixes[i] for i in idx], length, rows)
                last = np.zeros(rows, np.int32)
                last[:len(idx)] = [lengths[i] - 1 for i in idx]
                lp = self._last_fn(self.state, tokens, positions, last)
                out[idx] = np.asarray(lp[: len(idx)])
        self.cost.add(len(prefixes), sum(lengths), 0, t.seconds)
        return out

    def next_token_logprobs(self, prompts: Sequence[str]) -> np.ndarray:
        return self.next_token_logprobs_ids([self.bos + self.encode(p) for p in prompts])

    def position_top_logprobs(self, ids: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``n`` next-token ``(log-probs, ids)`` after every position of one sequence."""
        return self.positions_top_logprobs([ids], n)[0]

    def positions_top_logprobs(self, seqs: Sequence[list[int]], n: int
                               ) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`position_top_logprobs` for many sequences, batched and bucketed."""
        out: list = [None] * len(seqs)
        lengths = [len(s) for s in seqs]
        with Timer() as t:
            for idx, length, rows in self._batches(np.argsort(lengths, kind="stable"),
                                                   lengths):
                tokens, positions = self._pack([seqs[i] for i in idx], length, rows)
                lp, top = self._topn_fn(self.state, tokens, positions, n)
                lp, top = np.asarray(lp), np.asarray(top)
                for j, i in enumerate(idx):
                    out[i] = (lp[j, :lengths[i]], top[j, :lengths[i]])
        self.cost.add(len(seqs), sum(lengths), 0, t.seconds)
        return out

    def top_logprobs(self, prompts: Sequence[str], n: int, generated: str = ""
                     ) -> list[dict[str, float]]:
        lp = self.next_token_logprobs([p + generated for p in prompts])
        top = np.argsort(-lp, axis=-1)[:, :n]
        return [{self.tokenizer.decode([int(t)]): float(lp[i, t]) for t in top[i]}
                for i in range(len(prompts))]

    # -- coordinated ensemble decoding ---------------------------------------------------------

    @partial(jax.jit, static_argnames=("self", "capacity", "k"))
    def _decode(self, state, cache, logp_BV, log_w_GK, pos_B, done_G, rng, sampling_temperature,
                top_p, n_steps, *, capacity: int, k: int):
        """Up to ``n_steps <= capacity`` coordinated decoding steps in one compiled
        ``lax.while_loop``, which also stops as soon as every group has emitted EOS. Returns the
        carry, ``[capacity, G]`` tokens (EOS after the last step), mixture log-probs,
        ``[capacity, G, K]`` branch log-probs and the number of steps run. ``n_steps`` is traced,
        so one compilation serves every length up to ``capacity``."""
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
            new_logp = jax.nn.log_softmax(logits[:, 0], axis=-1)
            done_G = done_G | (tok_G == eos)
            outs = (toks.at[i].set(tok_G), mix_lps.at[i].set(mix_lp_G),
                    branch_lps.at[i].set(branch_lp_GK))
            return i + 1, cache, new_logp, pos_B + 1, done_G, rng, outs

        outs = (jnp.full((capacity, g), eos if eos >= 0 else 0, jnp.int32),
                jnp.zeros((capacity, g), jnp.float32), jnp.zeros((capacity, g, k), jnp.float32))
        i, cache, logp_BV, pos_B, done_G, rng, outs = jax.lax.while_loop(
            cond, body, (jnp.int32(0), cache, logp_BV, pos_B, done_G, rng, outs))
        return (cache, logp_BV, pos_B, done_G, rng), outs, i

    @partial(jax.jit, static_argnames=("self",))
    def _prefill(self, state, tokens_BL, positions_BL, cache):
        logits, cache = nnx.merge(self._graphdef, state)(tokens_BL, positions_BL, cache)
        return jax.nn.log_softmax(logits[:, -1], axis=-1), cache

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
        K branches of its group. ``log_weights`` is ``[G, K]``.
        """
        g, k = np.asarray(log_weights).shape
        if any(len(p) != k for p in prompts) or len(prompts) != g:
            raise ValueError(f"prompts must be {g} groups of {k} branches")
        flat = [self.bos + self.encode(p) for group in prompts for p in group]
        limit = self.lm.config.max_position
        for i, seq in enumerate(flat):  # each request on its own (bucketing pads only slots)
            if len(seq) + max_new_tokens > limit:
                raise ValueError(f"prompt {i // k} (branch {i % k}: {len(seq)} tokens) plus "
                                 f"{max_new_tokens} new tokens exceeds the model's {limit} "
                                 "positions")
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
            cache = init_cache(self.lm.config, b, total, self.lm.model.dtype)
            logp, cache = self._prefill(self.state, jnp.asarray(tokens), jnp.asarray(positions),
                                        cache)
            carry = (cache, logp, jnp.asarray(pos_B), jnp.zeros(g, bool),
                     jax.random.PRNGKey(seed))
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
        for gi in range(g):
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
        return EnsembleGeneration(out_ids, texts, out_mix, out_br, stopped)

    def _until_eos(self, ids: np.ndarray) -> list[int]:
        ids = [int(x) for x in ids]
        if self.eos_id is not None and self.eos_id in ids:
            return ids[: ids.index(self.eos_id)]
        return ids
