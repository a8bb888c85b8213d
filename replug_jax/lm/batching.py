"""How a scoring call is cut into compiled shapes: shared prefixes, length buckets, row counts.

Pure Python and NumPy (no JAX, no model), so the plan is testable on its own.

**Shared prefixes (document KV reuse).** A REPLUG branch is ``d ∘ x`` (§3.2): every query
that retrieves passage ``d`` scores a sequence that starts with the same tokens, so their keys
and values over those tokens are the same (causal attention: a token's KV depends only on the
tokens before it). :func:`plan_prefixes` finds such shared token prefixes among the sequences
of one call, with no help from the caller (a document-first layout, a demonstrations-first
layout and an LSR pool are all handled alike), and chooses which to compute once:

1. each sequence may share at most its first ``limit_i`` tokens (its prompt minus one token:
   the last prompt token's output predicts the first scored token, so it must be recomputed);
2. sort those heads lexicographically: sequences sharing a prefix become neighbours, and
   the longest prefix shared by a run of them is the minimum of their neighbours' common
   prefix lengths;
3. on the Cartesian tree of those minima, bottom up: for each number of sequences a run leaves
   single, its cheapest choice, from its parts' choices combined and, optionally, one group
   sharing the run's common prefix that takes all the singles left; the root's cheapest
   choice is the plan (the fewest tokens over every grouping into groups of one level).

Reuse is exact: the grouped computation attends over the same keys as the whole sequence
(``models.decoder``'s cache path), so results agree to float rounding.

**Buckets and rows.** Lengths are padded to a fine fixed grid (:data:`LENGTH_GRID`: at most a
third of a row is padding from 16 tokens up, usually a few percent; steps of 8 below 64, where
the suffixes scored after a shared document lie — a question and its answer; a fixed grid keeps
compiled programs reusable across calls), rows per batch come from a token budget
(:func:`rows_for`), and a short last batch is padded to the next power of two rows or, past
8 rows, to the next multiple of 8 when that is fewer (19 rows pad to 24, not 32), so a call
compiles at most ``4 + rows / 8`` row counts per length.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

LENGTH_GRID = (8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512,
               640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144,
               8192, 12288, 16384, 24576, 32768)

ROW_STEP = 8  # a short last batch past 8 rows pads to a multiple of this (or a power of two)


def bucket_lengths(max_context: int) -> tuple[int, ...]:
    """The grid up to ``max_context``, which is always the last bucket."""
    return tuple(b for b in LENGTH_GRID if b < max_context) + (max_context,)


def bucket(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``length`` tokens."""
    for b in buckets:
        if b >= length:
            return b
    raise ValueError(f"sequence of {length} tokens exceeds the LM context of {buckets[-1]}; "
                     "shorten the input or the documents")


def floor_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def rows_for(length: int, tokens_per_batch: int, max_rows: int | None = None,
             bytes_per_row: int = 0, max_bytes: int = 0) -> int:
    """Rows of a batch of ``length``-token sequences: a power of two filling
    ``tokens_per_batch`` tokens (at least one row), at most ``max_rows``, and, when rows carry
    ``bytes_per_row`` of cached keys and values, at most ``max_bytes`` of them."""
    rows = max(1, tokens_per_batch // max(length, 1))
    if max_rows:
        rows = min(rows, max_rows)
    if bytes_per_row and max_bytes:
        rows = min(rows, max(1, max_bytes // bytes_per_row))
    return floor_pow2(rows)


def batch_rows(n: int, rows: int, multiple: int = 1) -> list[tuple[int, int]]:
    """``(count, padded_rows)`` of each batch when ``n`` items go ``rows`` at a time: full
    batches, then a short last one padded to the next power of two or the next multiple of
    :data:`ROW_STEP`, whichever is fewer. Every padded row count is a multiple of
    ``multiple`` (the devices a batch is split over on a mesh): ``rows`` is raised to the next
    one if it is not."""
    rows = -(-rows // multiple) * multiple
    out = [(rows, rows)] * (n // rows)
    if n % rows:
        short = min(rows, padded_count(n % rows))
        out.append((n % rows, -(-short // multiple) * multiple))
    return out


def padded_count(n: int) -> int:
    """``n`` rounded up to the next power of two or, past 8, to the next multiple of
    :data:`ROW_STEP` when that is smaller: the few sizes an array of ``n`` rows is padded to."""
    return min(1 << (max(n, 1) - 1).bit_length(), -(-n // ROW_STEP) * ROW_STEP)


@dataclasses.dataclass(frozen=True)
class PrefixGroup:
    """Sequences ``members`` whose first ``length`` tokens are the same."""

    length: int
    members: tuple[int, ...]


def _common(a: Sequence[int], b: Sequence[int], cap: int) -> int:
    n = min(len(a), len(b), cap)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_prefixes(seqs: Sequence[Sequence[int]], limits: Sequence[int], *,
                  min_shared: int = 32) -> tuple[list[PrefixGroup], list[int]]:
    """``(groups, singles)``: groups of sequences that share a prefix of at least
    ``min_shared`` tokens (the prefix computed once), and the sequences scored whole.

    ``limits[i]`` caps how many of sequence ``i``'s tokens may be shared. Lowers the tokens
    processed, ``Σ_groups (length + Σ_members (len_i − length)) + Σ_singles len_i``, by a
    bottom-up choice on the tree of common prefixes (see the module docstring): never more than
    scoring every sequence whole, and the best grouping into groups of one level (checked
    against exhaustive search; the greedy choice it replaces was up to 8 % above it)."""
    n = len(seqs)
    if n < 2:
        return [], list(range(n))
    # Only the first limits[i] tokens can be shared: order and compare those.
    heads = [tuple(s[:max(lim, 0)]) for s, lim in zip(seqs, limits)]
    order = sorted(range(n), key=lambda i: heads[i])
    lens = [len(seqs[i]) for i in order]
    # a[j]: tokens shareable by sorted neighbours j and j + 1.
    a = [_common(heads[order[j]], heads[order[j + 1]], n_max) for j in range(n - 1)
         for n_max in [min(len(heads[order[j]]), len(heads[order[j + 1]]))]]
    # Post-order over the Cartesian tree of `a`, with an explicit stack (runs can be deep).
    # A run's result maps s, the number of its sequences left single for an enclosing run to
    # group, to the cheapest (cost, groups, singles) with s singles: keeping a single for a
    # shallower group can beat putting it in a deeper one (the exact one-level optimum along
    # the tree). Groups and singles are nested pairs, flattened once at the end.
    results: dict[tuple[int, int], dict[int, tuple[int, tuple, tuple]]] = {}
    stack = [(0, n - 1, False)]
    while stack:
        lo, hi, expanded = stack.pop()
        if lo == hi:
            results[(lo, hi)] = {1: (lens[lo], (), (lo, ()))}
            continue
        m = min(a[lo:hi])
        cuts = [j for j in range(lo, hi) if a[j] == m]
        parts = [(s, e) for s, e in zip([lo] + [c + 1 for c in cuts], cuts + [hi])]
        if not expanded:
            stack.append((lo, hi, True))
            stack.extend((s, e, False) for s, e in parts)
            continue
        run = {0: (0, (), ())}
        for part in parts:  # the parts' choices combined, by how many singles they leave
            merged: dict[int, tuple[int, tuple, tuple]] = {}
            choices = results.pop(part)
            for s1, (c1, g1, x1) in run.items():
                for s2, (c2, g2, x2) in choices.items():
                    if s1 + s2 not in merged or c1 + c2 < merged[s1 + s2][0]:
                        merged[s1 + s2] = (c1 + c2, (g1, g2), (x1, x2))
            run = merged
        if m >= min_shared:  # one group sharing the run's m tokens takes all its singles
            for s_, (c, g, x) in list(run.items()):
                if s_ >= 2 and (0 not in run or c - m * (s_ - 1) < run[0][0]):
                    run[0] = (c - m * (s_ - 1), ((m, x), g), ())
        results[(lo, hi)] = run
    _, grouped, whole_rows = min(results[(0, n - 1)].values(), key=lambda r: r[0])
    return ([PrefixGroup(m, tuple(sorted(order[j] for j in _flat(members))))
             for m, members in _flat(grouped)], sorted(order[j] for j in _flat(whole_rows)))


def _flat(nested: tuple) -> list:
    """The leaves of nested pairs ``((a, b), c)`` built by :func:`plan_prefixes`: a group is a
    pair ``(m, members)`` and a single a pair ``(j, ())``; ``()`` is empty."""
    out, stack = [], [nested]
    while stack:
        node = stack.pop()
        if node == ():
            continue
        head, tail = node
        if isinstance(head, int):  # a leaf: a single (j, ()) or a group (m, members)
            out.append(head if tail == () else (head, tail))
        else:
            stack.extend((tail, head))
    return out


def padding_fraction(real_tokens: int, padded_tokens: int) -> float:
    """The share of processed token slots that were padding."""
    return 0.0 if padded_tokens == 0 else 1.0 - real_tokens / padded_tokens
