"""The REPLUG pipeline against independent per-document computations on the real models."""

import numpy as np
import pytest

from replug_jax.lm.flax_scorer import FlaxLM
from replug_jax.replug import Branches, Replug, summarize
from replug_jax.retrieval.corpus import Passage
from replug_jax.retrieval.encoder import Retriever
from replug_jax.retrieval import Index
from tests._models import packaged_or_skip

pytestmark = pytest.mark.models

DOCS = [
    "Berlin is the capital and largest city of Germany.",
    "Paris is the capital of France and its most populous city.",
    "The Rhine flows from the Swiss Alps to the North Sea.",
    "Madrid is the capital of Spain.",
    "Mount Everest is Earth's highest mountain above sea level.",
    "The Danube is the second-longest river in Europe.",
    "The Zorblat river flows through the small town of Quenwick.",
]


@pytest.fixture(scope="module")
def parts():
    packaged_or_skip("minilm")
    packaged_or_skip("smollm2")
    retriever = Retriever.load("minilm")
    passages = [Passage(i, t) for i, t in enumerate(DOCS)]
    index = Index.build(retriever.encode_passages(DOCS), passages, encoder=retriever.identity)
    lm = FlaxLM.load("smollm2", max_context=512)
    return retriever, index, lm


def test_ensemble_equals_independent_per_document_mixture(parts):
    retriever, index, lm = parts
    pipe = Replug(lm, retriever, index, k=3, retrieval_temperature=0.5)
    ctx, cont = "The capital of Germany is", " Berlin, on the river Spree."
    [res] = pipe.score([ctx], [cont])
    # Independent: retrieve, weigh, score each d ∘ x alone, mix in NumPy.
    hits = index.search(retriever.encode_queries([ctx]), 3)
    w = np.exp(hits.scores[0] / 0.5) / np.exp(hits.scores[0] / 0.5).sum()
    per_doc = [lm.score_continuations([p.text + "\n\n" + ctx], [cont])[0].logprobs
               for p in hits.passages[0]]
    mix = np.log(sum(wk * np.exp(lp.astype(np.float64)) for wk, lp in zip(w, per_doc)))
    np.testing.assert_allclose(res.token_logprobs, mix, atol=1e-4)
    np.testing.assert_allclose(res.weights, w, atol=1e-5)
    assert res.doc_ids == [int(i) for i in hits.ids[0]]
    np.testing.assert_allclose(res.responsibility.sum(0), 1.0, atol=1e-5)
    plain = lm.score_continuations([ctx], [cont])[0].total
    assert res.reliance == pytest.approx(res.loglik - plain, abs=1e-3)
    assert res.settings["k"] == 3 and res.settings["retrieval_temperature"] == 0.5
    assert res.settings["separator"] == "\n\n"
    assert res.cost["lm_calls"] == 4 and res.cost["input_tokens"] > 0


def test_k1_identical_permuted_and_separator(parts):
    retriever, index, lm = parts
    ctx, cont = "The longest river in Europe after the Volga is", " the Danube."
    pipe = Replug(lm, retriever, index, k=1)
    [k1] = pipe.score([ctx], [cont])
    top = index.passages[k1.doc_ids[0]]
    ref = lm.score_continuations([top.text + "\n\n" + ctx], [cont])[0].logprobs
    # Equal up to float32 rounding: the branch is scored in another batch and padded length,
    # and XLA's matmul kernels may sum in another order for another shape.
    np.testing.assert_allclose(k1.token_logprobs, ref, rtol=1e-5, atol=1e-5)
    [top1] = pipe.score([ctx], [cont], mode="top1", k=4)
    np.testing.assert_allclose(top1.token_logprobs, ref, rtol=1e-5, atol=1e-5)

    pipe3 = Replug(lm, retriever, index, k=3)
    groups, _ = pipe3.branches([ctx])
    g = groups[0]
    perm = [2, 0, 1]
    permuted = Branches([g.prompts[i] for i in perm], g.log_weights[perm],
                        [g.passages[i] for i in perm], g.scores[perm])
    [a] = pipe3.score([ctx], [cont])
    pipe3.branches = lambda *args, **kw: ([permuted], 0.0)
    [b] = pipe3.score([ctx], [cont])
    np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.responsibility[perm], b.responsibility, rtol=1e-5, atol=1e-5)

    same = Branches([g.prompts[0]] * 3, g.log_weights, g.passages, g.scores)
    pipe3.branches = lambda *args, **kw: ([same], 0.0)
    [c] = pipe3.score([ctx], [cont])
    plain_doc = lm.score_continuations([g.prompts[0]], [cont])[0].logprobs
    np.testing.assert_allclose(c.token_logprobs, plain_doc, rtol=1e-5, atol=1e-5)

    pipe_sep = Replug(lm, retriever, index, k=1, separator="\nContext above.\n")
    [d] = pipe_sep.score([ctx], [cont])
    assert d.settings["separator"] == "\nContext above.\n"
    ref_sep = lm.score_continuations([top.text + "\nContext above.\n" + ctx], [cont])[0]
    np.testing.assert_allclose(d.token_logprobs, ref_sep.logprobs, rtol=1e-5, atol=1e-5)


def test_batched_equals_one_at_a_time(parts):
    retriever, index, lm = parts
    one = FlaxLM(lm.lm, max_context=512, batch_size=1)
    contexts = ["The capital of Spain is", "The highest mountain on Earth is"]
    conts = [" Madrid.", " Mount Everest, in the Himalayas."]
    batched = Replug(lm, retriever, index, k=4).score(contexts, conts)
    single = Replug(one, retriever, index, k=4).score(contexts, conts)
    for x, y in zip(batched, single):
        np.testing.assert_allclose(x.token_logprobs, y.token_logprobs, atol=1e-4)


def test_baselines_share_the_interface(parts):
    retriever, index, lm = parts
    pipe = Replug(lm, retriever, index, k=3, seed=1)
    ctx, cont = ["The Zorblat river flows through the town of"], [" Quenwick."]
    out = {m: pipe.score(ctx, cont, mode=m)[0] for m in ("replug", "none", "concat", "random")}
    assert out["none"].doc_ids == [] and out["none"].reliance is None
    assert len(out["concat"].doc_ids) == 3 and out["concat"].weights == [1.0]
    assert len(out["random"].doc_ids) == 3
    np.testing.assert_allclose(out["random"].weights, [1 / 3] * 3, atol=1e-6)
    # An invented fact: only the retrieved passage can teach it to the LM.
    assert out["replug"].loglik > out["none"].loglik + 3
    assert out["replug"].reliance > 3
    assert out["concat"].loglik > out["none"].loglik + 3
    s = summarize([out["replug"]])
    assert s["bits_per_byte"] == pytest.approx(-out["replug"].loglik / (np.log(2) * 10))
    res = pipe.answer_choice("The capital of France is", [" Madrid.", " Paris.", " Berlin."])
    assert res["option"] == " Paris."


def test_single_token_choices_use_the_next_token_mixture(parts):
    retriever, index, lm = parts
    pipe = Replug(lm, retriever, index, k=3)
    prompt = "Q: Which city is the capital of Germany?\nA. Paris\nB. Berlin\nC. Madrid\nAnswer:"
    options = [" A", " B", " C"]
    fast = pipe.answer_choice(prompt, options)
    assert fast["cost"]["lm_calls"] == 3  # one next-token pass per branch
    slow = pipe.score([prompt] * 3, options, reliance=False)
    np.testing.assert_allclose(fast["scores"], [r.loglik for r in slow], atol=1e-4)
    lp_BV, groups, _ = pipe.next_token([prompt])
    np.testing.assert_allclose(np.exp(lp_BV).sum(-1), 1.0, atol=1e-4)
    assert fast["doc_ids"] == [p.id for p in groups[0].passages]


def test_random_documents_respect_exclusions(parts):
    retriever, index, lm = parts
    pipe = Replug(lm, retriever, index, k=3, seed=0)
    keep = {1, 4, 6}
    excluded = [i for i in range(len(DOCS)) if i not in keep]
    groups, _ = pipe.branches(["x"], mode="random", exclude_ids=[excluded])
    assert {p.id for p in groups[0].passages} == keep
    with pytest.raises(ValueError, match="every passage is excluded"):
        pipe.branches(["x"], mode="random", exclude_ids=[list(range(len(DOCS)))])


def test_random_documents_depend_on_the_query_not_the_batch(parts):
    """Each query's random documents are seeded by (seed, query): the same alone or in any
    batch, and two queries do not share one draw (a seed per call gave every batch's first
    query the same documents)."""
    retriever, index, lm = parts
    pipe = Replug(lm, retriever, index, k=2, seed=0)
    queries = [f"query {i}" for i in range(6)]

    def ids(groups):
        return [tuple(p.id for p in g.passages) for g in groups]

    together = ids(pipe.branches(queries, mode="random")[0])
    alone = [ids(pipe.branches([q], mode="random")[0])[0] for q in queries]
    assert together == alone
    assert len(set(together)) > 1
    other_seed = Replug(lm, retriever, index, k=2, seed=1)
    assert ids(other_seed.branches(queries, mode="random")[0]) != together


def test_coordinated_greedy_decoding_is_mixture_argmax(parts):
    retriever, index, lm = parts
    pipe = Replug(lm, retriever, index, k=3)
    prompt = "Question: What is the capital of Germany?\nAnswer:"
    [gen] = pipe.generate([prompt], max_new_tokens=6, queries=["capital of Germany"])
    groups, _ = pipe.branches([prompt], ["capital of Germany"])
    g = groups[0]
    prefixes = [lm.bos + lm.encode(p) for p in g.prompts]
    ids = lm.tokenizer(gen.text, add_special_tokens=False)["input_ids"]
    chosen = [int(t) for t in lm.tokenizer.convert_tokens_to_ids(
        lm.tokenizer.convert_ids_to_tokens(ids))]
    assert len(chosen) >= 2
    for t, tok in enumerate(chosen):
        lp_KV = lm.next_token_logprobs_ids([p + chosen[:t] for p in prefixes])  # recomputed
        mix = np.logaddexp.reduce(lp_KV + g.log_weights[:, None], axis=0)
        assert int(np.argmax(mix)) == tok, (t, tok)
        assert gen.token_logprobs[t] == pytest.approx(mix[tok], abs=2e-3)
    np.testing.assert_allclose(gen.responsibility.sum(0), 1.0, atol=1e-5)
    assert gen.cost["output_tokens"] > 0 and gen.settings["mode"] == "replug"


def test_bad_inputs(parts):
    retriever, index, lm = parts
    with pytest.raises(ValueError, match="mode"):
        Replug(lm, retriever, index, mode="bogus")
    with pytest.raises(ValueError, match="needs a retriever"):
        Replug(lm, None, None, mode="replug")
    with pytest.warns(UserWarning, match="only 7 passages"):
        res = Replug(lm, retriever, index, k=10).score(["The capital of Spain is"], [" Madrid."])
    assert len(res[0].doc_ids) == 7
    with pytest.raises(ValueError, match="exceeds the LM context"):
        Replug(lm, retriever, index, k=2).score(["word " * 600], [" end"])
    # A document longer than the context is cut to fit, and counted.
    long_index = Index.build(retriever.encode_passages(["Madrid " * 800]),
                             [Passage(0, "Madrid " * 800)])
    pipe = Replug(lm, retriever, long_index, k=1)
    [r] = pipe.score(["The capital of Spain is"], [" Madrid."])
    assert pipe.truncated_documents == 1 and np.isfinite(r.loglik)


def test_documents_of_multibyte_characters_are_cut_to_fit():
    """Characters split into several byte tokens: truncation never exceeds the budget, and
    fitting a document to the context always ends (a real NQ passage once looped forever)."""
    from tests._models import tiny_lm, tiny_retriever

    lm = tiny_lm(0, max_context=64)
    texts = ["漢字テスト" * 20, "hello 😀😀😀 world " * 10, "plain words here " * 30]
    for text in texts:
        for n in range(40):
            cut = lm.truncate(text, n)
            assert text.startswith(cut) and lm.count_tokens(cut) <= n
    retriever = tiny_retriever()
    passages = [Passage(i, t) for i, t in enumerate(texts)]
    index = Index.build(retriever.encode_passages(texts), passages, encoder=retriever.identity)
    pipe = Replug(lm, retriever, index, k=3)
    groups, _ = pipe.branches(["A question about 😀 and 漢字?"], reserve=16)
    for prompt in groups[0].prompts:
        assert lm.count_tokens(prompt) + 16 + 1 <= 64


def test_batched_generation_cuts_each_row_at_its_stop_string():
    """Regression: a row that hit its stop string kept decoding while other rows ran, and an
    EOS it emitted later marked it "eos" with the text past the stop string kept. The tiny
    random LM's greedy continuations are fixed, so the stop string (" Sharing", 3rd token of
    the first row) and an EOS (set to the first row's 26th token, in the second 16-token
    chunk) are chosen from them."""
    from tests._models import tiny_lm

    lm = tiny_lm(0)
    prompts = ["The capital of Germany is", "Question: who wrote Hamlet?", "x y z"]
    free = lm.generate_ensemble([[p] for p in prompts], np.zeros((3, 1)), max_new_tokens=40)
    first = free.token_ids[0]
    stop = lm.tokenizer.decode(first[2:3]).strip()
    assert all(stop not in t for t in free.texts[1:])
    lm.eos_id = first[25]
    assert first.index(first[25]) > lm.chunk and all(first[25] not in t
                                                      for t in free.token_ids[1:])
    got = lm.generate_ensemble([[p] for p in prompts], np.zeros((3, 1)), max_new_tokens=40,
                               stop=[stop])
    upto = lm.tokenizer.decode(first[:3])  # the text cut where the stop string starts
    assert got.stopped_by == ["stop", "length", "length"]
    assert got.texts[0] == upto[:upto.index(stop)] and got.token_ids[0] == first[:3]
    assert stop not in got.texts[0] and got.texts[1:] == free.texts[1:]
    alone = lm.generate_ensemble([[prompts[0]]], np.zeros((1, 1)), max_new_tokens=40,
                                 stop=[stop])
    assert alone.texts == got.texts[:1] and alone.token_ids[0] == got.token_ids[0]


def test_generation_over_many_groups_goes_in_bounded_batches():
    """Regression: ``generate_ensemble`` prefilled and cached every group's K branches at once
    (300 questions × 4 documents were killed for memory at 16.7 GiB). Now whole groups go
    ``decode_tokens_per_batch`` cache slots at a time: with room for one group per batch the
    greedy answers, their tokens and log-probs are those of one batch of all, in order."""
    from tests._models import tiny_lm

    lm = tiny_lm(0)
    prompts = [[f"Question {i}: who wrote Hamlet?", f"Paris is the capital of {i}"]
               for i in range(5)]
    log_w = np.log(np.array([[0.7, 0.3], [0.5, 0.5], [0.2, 0.8], [0.9, 0.1], [0.4, 0.6]]))
    lm.decode_tokens_per_batch = 1 << 20
    whole = lm.generate_ensemble(prompts, log_w, max_new_tokens=12)
    calls = []
    run_groups = lm._generate_groups
    lm._generate_groups = lambda flat, *a: calls.append(len(flat)) or run_groups(flat, *a)
    longest = max(len(lm.bos + lm.encode(p)) for group in prompts for p in group)
    lm.decode_tokens_per_batch = 2 * (lm._bucket(longest) + 12)  # one group of 2 branches
    parts = lm.generate_ensemble(prompts, log_w, max_new_tokens=12)
    assert calls == [2] * 5
    assert parts.token_ids == whole.token_ids and parts.texts == whole.texts
    assert parts.stopped_by == whole.stopped_by
    for a, b in zip(parts.branch_logprobs, whole.branch_logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for a, b in zip(parts.mixture_logprobs, whole.mixture_logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_generation_length_is_checked_per_prompt_not_per_bucket():
    """Regression: the bucketed prompt length plus whole decode chunks was checked against
    the model's positions, so a prompt that fits (with its new tokens) failed next to a
    longer bucket; now each prompt is checked on its own and named when it does not fit."""
    from tests._models import tiny_lm

    lm = tiny_lm(0, max_context=512)  # 512 positions
    prompt = " ".join(["word"] * 90)
    n = lm.count_tokens(prompt) + len(lm.bos)
    assert 64 < n <= 112  # bucket 128: 128 + 400 rounded up to 512 > 512 positions
    g = lm.generate_ensemble([[prompt], ["short"]], np.zeros((2, 1)), max_new_tokens=512 - n)
    assert len(g.token_ids[0]) <= 512 - n
    with pytest.raises(ValueError, match="prompt 1 .* exceeds the model's 512 positions"):
        lm.generate_ensemble([["short"], [prompt]], np.zeros((2, 1)),
                             max_new_tokens=513 - n)
