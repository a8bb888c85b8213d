"""Scoring with each shared prefix's keys and values computed once (document KV reuse).

:func:`~replug_jax.lm.batching.plan_prefixes` says which sequences share a prefix; here the
prefixes are run through the LM once each (``prefix_fn``: the KV cache of every layer), and
each member's own tokens are then scored against its prefix's cache (``suffix_fn``: positions
continue from the prefix length and attention covers prefix + own tokens), which is the same
computation as scoring the whole sequence (``models.decoder``'s cache path): the log-probs
agree to float rounding (tested against whole-sequence scoring, 1e-5 in float32).

Prefix caches live on the device in chunks bounded in bytes; :class:`PrefixKV` keeps the most
recently used ones across calls (an LRU bounded in bytes), so a passage that recurs in the next
call (the next batch of an evaluation, the next part of an LSR pool) is not recomputed.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replug_jax.lm.batching import PrefixGroup, batch_rows, bucket, padded_count, rows_for
from replug_jax.models import init_cache, target_logprobs


def kv_bytes_per_token(cfg, dtype) -> int:
    """Bytes of cached keys and values per token, all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def compile_fns(graphdef, cfg, place) -> tuple[Callable, Callable]:
    """``(prefix_fn, suffix_fn)``, jitted under ``place`` (an ``lm.placement.Placement``:
    the dtype, the matmul precision, the caches' sharding).

    ``prefix_fn(state, tokens_PL, positions_PL) -> (k, v, pos)``: the cache of ``P`` prefixes
    (``[layers, P, J, L, D]`` keys and values, ``[P, L]`` positions, -1 on padding); XLA drops
    the last layer's MLP and the head, whose outputs nothing reads.
    ``suffix_fn(state, k, v, pos, tokens_BS, positions_BS, targets_BS, first_B, width) ->
    [B, width]`` log-probs of ``targets`` after each row's prefix cache and its own tokens, at
    positions ``first_B .. first_B + width - 1`` of each row (``width`` static, a length
    bucket): the vocabulary head runs on the scored positions only (a question's own tokens
    before its answer need none), in few compiled shapes."""

    def prefix_fn(state, tokens_PL, positions_PL):
        model = nnx.merge(graphdef, state)
        p, length = tokens_PL.shape
        empty = place.constrain_cache(init_cache(cfg, p, length, place.dtype))
        _, cache = model.hidden(tokens_PL, positions_PL, empty)
        cache = place.constrain_cache(cache)
        return cache["k"], cache["v"], cache["pos"]

    def suffix_fn(state, k_pre, v_pre, pos_pre, tokens_BS, positions_BS, targets_BS, first_B,
                  width):
        model = nnx.merge(graphdef, state)
        b, s = tokens_BS.shape
        pad = jnp.zeros((*k_pre.shape[:3], s, k_pre.shape[4]), k_pre.dtype)
        cache = {"k": jnp.concatenate([k_pre, pad], axis=3),
                 "v": jnp.concatenate([v_pre, pad], axis=3),
                 "pos": jnp.concatenate([pos_pre, jnp.full((b, s), -1, pos_pre.dtype)], 1),
                 "end": jnp.int32(k_pre.shape[3])}
        x_BSD, _ = model.hidden(tokens_BS, positions_BS, place.constrain_cache(cache))
        at_BW = jnp.minimum(first_B[:, None] + jnp.arange(width)[None], s - 1)
        x_BWD = jnp.take_along_axis(x_BSD, at_BW[..., None], axis=1)
        return place.replicated(target_logprobs(
            model, x_BWD, jnp.take_along_axis(targets_BS, at_BW, axis=1)))

    return (jax.jit(place.traced(prefix_fn)),
            jax.jit(place.traced(suffix_fn), static_argnames=("width",)))


class PrefixKV:
    """Prefix caches by token tuple, least recently used evicted past ``max_bytes``.

    An entry is ``(k [layers, J, L, D], v, pos [L])`` padded to a length bucket ``L``."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lengths: collections.Counter = collections.Counter()
        self._order: list[int] | None = None  # the cached lengths, longest first

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _size(entry) -> int:
        return int(entry[0].nbytes + entry[1].nbytes + entry[2].nbytes)

    def put(self, key: tuple, entry) -> None:
        size = self._size(entry)
        if size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = entry
        self._lengths[len(key)] += 1
        self._order = None
        self.bytes += size
        while self.bytes > self.max_bytes:
            old, old_entry = self._entries.popitem(last=False)
            self.bytes -= self._size(old_entry)
            self._lengths[len(old)] -= 1
            if not self._lengths[len(old)]:
                del self._lengths[len(old)]
                self._order = None

    def get(self, key: tuple):
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return entry

    def longest(self, seq: Sequence[int], limit: int, min_len: int) -> int:
        """The length of the longest cached prefix of ``seq`` of ``min_len``..``limit``
        tokens (0 if none)."""
        if self._order is None:  # sorted once per change, not once per sequence looked up
            self._order = sorted(self._lengths, reverse=True)
        for n in self._order:
            if min_len <= n <= limit and tuple(seq[:n]) in self._entries:
                return n
        return 0

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self._order = None
        self.bytes = 0


def score_grouped(lm, state, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                  groups: Sequence[PrefixGroup], out: list, tally: Callable[[int, int], None]
                  ) -> None:
    """Fill ``out[i]`` with the ``[len(seq) - prompt_lens[i]]`` continuation log-probs of
    every member of ``groups``, each group's prefix computed once (or taken from
    ``lm.prefix_cache``). ``lm`` is the :class:`~replug_jax.lm.flax_scorer.FlaxLM`;
    ``tally(real, padded)`` counts the tokens of every batch."""
    per_token = kv_bytes_per_token(lm.lm.config, lm.place.dtype)
    by_bucket: dict[int, list[PrefixGroup]] = collections.defaultdict(list)
    for g in groups:
        by_bucket[bucket(g.length, lm.buckets)].append(g)
    for lp, bucket_groups in sorted(by_bucket.items()):
        # As many prefixes per chunk as fit the reuse budget (their caches stay on the device
        # while their members are scored).
        per_chunk = max(1, lm.reuse_bytes // (per_token * lp))
        for lo in range(0, len(bucket_groups), per_chunk):
            _score_chunk(lm, state, seqs, prompt_lens, bucket_groups[lo:lo + per_chunk], lp,
                         per_token, out, tally)


def _prefix_caches(lm, state, seqs, chunk: Sequence[PrefixGroup], lp: int, tally):
    """``(k, v, pos)`` of the chunk's prefixes stacked on their row axis, cached ones reused
    and new ones computed in batches (and offered to ``lm.prefix_cache``)."""
    keys = [tuple(seqs[g.members[0]][:g.length]) for g in chunk]
    entries: list = [lm.prefix_cache.get(key) if lm.prefix_cache is not None else None
                     for key in keys]
    todo = [i for i, e in enumerate(entries) if e is None]
    rows = rows_for(lp, lm.tokens_per_batch, lm.batch_size)
    start = 0
    for count, padded in batch_rows(len(todo), rows, lm.place.row_multiple):
        idx = todo[start:start + count]
        start += count
        tokens, positions = lm._pack([keys[i] for i in idx], lp, padded)
        k, v, pos = lm._prefix_fn(state, lm.place.rows(tokens), lm.place.rows(positions))
        tally(sum(len(keys[i]) for i in idx), padded * lp)
        for i, entry in zip(idx, _rows_of(k, v, pos)):
            entries[i] = entry
            if lm.prefix_cache is not None:
                lm.prefix_cache.put(keys[i], entry)
    # stacked to one of few sizes (the padding rows repeat the first entry; nothing reads
    # them), so the stacking and the members' gathers compile a few programs, not one per
    # chunk size
    return _stack(entries + entries[:1] * (padded_count(len(entries)) - len(entries)))


@jax.jit
def _rows_of(k, v, pos):
    """Each row's ``(k [layers, J, L, D], v, pos [L])`` of a batch of prefix caches, as one
    program per batch shape (slicing row by row outside it compiles one per row index)."""
    return [(k[:, j], v[:, j], pos[j]) for j in range(pos.shape[0])]


@jax.jit
def _stack(entries):
    return (jnp.stack([e[0] for e in entries], 1), jnp.stack([e[1] for e in entries], 1),
            jnp.stack([e[2] for e in entries], 0))


def _score_chunk(lm, state, seqs, prompt_lens, chunk, lp, per_token, out, tally) -> None:
    k_all, v_all, pos_all = _prefix_caches(lm, state, seqs, chunk, lp, tally)
    members = [(gi, i) for gi, g in enumerate(chunk) for i in g.members]
    shared = {i: chunk[gi].length for gi, i in members}
    suffix_len = {i: len(seqs[i]) - shared[i] for _, i in members}
    by_bucket: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for gi, i in members:  # cache slots are not positions: lp + ls may pass the context
        by_bucket[bucket(suffix_len[i], lm.buckets)].append((gi, i))
    for ls, rows_in in sorted(by_bucket.items()):
        rows = rows_for(ls, lm.tokens_per_batch, lm.batch_size, per_token * (lp + ls),
                        lm.reuse_bytes)
        start = 0
        for count, padded in batch_rows(len(rows_in), rows, lm.place.row_multiple):
            batch = rows_in[start:start + count]
            start += count
            take = np.zeros(padded, np.int32)
            take[:count] = [gi for gi, _ in batch]
            suffixes = [list(seqs[i][shared[i]:]) for _, i in batch]
            tokens = np.full((padded, ls), lm.pad_id, np.int32)
            positions = np.full((padded, ls), -1, np.int32)
            targets = np.zeros((padded, ls), np.int32)
            for j, (_, i) in enumerate(batch):
                suf = suffixes[j]
                tokens[j, :len(suf)] = suf
                positions[j, :len(suf)] = shared[i] + np.arange(len(suf))
                targets[j, :len(suf) - 1] = suf[1:]
            rows_ = lm.place.rows
            first = np.zeros(padded, np.int32)  # each row's first scored position
            first[:count] = [prompt_lens[i] - 1 - shared[i] for _, i in batch]
            scored = [len(seqs[i]) - prompt_lens[i] for _, i in batch]
            logp = np.asarray(lm._suffix_fn(state, k_all[:, take], v_all[:, take],
                                            pos_all[take], rows_(tokens), rows_(positions),
                                            rows_(targets), rows_(first),
                                            width=bucket(max(scored), lm.buckets)))
            tally(sum(map(len, suffixes)), padded * ls)
            for j, n in enumerate(scored):
                out[batch[j][1]] = logp[j, :n].astype(np.float32)
