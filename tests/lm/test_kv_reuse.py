"""Document KV reuse: the plan of shared prefixes, and scoring through it equal to scoring whole."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._models import cached_tokenizer, tiny_lm
from replug_jax.lm.batching import (
    LENGTH_GRID,
    batch_rows,
    bucket,
    bucket_lengths,
    plan_prefixes,
    rows_for,
)


def _cost(seqs, groups, singles):
    return (sum(g.length + sum(len(seqs[i]) - g.length for i in g.members) for g in groups)
            + sum(len(seqs[i]) for i in singles))


@st.composite
def _sequences(draw):
    stems = draw(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), min_size=1,
                          max_size=4))
    seqs = [draw(st.sampled_from(stems)) + draw(st.lists(st.integers(0, 3), min_size=1,
                                                         max_size=6))
            for _ in range(draw(st.integers(1, 9)))]
    limits = [draw(st.integers(0, len(s) - 1)) for s in seqs]
    return seqs, limits, draw(st.integers(1, 6))


def _brute_force(seqs, limits, min_shared):
    """The best cost over every one-level partition into groups (small inputs only)."""
    import functools

    n = len(seqs)

    def shared(members):
        m = min(limits[i] for i in members)
        first = seqs[members[0]]
        for i in members[1:]:
            m = min(m, next((j for j, (a, b) in enumerate(zip(first, seqs[i])) if a != b),
                            min(len(first), len(seqs[i]))))
        return m

    @functools.cache
    def best(remaining: frozenset) -> int:
        if not remaining:
            return 0
        first = min(remaining)
        rest = sorted(remaining - {first})
        out = len(seqs[first]) + best(frozenset(rest))
        for mask in range(1, 1 << len(rest)):
            members = [first] + [rest[j] for j in range(len(rest)) if mask >> j & 1]
            m = shared(members)
            if m >= min_shared:
                cost = m + sum(len(seqs[i]) - m for i in members)
                out = min(out, cost + best(frozenset(remaining - set(members))))
        return out

    return best(frozenset(range(n)))


@settings(max_examples=150, deadline=None)
@given(_sequences())
def test_plan_prefixes_is_a_valid_partition_near_the_best(case):
    seqs, limits, min_shared = case
    groups, singles = plan_prefixes(seqs, limits, min_shared=min_shared)
    covered = sorted([i for g in groups for i in g.members] + singles)
    assert covered == list(range(len(seqs)))  # every sequence exactly once
    for g in groups:
        assert len(g.members) >= 2 and g.length >= min_shared
        head = seqs[g.members[0]][:g.length]
        for i in g.members:  # the prefix is shared and within each member's limit
            assert seqs[i][:g.length] == head and g.length <= limits[i]
    cost = _cost(seqs, groups, singles)
    assert cost <= sum(map(len, seqs))
    if len(seqs) <= 7:  # the best partition, as exhaustive search finds it
        assert cost == _brute_force(seqs, limits, min_shared)


def test_plan_keeps_a_single_for_a_shallower_group_when_that_is_cheaper():
    """Seven equal sequences shareable to 9, 0, 4, 7, 9, 9, 9 tokens: {0, 4, 5, 6} at 9 and
    {2, 3} at 4 (39 tokens), not 3 joining the group at 7 and leaving 2 alone (42; what the
    greedy plan chose, found by hypothesis)."""
    seqs, limits = [[0] * 10] * 7, [9, 0, 4, 7, 9, 9, 9]
    groups, singles = plan_prefixes(seqs, limits, min_shared=1)
    assert sorted((g.length, g.members) for g in groups) == [(4, (2, 3)), (9, (0, 4, 5, 6))]
    assert singles == [1] and _cost(seqs, groups, singles) == 39


def test_plan_lets_a_shallow_group_take_some_parts_and_leave_a_deeper_one():
    """Five equal sequences, two shareable to 1 token and three to 2: groups {0, 1} at 1 and
    {2, 3, 4} at 2 (cost 10), not one group at 1 (11)."""
    seqs, limits = [[0, 0, 0]] * 5, [1, 1, 2, 2, 2]
    groups, singles = plan_prefixes(seqs, limits, min_shared=1)
    assert _cost(seqs, groups, singles) == 10 == _brute_force(seqs, limits, 1)


def test_plan_groups_documents_and_demonstrations():
    doc_a, doc_b, demos = [1] * 40, [2] * 50, [9] * 60
    seqs = [doc_a + [5, 6, 7], doc_a + [5, 8], doc_b + [3], doc_b + [4, 4], [7] * 20]
    groups, singles = plan_prefixes(seqs, [len(s) - 1 for s in seqs], min_shared=32)
    assert sorted((g.length, sorted(g.members)) for g in groups) == [(41, [0, 1]), (50, [2, 3])]
    assert singles == [4]
    # Demonstrations first: everything shares them, and documents recur too little to split.
    seqs = [demos + [k] * 40 + [k, 100 + k] for k in range(6)]
    groups, singles = plan_prefixes(seqs, [len(s) - 1 for s in seqs], min_shared=32)
    assert [(g.length, len(g.members)) for g in groups] == [(60, 6)] and not singles


def test_buckets_and_rows():
    assert bucket_lengths(300)[-1] == 300 and all(b < 300 for b in bucket_lengths(300)[:-1])
    assert bucket(129, LENGTH_GRID) == 160 and bucket(16, LENGTH_GRID) == 16
    assert bucket(20, LENGTH_GRID) == 24  # a question and its answer after a shared document
    # at most a third of a row is padding from 16 tokens up
    assert all(bucket(n, LENGTH_GRID) - n <= bucket(n, LENGTH_GRID) / 3
               for n in range(16, LENGTH_GRID[-1] + 1))
    with pytest.raises(ValueError, match="exceeds the LM context of 300"):
        bucket(301, bucket_lengths(300))
    assert rows_for(128, 4096) == 32 and rows_for(100, 4096) == 32 and rows_for(5000, 4096) == 1
    assert rows_for(128, 4096, max_rows=24) == 16
    assert rows_for(128, 4096, bytes_per_row=10, max_bytes=75) == 4
    assert batch_rows(70, 32) == [(32, 32), (32, 32), (6, 8)]
    assert batch_rows(3, 32) == [(3, 4)] and batch_rows(0, 8) == []
    # past 8 rows the next multiple of 8 when it is fewer than the next power of two
    assert batch_rows(19, 32) == [(19, 24)] and batch_rows(17, 64) == [(17, 24)]
    assert batch_rows(12, 32) == [(12, 16)] and batch_rows(33, 64) == [(33, 40)]
    assert batch_rows(19, 32, multiple=16) == [(19, 32)]  # a mesh's multiple still holds
    # at most 4 + rows / 8 row counts per length
    assert len({p for n in range(1, 65) for _, p in batch_rows(n, 64)}) <= 4 + 64 // 8


def _tiny_gpt2(seed=0):
    from flax import nnx

    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.models import CausalLM, DecoderConfig, LanguageModel

    cfg = DecoderConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=4, head_dim=8, max_position=512, norm="layer",
                        mlp="gelu_tanh", position="learned", attn_bias=True, mlp_bias=True,
                        tie_embeddings=False, family="gpt2", eos_token_id=2, pad_token_id=2)
    lm = LanguageModel(CausalLM(cfg, rngs=nnx.Rngs(seed)), cached_tokenizer("smollm2"), cfg,
                       f"tiny-gpt2-{seed}", f"tiny-gpt2-{seed}")
    return FlaxLM(lm, max_context=256)


def _shared_pairs(seed=0, n=14):
    """Token-id pairs in REPLUG's shape: 4 passages, each the prefix of several branches."""
    rng = np.random.default_rng(seed)
    docs = [[1] + list(rng.integers(3, 49000, size=rng.integers(35, 110))) for _ in range(4)]
    prefixes, conts = [], []
    for q in range(n):
        prefixes.append(docs[q % 4] + list(rng.integers(3, 49000, size=rng.integers(2, 30))))
        conts.append(list(rng.integers(3, 49000, size=rng.integers(1, 20))))
    prefixes.append([1, 7, 8]), conts.append([9, 10, 11])  # shares nothing: scored whole
    return prefixes, conts


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_reuse_equals_whole_sequence_scoring(family):
    make = tiny_lm if family == "llama" else _tiny_gpt2
    reuse, whole = make(0), make(0)
    whole.kv_reuse = False
    prefixes, conts = _shared_pairs()
    got = reuse.score_token_ids(prefixes, conts)
    want = whole.score_token_ids(prefixes, conts)
    assert [len(g) for g in got] == [len(c) for c in conts]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=1e-5, rtol=0)
    s = reuse.stats.summary()
    assert s["reused_prefixes"] == 4 and s["shared_rows"] == 14
    assert s["real_tokens"] < 0.7 * whole.stats.summary()["real_tokens"]
    # The next call finds the passages in the cross-call cache: same values, cache hits.
    again = reuse.score_token_ids(prefixes[:5], conts[:5])
    np.testing.assert_allclose(np.concatenate(again), np.concatenate(want[:5]), atol=1e-5,
                               rtol=0)
    assert reuse.prefix_cache.hits >= 4


def test_head_from_the_first_scored_position_equals_the_whole_head():
    """Whole-sequence scoring computes the vocabulary head only from the batch's first scored
    position (rounded down to HEAD_STEP; each of these lengths is its own bucket, so the
    heads start at 128, 64, 192 and 0): the log-probs of the full head at those positions."""
    lm = tiny_lm(0, max_context=512)
    lm.kv_reuse = False
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 2000, n).tolist() for n in (150, 70, 200, 9)]
    conts = [rng.integers(5, 2000, n).tolist() for n in (5, 12, 3, 7)]
    got = lm.score_token_ids(prompts, conts)
    for p, c, g in zip(prompts, conts, got):
        seq = np.array([p + c], np.int32)
        pos = np.arange(seq.shape[1], dtype=np.int32)[None]
        targets = np.concatenate([seq[:, 1:], np.zeros((1, 1), np.int32)], 1)
        full = np.asarray(lm._score_fn(lm.state, seq, pos, targets))  # start = 0
        np.testing.assert_allclose(g, full[0, len(p) - 1:len(p) + len(c) - 1], atol=1e-5)


def test_suffix_head_from_the_first_scored_position_equals_whole_scoring():
    """After a shared passage each row's own question tokens need no vocabulary head: the
    suffix's head runs on each row's scored positions only (a width bucket: 8 for answers of
    up to 8 tokens), with the log-probs of scoring each sequence whole."""
    reuse, whole = tiny_lm(2), tiny_lm(2)
    whole.kv_reuse = False
    rng = np.random.default_rng(5)
    doc = [1] + rng.integers(3, 2000, 60).tolist()
    prefixes = [doc + rng.integers(3, 2000, n).tolist() for n in (17, 19, 22, 25, 18)]
    conts = [rng.integers(3, 2000, n).tolist() for n in (3, 1, 4, 2, 5)]
    widths = []
    suffix_fn = reuse._suffix_fn

    def spy(*args, width):
        widths.append(width)
        return suffix_fn(*args, width=width)

    reuse._suffix_fn = spy
    got = reuse.score_token_ids(prefixes, conts)
    want = whole.score_token_ids(prefixes, conts)
    assert widths and set(widths) == {8}  # answers of up to 5 tokens
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=1e-5, rtol=0)


def test_reuse_through_the_pipeline_text_api():
    """``score_continuations`` (the pipeline's entry) with and without reuse: same log-probs
    on branches ``d ∘ x`` built from text."""
    reuse, whole = tiny_lm(1), tiny_lm(1)
    whole.kv_reuse = False
    passage = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
               "France. It is named after the engineer Gustave Eiffel, whose company designed "
               "and built the tower from 1887 to 1889.")
    prompts = [f"{passage}\n\nQuestion: {q}\nAnswer:" for q in
               ("Who designed the tower?", "Where is it?", "When was it built?")]
    conts = [" Gustave Eiffel", " Paris", " 1887 to 1889"]
    got = [r.logprobs for r in reuse.score_continuations(prompts, conts)]
    want = [r.logprobs for r in whole.score_continuations(prompts, conts)]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=1e-5, rtol=0)
    assert reuse.stats.reused_prefixes == 1


def test_prefix_cache_is_bounded_in_bytes():
    lm = tiny_lm(2)
    per = 2 * 2 * 2 * 8 * 4 * 64  # k and v: layers × J × D × float32 × a 64-token bucket
    lm.prefix_cache.max_bytes = 3 * (per + 64 * 4)  # three 64-token entries (with positions)
    for seed in range(4):
        prefixes, conts = _shared_pairs(seed, n=8)
        lm.score_token_ids(prefixes, conts)
        assert lm.prefix_cache.bytes <= lm.prefix_cache.max_bytes
    assert 0 < len(lm.prefix_cache) <= 3


def test_the_cross_call_prefix_cache_evicts_the_least_recently_used_past_its_bytes():
    """lm/kv_reuse.py's PrefixKV: entries of 20 bytes per token here; a read makes an entry
    the most recent; past max_bytes the least recent goes; an entry larger than the whole
    cache is not kept; the longest cached prefix within the limits is found."""
    from replug_jax.lm.kv_reuse import PrefixKV

    def entry(n):  # keys and values [layers 1, heads 1, n, 2] float32, positions [n] int32
        return (np.zeros((1, 1, n, 2), np.float32), np.zeros((1, 1, n, 2), np.float32),
                np.zeros(n, np.int32))

    cache = PrefixKV(max_bytes=100)
    cache.put((1, 2), entry(2))
    cache.put((1, 2, 3), entry(3))
    assert cache.bytes == 100 and len(cache) == 2
    assert cache.get((1, 2)) is not None and cache.hits == 1
    cache.put((7,), entry(1))  # 120 bytes: the least recent, (1, 2, 3), goes
    assert cache.get((1, 2, 3)) is None and cache.bytes == 60 and len(cache) == 2
    assert cache.longest([1, 2, 3, 4], limit=4, min_len=1) == 2
    assert cache.longest([1, 2, 3, 4], limit=1, min_len=1) == 0
    cache.put(tuple(range(10)), entry(10))  # 200 bytes: larger than the cache, not kept
    assert len(cache) == 2
