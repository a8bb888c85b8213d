"""The in-process backend: any ``load_lm`` model, batched ``[B·K, L]`` and jitted.

Sequences are padded to a fine grid of length buckets, with rows per batch from a token budget
and a short last batch padded to a power of two (``lm.batching``), so ``jit`` compiles a
handful of shapes and never per call. Padding uses position -1 (see ``models.decoder``), so it
never changes a result. Scoring computes the keys and values of a prefix shared by several
sequences once (document KV reuse, ``lm.kv_reuse``: every branch ``d ∘ x`` of a passage
starts with the same tokens), with the same log-probs as scoring each sequence whole.
Generation (``lm.flax_decode``) runs a jitted decode loop with a KV cache; the K document
branches of a query decode together and receive the same token at every step (§3.2).

On a device mesh (``mesh=``, ``lm.placement``) the parameters are sharded by the rules table,
each batch's rows over the data axis and the KV caches over their kv-head axis; every process of
a multi-host run calls the same methods with the same inputs and gets the same results.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replug_jax import process
from replug_jax.lm.batching import (
    batch_rows,
    bucket,
    bucket_lengths,
    padding_fraction,
    PrefixGroup,
    plan_prefixes,
    rows_for,
)
from replug_jax.lm.flax_decode import EnsembleDecoding, EnsembleGeneration
from replug_jax.lm.kv_reuse import PrefixKV, compile_fns, score_grouped
from replug_jax.lm.placement import Placement
from replug_jax.lm.scorer import (
    ENSEMBLE_DECODE,
    NEXT_TOKEN,
    SCORE,
    TOP_LOGPROBS,
    ContinuationScore,
    CostMeter,
)
from replug_jax.models import DEFAULT_LM, LanguageModel, load_lm, target_logprobs
from replug_jax.models.decoder import configure_attention
from replug_jax.sharding import MODEL, mesh_size
from replug_jax.process import Timer

__all__ = ["FlaxLM", "EnsembleGeneration", "ScoringStats"]

# Whole-sequence scoring computes the vocabulary head from the batch's first scored position,
# rounded down to a multiple of this (a few compiled variants per shape, not one per prompt).
HEAD_STEP = 64


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


class FlaxLM(EnsembleDecoding):
    """An :class:`~replug_jax.lm.scorer.LMScorer` over an in-process Flax causal LM."""

    capabilities = frozenset({NEXT_TOKEN, SCORE, TOP_LOGPROBS, ENSEMBLE_DECODE})

    def __init__(self, lm: LanguageModel, *, max_context: int = 2048,
                 batch_size: int | None = None, tokens_per_batch: int = 4096,
                 kv_reuse: bool = True, min_shared_tokens: int = 32,
                 reuse_bytes: int | None = None, prefix_cache_bytes: int | None = None,
                 chunk: int = 16, decode_tokens_per_batch: int | None = None, mesh=None):
        """``batch_size``: the most rows of a batch (default: as many as ``tokens_per_batch``
        tokens allow); ``kv_reuse``: compute a prefix shared by ``min_shared_tokens`` or more
        tokens of several scored sequences once; ``reuse_bytes``: the device memory for the
        shared prefixes' keys and values in use at once (default 1 GiB on a CPU, 8 GiB on an
        accelerator); ``prefix_cache_bytes``: the most kept across calls (default half of
        ``reuse_bytes``; 0 keeps none); ``decode_tokens_per_batch``: the KV-cache slots (rows
        × (prompt bucket + new tokens)) one generation batch holds (default 8 ×
        ``tokens_per_batch``; whole groups of K branches, at least one); ``mesh``: a device
        mesh to shard the LM over (its parameters are moved there if they are not yet)."""
        self.lm = lm
        self.place = Placement(mesh, lm.model.dtype)
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
        self.decode_tokens_per_batch = decode_tokens_per_batch or 8 * tokens_per_batch
        self.cost = CostMeter()
        self.buckets = bucket_lengths(self.max_context)
        cfg = lm.config
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_token_id or 0)
        self.eos_id = cfg.eos_token_id
        with_special = self.tokenizer("a")["input_ids"]
        without = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        self.bos = with_special[:1] if len(with_special) > len(without) else []
        if self.place.mesh is not None:  # cuDNN's fused attention where shardings agree
            configure_attention(lm.model, mesh_size(self.place.mesh, MODEL))
        graphdef, state = nnx.split(lm.model)
        self._graphdef = graphdef
        self.state = self.place.shard_state(lm.model, state)
        self._score_fn, self._last_fn, self._topn_fn = scoring_programs(graphdef, self.place)
        self._prefix_fn, self._suffix_fn = compile_fns(graphdef, lm.config, self.place)

    @classmethod
    def load(cls, source: str = DEFAULT_LM, dtype: str = "auto", mesh=None,
             **kwargs) -> "FlaxLM":
        """Load ``source`` (see :func:`~replug_jax.models.load_lm`) in ``dtype`` (``"auto"``:
        bfloat16 on GPUs and TPUs, float32 on a CPU), sharded over ``mesh`` when given (each
        process reading only its devices' slices of the weights)."""
        return cls(load_lm(source, dtype=dtype, mesh=mesh), mesh=mesh, **kwargs)

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
                                                              self.batch_size),
                                          self.place.row_multiple):
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
        refuse_empty(prefixes, "score a continuation after")
        seqs = [list(p) + list(c) for p, c in zip(prefixes, continuations)]
        prompt_lens = [len(p) for p in prefixes]
        for s in seqs:
            self._bucket(len(s))  # one error, before any work
        process.relieve()  # a long run of many shapes stays under vm.max_map_count
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
                rows_ = self.place.rows
                # the head from the first scored position, in steps of HEAD_STEP (few shapes)
                start = (min(prompt_lens[i] for i in idx) - 1) // HEAD_STEP * HEAD_STEP
                logp = np.asarray(self._score_fn(self.state, rows_(tokens), rows_(positions),
                                                 rows_(targets), start=start))
                self.stats.tally(sum(lengths[i] for i in idx), rows * length)
                for j, i in enumerate(idx):
                    p = prompt_lens[i]
                    out[i] = logp[j, p - 1 - start:lengths[i] - 1 - start].astype(np.float32)
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
        refuse_empty(prefixes, "predict the next token of")
        out = np.zeros((len(prefixes), self.lm.config.vocab_size), np.float32)
        lengths = [len(p) for p in prefixes]
        with Timer() as t:
            for idx, length, rows in self._batches(np.argsort(lengths, kind="stable"),
                                                   lengths):
                tokens, positions = self._pack([prefixes[i] for i in idx], length, rows)
                last = np.zeros(rows, np.int32)
                last[:len(idx)] = [lengths[i] - 1 for i in idx]
                lp = self._last_fn(self.state, self.place.rows(tokens),
                                   self.place.rows(positions), self.place.rows(last))
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
                lp, top = self._topn_fn(self.state, self.place.rows(tokens),
                                        self.place.rows(positions), n)
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


def scoring_programs(graphdef, place):
    """``(score_fn, last_fn, topn_fn)``: the jitted scoring programs of an LM whose module
    structure is ``graphdef``, placed by ``place`` (:class:`~replug_jax.lm.placement.Placement`);
    what :class:`FlaxLM` runs and ``replug compile-check`` compiles for a target.

    Rows are right-padded sequences from position 0 (``FlaxLM._pack``): ``right_padded`` lets a
    GPU run fused causal attention. ``score_fn(state, tokens, positions, targets, start)``:
    ``start`` (static) is where the vocabulary head begins, where the scored continuations are
    (the prompt's positions need no logits: a fifth of a small LM's compute, and most of a long
    few-shot prompt's head); returns ``[B, L - start]`` log-probs."""

    def score_fn(state, tokens_BL, positions_BL, targets_BL, start=0):
        model = nnx.merge(graphdef, state)
        x_BLD, _ = model.hidden(tokens_BL, positions_BL, right_padded=True)
        return place.replicated(target_logprobs(model, x_BLD[:, start:],
                                                targets_BL[:, start:]))

    def last_fn(state, tokens_BL, positions_BL, last_B):
        model = nnx.merge(graphdef, state)
        x_BLD, _ = model.hidden(tokens_BL, positions_BL, right_padded=True)
        rows = jnp.arange(tokens_BL.shape[0])
        return place.replicated(jax.nn.log_softmax(model.project(x_BLD[rows, last_B]), axis=-1))

    def topn_fn(state, tokens_BL, positions_BL, n):
        logits, _ = nnx.merge(graphdef, state)(tokens_BL, positions_BL, right_padded=True)
        return place.replicated(jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), n))

    return (jax.jit(place.traced(score_fn), static_argnames=("start",)),
            jax.jit(place.traced(last_fn)),
            jax.jit(place.traced(topn_fn), static_argnames=("n",)))


def refuse_empty(prefixes: Sequence[Sequence[int]], what: str) -> None:
    """An empty prompt on an LM without a BOS token leaves nothing to condition on (padding
    would stand in for a token nobody sent): one line, before any work."""
    empty = [i for i, p in enumerate(prefixes) if len(p) == 0]
    if empty:
        raise ValueError(f"cannot {what} an empty prompt (prompt {empty[0]}) on a model "
                         "without a BOS token: give it some text")
