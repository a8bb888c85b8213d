"""Evaluation harnesses against hand-computed examples: QA normalisation/EM/F1, sliding-window
bits per byte with the leakage filter, MMLU prompts and accuracy."""

import numpy as np
import pytest

from replug_jax.eval.qa import exact_match, f1_score, first_line, normalize_answer


def test_normalisation():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert normalize_answer("Theatre") == "theatre"  # 'the' only as a word


def test_exact_match_against_aliases():
    assert exact_match("the Beatles.", ["Beatles", "The Fab Four"]) == 1.0
    assert exact_match("Rolling Stones", ["Beatles"]) == 0.0


def test_f1_hand_computed():
    # pred {barack, obama}, gold {barack, hussein, obama}: P = 1, R = 2/3, F1 = 0.8.
    assert f1_score("Barack Obama", ["Barack Hussein Obama"]) == pytest.approx(0.8)
    # Best over aliases.
    assert f1_score("Obama", ["Barack Hussein Obama", "Obama"]) == pytest.approx(1.0)
    assert f1_score("", ["x"]) == 0.0


def test_first_line():
    assert first_line("\n Paris\nQuestion: next") == "Paris"


# -- language modelling: sliding windows, leakage filter, bits per byte ----------------------

WIKI = (" = Alpha River = \n \n The Alpha River flows north through the Brel valley . It is "
        "long and slow , and its delta is a marsh of reeds . \n \n = = Course = = \n The river "
        "rises in the hills and meets the sea at Port Vane . \n \n = Beta Town = \n \n Beta Town "
        "is a market town on the Alpha River . Its bridge dates from the tenth century . \n")


def test_split_wikitext_articles():
    from replug_jax.eval.perplexity import split_wikitext

    docs = split_wikitext(WIKI)
    assert [d.title for d in docs] == ["Alpha River", "Beta Town"]
    assert "= = Course = =" in docs[0].text and "Beta" not in docs[0].text
    # a formula line shaped like a title inside a paragraph (WikiText test's filter article)
    # does not start an article where the text has blank lines
    formula = WIKI.replace("Its bridge", "Its span L \n = 1 metre per second = \n Its bridge")
    assert [d.title for d in split_wikitext(formula)] == ["Alpha River", "Beta Town"]
    assert [d.title for d in split_wikitext(formula.replace("\n \n", "\n"))] == [
        "Alpha River", "Beta Town", "1 metre per second"]


@pytest.fixture(scope="module")
def tiny_pipe():
    from replug_jax.eval.perplexity import split_wikitext
    from replug_jax.replug import Replug
    from replug_jax.retrieval.corpus import chunk_documents
    from replug_jax.retrieval import Index
    from tests._models import tiny_lm, tiny_retriever

    docs = split_wikitext(WIKI)
    passages = chunk_documents(docs, size=8)
    retriever = tiny_retriever()
    index = Index.build(retriever.encode_passages([p.text for p in passages]), passages,
                        encoder=retriever.identity)
    return docs, passages, Replug(tiny_lm(), retriever, index, k=2)


def test_windows_tile_the_document(tiny_pipe):
    from replug_jax.eval.perplexity import WindowSettings, sliding_windows

    docs, _, pipe = tiny_pipe
    tok = pipe.lm.tokenizer
    s = WindowSettings(context_tokens=6, stride=5, query_tokens=4, skip_first=3)
    ws = sliding_windows(docs[0], tok, s)
    n = len(tok(docs[0].text, add_special_tokens=False)["input_ids"])
    assert len(ws) == -(-(n - 3) // 5)
    assert "".join(w.target for w in ws) == docs[0].text[ws[0].target_span[0]:]
    for w in ws:
        assert w.context.endswith(w.query)
        assert len(tok(w.context, add_special_tokens=False)["input_ids"]) <= 6 + 1
        assert docs[0].text[w.span[0]:w.span[1]] == w.context + w.target
    capped = sliding_windows(docs[0], tok, WindowSettings(stride=2, skip_first=1,
                                                          max_windows_per_document=3))
    assert len(capped) == 3
    with pytest.raises(ValueError, match="leakage"):
        WindowSettings(leakage="sometimes")


def test_leakage_filter(tiny_pipe):
    from replug_jax.eval.perplexity import WindowSettings, leakage_exclusions, sliding_windows

    docs, passages, pipe = tiny_pipe
    ws = sliding_windows(docs[0], pipe.lm.tokenizer, WindowSettings(8, 6, 8, 4))
    by_window = leakage_exclusions(ws, passages, "window")
    for w, excl in zip(ws, by_window):
        expect = [p.id for p in passages if p.source_id == w.source_id
                  and p.start < w.span[1] and p.end > w.span[0]]
        assert excl == expect and excl
    whole = leakage_exclusions(ws, passages, "document")
    assert whole[0] == [p.id for p in passages if p.source_id == docs[0].id]
    assert leakage_exclusions(ws, passages, "none")[0] == []


def test_bits_per_byte_against_independent_scoring(tiny_pipe):
    from replug_jax.eval.perplexity import (
        WindowSettings,
        evaluate_lm,
        leakage_exclusions,
        sliding_windows,
    )

    docs, passages, pipe = tiny_pipe
    s = WindowSettings(context_tokens=8, stride=6, query_tokens=8, skip_first=4)
    rep = evaluate_lm(pipe, docs, s, modes=("none", "replug"), batch_size=3, progress=False,
                      keep_results=True)
    ws = [w for d in docs for w in sliding_windows(d, pipe.lm.tokenizer, s)]
    assert rep["windows"] == len(ws)
    plain = pipe.lm.score_continuations([w.context for w in ws], [w.target for w in ws])
    ll = sum(float(p.logprobs.astype(np.float64).sum()) for p in plain)
    nbytes = sum(len(w.target.encode()) for w in ws)
    assert nbytes == sum(len(d.text[sliding_windows(d, pipe.lm.tokenizer, s)[0].target_span[0]:]
                             .encode()) for d in docs)
    none = rep["modes"]["none"]
    assert none["num_bytes"] == nbytes
    assert none["bits_per_byte"] == pytest.approx(-ll / (np.log(2) * nbytes), rel=1e-5)
    assert none["perplexity"] == pytest.approx(np.exp(-ll / none["num_tokens"]), rel=1e-5)
    excl = leakage_exclusions(ws, passages, "window")
    for r, e in zip(rep["modes"]["replug"]["results"], excl):
        assert not set(r.doc_ids) & set(e) and len(r.doc_ids) == 2
    assert rep["modes"]["replug"]["cost"]["lm_calls"] == 2 * len(ws)


# -- MMLU ------------------------------------------------------------------------------------

def test_mmlu_reading_prompt_and_accuracy(tmp_path):
    from replug_jax.eval.mmlu import Question, accuracy_table, load_mmlu, prompt

    for split in ("dev", "test"):
        (tmp_path / split).mkdir()
    (tmp_path / "dev" / "astronomy_dev.csv").write_text('"Sun, a star?",yes,no,maybe,never,A\n')
    (tmp_path / "test" / "astronomy_test.csv").write_text("What orbits Earth?,Moon,Mars,Sun,"
                                                           "Venus,A\n")
    dev, test = load_mmlu(tmp_path, "dev", ["astronomy"]), load_mmlu(tmp_path, "test",
                                                                     ["astronomy"])
    assert dev["astronomy"][0].question == "Sun, a star?"
    text = prompt(test["astronomy"][0], dev["astronomy"])
    assert text == ("The following are multiple choice questions (with answers) about "
                    "astronomy.\n\nSun, a star?\nA. yes\nB. no\nC. maybe\nD. never\nAnswer: A"
                    "\n\nWhat orbits Earth?\nA. Moon\nB. Mars\nC. Sun\nD. Venus\nAnswer:")
    assert isinstance(test["astronomy"][0], Question) and test["astronomy"][0].answer == 0
    (tmp_path / "test" / "anatomy_test.csv").write_text("q,a,b,c,E\n")
    with pytest.raises(ValueError, match="anatomy_test.csv:1"):
        load_mmlu(tmp_path, "test", ["anatomy"])
    with pytest.raises(ValueError, match="unknown MMLU subjects"):
        load_mmlu(tmp_path, "test", ["astrology"])
    # STEM: astronomy 1/2, college_physics 1/1 -> micro 2/3, macro 0.75; other: anatomy 0/1.
    table = accuracy_table({"astronomy": [True, False], "college_physics": [True],
                            "anatomy": [False]})
    assert table["categories"]["STEM"]["micro"] == pytest.approx(2 / 3)
    assert table["categories"]["STEM"]["macro"] == pytest.approx(0.75)
    assert table["categories"]["other"]["micro"] == 0.0
    assert table["overall"]["micro"] == pytest.approx(0.5)
    assert table["overall"]["macro"] == pytest.approx((0.5 + 1 + 0) / 3)


def test_mmlu_choice_is_the_likeliest_letter(tiny_pipe):
    from replug_jax.eval.mmlu import LETTERS, Question, evaluate_mmlu, prompt

    _, _, pipe = tiny_pipe
    qs = [Question("astronomy", f"Which river number {i}?", ("a", "b", "c", "d"), i % 4)
          for i in range(3)]
    out = evaluate_mmlu(pipe, {"astronomy": qs}, {"astronomy": qs[:1]}, modes=("none",),
                        shots=1, progress=False)
    lp = pipe.lm.next_token_logprobs([prompt(q, qs[:1]) for q in qs])
    letter_ids = [pipe.lm.encode(" " + x)[0] for x in LETTERS]
    expect = [int(np.argmax(lp[i, letter_ids])) == q.answer for i, q in enumerate(qs)]
    assert out["none"]["overall"]["micro"] == pytest.approx(np.mean(expect))
    assert out["none"]["lm_calls"] == 3


class _FakePipe:
    """Scores every answer by its length and 'retrieves' passages 7 and 9, counting calls."""

    def __init__(self):
        self.calls = 0

    def score(self, prompts, continuations, queries, mode, reliance):
        import types

        self.calls += 1
        return [types.SimpleNamespace(loglik=-float(len(continuations[0])),
                                      cost={"lm_calls": 2, "input_tokens": 10},
                                      doc_ids=[7, 9], weights=[0.75, 0.25])]

    def generate(self, prompts, max_new_tokens, stop, queries, mode):
        import types

        self.calls += 1
        cost = {"lm_calls": 1, "input_tokens": 5}
        return [types.SimpleNamespace(text=" Paris\nmore", cost=cost)]


def test_qa_evaluator_rows_and_resume(tmp_path):
    from replug_jax.eval.qa import QAEvaluator

    ev = QAEvaluator(["q0?", "q1?", "q2?"], [["Paris"], ["Rome", "Roma"], ["x"]], [0, 1],
                     demonstrations=[("q2?", "x")], modes=("none", "replug"),
                     generate_modes=("replug",), gold_doc={0: 7, 1: 3},
                     partial=tmp_path / "partial.jsonl", progress=False)
    pipe = _FakePipe()
    rows = ev.run(pipe)
    assert rows["none"]["mean_answer_loglik"] == pytest.approx(-(6 + 5) / 2)  # " Paris", " Rome"
    assert rows["replug"]["exact_match"] == pytest.approx(0.5)  # "Paris" right, then wrong
    assert rows["replug"]["mean_gold_weight"] == pytest.approx((0.75 + 0.0) / 2)
    assert rows["replug"]["gold_recall_at_k"] == pytest.approx(0.5)
    assert rows["none"]["lm_calls"] == 4 and "exact_match" not in rows["none"]
    first_calls = pipe.calls
    again = _FakePipe()
    assert ev.run(again) == rows and again.calls == 0  # every record came from the file
    assert first_calls == 2 + 2 * 2


def test_retrieval_evaluator_recall_by_hand():
    from replug_jax.eval.gold_recall import RetrievalEvaluator
    from replug_jax.retrieval.corpus import Passage
    from replug_jax.retrieval import Index

    class Encoder:
        def encode_queries(self, texts):
            return np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], np.float32)[:len(texts)]

    import types

    emb = np.array([[1, 0], [0.9, 0.1], [0, 1], [0.1, 0.9]], np.float32)
    index = Index.build(emb, [Passage(i, f"p{i}") for i in range(4)])
    pipe = types.SimpleNamespace(retriever=Encoder(), index=index)
    # query 0 ranks 0, 1, 3, 2 (gold 1 second); query 1 ranks 2, 3, ... (gold 2 first);
    # query 2 scores 0.60, 0.62, 0.80, 0.78: ranks 2, 3, 1, 0 (gold 3 second)
    out = RetrievalEvaluator(["a", "b", "c"], [1, 2, 3], ks=(1, 2, 4)).run(pipe)
    assert out["recall@1"] == pytest.approx(1 / 3) and out["recall@2"] == 1.0
    assert out["recall@4"] == 1.0 and out["queries"] == 3


def test_qa_layouts_put_the_demonstrations_before_or_after_the_document():
    """document_first is the paper's d ∘ demonstrations ∘ question; demonstrations_first puts
    the shared demonstrations before every document."""
    from tests._models import tiny_lm, tiny_retriever
    from replug_jax.eval.qa import QAEvaluator
    from replug_jax.replug import Replug
    from replug_jax.retrieval.corpus import Passage
    from replug_jax.retrieval import index_in_memory

    lm, retriever = tiny_lm(0), tiny_retriever(0)
    passages = [Passage(i, t, "") for i, t in enumerate(["Paris is in France.", "Rome is old."])]
    pipe = Replug(lm, retriever, index_in_memory(passages, retriever), k=2)
    shots = [("Capital of Spain?", "Madrid")]
    seen = []
    original = lm.score_continuations
    lm.score_continuations = lambda p, c: seen.extend(p) or original(p, c)
    with pytest.raises(ValueError, match="layout must be one of"):
        QAEvaluator(["Capital of France?"], [["Paris"]], [0], layout="sideways")
    rows = {}
    for layout in ("document_first", "demonstrations_first"):
        seen.clear()
        ev = QAEvaluator(["Capital of France?"], [["Paris"]], [0], demonstrations=shots,
                         layout=layout, modes=("replug",), progress=False)
        rows[layout] = ev.run(pipe)["replug"]
        assert len(seen) == 2
        for prompt in seen:
            assert prompt.endswith("Question: Capital of France?\nAnswer:")
            demo_at = prompt.index("Question: Capital of Spain?")
            doc_at = min(prompt.find(p.text) for p in passages if p.text in prompt)
            assert (demo_at < doc_at) == (layout == "demonstrations_first")
    assert (rows["document_first"]["mean_answer_loglik"]
            != rows["demonstrations_first"]["mean_answer_loglik"])


@pytest.mark.parametrize("layout", ["document_first", "demonstrations_first"])
def test_questions_batched_per_call_equal_one_at_a_time(layout):
    """QAEvaluator(batch_size=3) scores and answers 5 questions in 2 calls each (3 + 2): the
    same log-likelihoods, answers and total cost as one question per call."""
    from tests._models import tiny_lm, tiny_retriever
    from replug_jax.eval.qa import QAEvaluator
    from replug_jax.replug import Replug
    from replug_jax.retrieval.corpus import Passage
    from replug_jax.retrieval import index_in_memory

    lm, retriever = tiny_lm(0), tiny_retriever(0)
    texts = ["Paris is in France.", "Rome is old.", "The Nile is long.", "Ice is cold."]
    passages = [Passage(i, t, "") for i, t in enumerate(texts)]
    pipe = Replug(lm, retriever, index_in_memory(passages, retriever), k=2)
    questions = ["Capital of France?", "Oldest city?", "Longest river?", "What is ice?",
                 "Where is Paris, the capital city of France?"]
    answers = [["Paris"], ["Rome"], ["the Nile"], ["cold water"], ["in France"]]
    out = {}
    for batch in (1, 3):
        ev = QAEvaluator(questions, answers, range(5), demonstrations=[("Capital of Spain?",
                         "Madrid")], layout=layout, modes=("none", "replug"),
                         generate_modes=("replug",), max_new_tokens=4, progress=False,
                         batch_size=batch)
        out[batch] = (ev.run(pipe), ev.records)
    (rows1, recs1), (rows3, recs3) = out[1], out[3]
    for row in ("none", "replug"):
        np.testing.assert_allclose([r["loglik"] for r in recs3[row]],
                                   [r["loglik"] for r in recs1[row]], rtol=1e-5)
        assert rows3[row]["input_tokens"] == rows1[row]["input_tokens"]
    assert [r["prediction"] for r in recs3["replug"]] == [r["prediction"]
                                                          for r in recs1["replug"]]
    assert rows3["replug"]["exact_match"] == rows1["replug"]["exact_match"]
