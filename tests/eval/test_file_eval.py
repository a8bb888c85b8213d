"""`replug eval` and `replug fit-tau` on a user's file (replug_jax/eval/datasets.py,
file_eval.py, file_report.py, retrieval/fitted_tau.py): rows equal the pipeline scored
directly, paired differences equal the records' means, a rerun resumes without the LM, τ is
the cached fit and is applied by Retriever.for_index for its query encoder only."""

import json
import math

import numpy as np
import pytest

from replug_jax.eval.datasets import read_eval_file
from replug_jax.eval.file_eval import (
    EvalSettings,
    branch_cache,
    evaluate_file,
    fit_temperature_on_file,
)
from replug_jax.eval.perplexity import WindowSettings, evaluate_lm
from replug_jax.eval.temperature import fit_temperature
from replug_jax.replug import Replug
from replug_jax.retrieval.corpus import Document, Passage
from replug_jax.retrieval import index_in_memory
from tests._models import save_tiny_bert, tiny_lm, tiny_retriever

pytestmark = pytest.mark.models

PASSAGES = [Passage(i, f"The {name} river flows through {town}.", name,
                   f"doc-{name}" if i != 1 else "2")  # ids of either type (issue 67)
            for i, (name, town) in enumerate([("Amber", "Lindholm"), ("Birch", "Oskar"),
                                               ("Cedar", "Tallin"), ("Dove", "Vemund"),
                                               ("Elm", "Rask"), ("Fern", "Ulla")])]
PASSAGE_OF = {"doc-Amber": [0], 2: 1, "doc-Dove": [3]}  # gold_doc -> its passage ids
QA = [{"id": "a", "question": "Where does the Amber river flow?", "answer": "Lindholm",
       "gold_doc": "doc-Amber", "group": "g1"},
      {"id": "b", "question": "Where does the Birch river flow?", "answers": ["Oskar", "oskar"],
       "gold_doc": 2, "group": "g1"},
      {"id": "c", "question": "Where does the Cedar river flow?", "answer": "Tallin",
       "group": "g2"},
      {"id": "d", "question": "Which river flows through Vemund?", "answer": "the Dove",
       "gold_doc": "doc-Dove", "group": "g3"}]


class _Data:  # what system_key reads of a file
    checksum = "c0ffee"


_DATA = _Data()


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pipe(seed=0, k=2):
    retriever = tiny_retriever(seed)
    return Replug(tiny_lm(0), retriever, index_in_memory(PASSAGES, retriever), k=k)


def test_a_file_is_read_with_its_kind_and_refused_in_one_line(tmp_path):
    data = read_eval_file(_write(tmp_path / "qa.jsonl", QA))
    assert data.kind == "qa" and len(data) == 4
    assert data.items[1].answers == ("Oskar", "oskar") and data.items[0].gold_doc == "doc-Amber"
    one = read_eval_file(_write(tmp_path / "p.jsonl", [QA[0] | {"gold_doc": None,
                                                                 "gold_passage": 4}]))
    assert one.items[0].gold_doc == (4,)  # passage ids, as a tuple
    assert data.groups == ["g1", "g1", "g2", "g3"]
    assert len(read_eval_file(tmp_path / "qa.jsonl", limit=2)) == 2
    text = read_eval_file(_write(tmp_path / "t.jsonl", [{"text": "one two"}, {"text": "x"}]))
    assert text.kind == "text" and text.groups is None and text.items[0].id == "1"
    (tmp_path / "doc.txt").write_text("A whole text.\n")
    assert read_eval_file(tmp_path / "doc.txt").items[0].text == "A whole text.\n"
    for rows, message in (
            ([{"question": "q?"}], "'answer' must be a string"),
            ([{"question": "q?", "answer": "a"}, {"text": "t"}], "needs a non-empty 'question'"),
            ([{"id": 1, "question": "q?", "answer": "a"}] * 2, "id '1' appears twice"),
            ([{"question": "q?", "answer": "a", "gold_doc": 1.5}], "'gold_doc' must be"),
            ([{"question": "q?", "answer": "a", "gold_passage": []}], "'gold_passage' must"),
            ([{"question": "q?", "answer": "a", "gold_passage": ["7"]}], "'gold_passage' must"),
            ([{"question": "q?", "answer": "a", "gold_doc": 7, "gold_passage": 7}],
             "not both"),
            ([{"prompt": "p"}], "needs 'question' and 'answer' \\(QA\\) or 'text'")):
        with pytest.raises(ValueError, match=message):
            read_eval_file(_write(tmp_path / "bad.jsonl", rows))


def test_a_gold_answer_is_scored_as_the_lm_writes_it_after_its_prompt():
    """After a chat template's assistant header the model writes the answer with no leading
    space (the template renders none); after the plain `Answer:` it writes " answer". The
    continuation eval scores must continue the prompt as the template renders the turn."""
    from replug_jax.prompts import answer_continuation, qa_branch_input, qa_prompt
    from tests._models import cached_tokenizer

    tok = cached_tokenizer("smollm2")
    question, answer = "Where does the Amber river flow?", "Lindholm"
    turn = tok.apply_chat_template([{"role": "user", "content": question},
                                    {"role": "assistant", "content": answer}], tokenize=False)
    for layout in ("inside", "before"):
        context, head = qa_branch_input(question, tok, layout)
        scored = (head or "") + context + answer_continuation(answer, f"chat_{layout}")
        assert turn.startswith(scored), (scored, turn)
        assert tok(turn)["input_ids"][:len(tok(scored)["input_ids"])] == tok(scored)["input_ids"]
    plain = qa_prompt(question, chat=False) + answer_continuation(f" {answer} ", "document_first")
    assert plain == f"Question: {question}\nAnswer: {answer}"


@pytest.mark.slow
def test_qa_rows_equal_direct_scoring_differences_are_paired_and_a_rerun_resumes(tmp_path):
    data = read_eval_file(_write(tmp_path / "qa.jsonl", QA))
    pipe = _pipe()
    settings = EvalSettings(modes=("none", "replug", "top1"), max_new_tokens=3, resamples=500)
    report = evaluate_file(data, {"base": pipe}, settings, tmp_path / "out", progress=False)
    # the LM alone, scored here directly on `replug ask`'s prompt (SmolLM2's tokenizer has a
    # chat template: the chat turn's head, then the question and the assistant's tail)
    from replug_jax.prompts import qa_branch_input

    direct = []
    for row in QA:
        context, head = qa_branch_input(row["question"], pipe.lm.tokenizer, "inside")
        answer = row.get("answer") or row["answers"][0]
        [s] = pipe.lm.score_continuations([head + context], [answer])  # as the LM writes it
        direct.append(s.total)
    rows = report["rows"]
    assert rows["none"]["mean_answer_loglik"] == pytest.approx(np.mean(direct), rel=1e-5)
    # gold recall: every question naming a gold passage found it among 6 with k = 2 or not;
    # the string id "doc-Amber" and the integer document id 2 (passage 1) both count
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").open()]
    replug = [r for r in records if r["mode"] == "replug"]
    assert sum("gold_hit" in r for r in replug) == 3
    # each record names its example, its gold answers, the passages and their weights λ
    first = next(r for r in replug if r["i"] == 0)
    assert (first["id"], first["question"], first["answers"]) == ("a", QA[0]["question"],
                                                                  ["Lindholm"])
    assert len(first["doc_ids"]) == 2 and sum(first["weights"]) == pytest.approx(1, abs=1e-5)
    assert "prediction" in first and "doc_ids" not in next(r for r in records
                                                          if r["mode"] == "none")
    assert rows["replug"]["gold_recall_at_k"] == pytest.approx(
        np.mean([r["gold_hit"] for r in replug if "gold_hit" in r]))
    # each comparison is the difference of the two rows' means, clustered by the 3 groups
    by = {(c["row"], c["metric"]): c for c in report["comparisons"]}
    d = by[("replug", "answer_loglik")]
    assert d["difference"] == pytest.approx(rows["replug"]["mean_answer_loglik"]
                                            - rows["none"]["mean_answer_loglik"], abs=1e-9)
    assert d["clusters"] == 3 and d["low"] <= d["difference"] <= d["high"]
    assert ("top1", "exact_match") in by and ("top1", "answer_contained") in by
    from replug_jax.eval.qa import contains_answer

    assert contains_answer("It flows through Lindholm, they say.", ["Lindholm"]) == 1.0
    assert contains_answer("It is 140 km away", ["14"]) == 0.0  # whole words only
    assert contains_answer("the", ["The"]) == 0.0  # an answer of articles only is empty
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} >= {"results.json", "summary.md", "records.jsonl",
                                                 "results.png"}
    assert "| replug | none | answer_loglik |" in (out / "summary.md").read_text()
    # FlashRAG's names beside ours: em is our EM; its dataset schema gives the same rows
    for row in rows.values():
        if "exact_match" in row:
            assert row["flashrag"]["em"] == row["exact_match"]
            assert row["flashrag"]["acc"] >= row["answer_contained"]
    assert "| row | em | f1 | acc |" in (tmp_path / "out" / "summary.md").read_text()
    theirs = [{"id": r["id"], "question": r["question"],
               "golden_answers": r["answers"] if "answers" in r else [r["answer"]],
               "metadata": {"gold_doc": r.get("gold_doc")}, "gold_doc": r.get("gold_doc"),
               "group": r["group"]} for r in QA]
    flashrag = evaluate_file(read_eval_file(_write(tmp_path / "flashrag.jsonl", theirs)),
                             {"base": pipe}, settings, tmp_path / "fr", progress=False)
    assert flashrag["rows"] == rows
    # a rerun with the same settings reads every record back: the LM is never called
    pipe.lm.score_continuations = pipe.lm.generate = None
    again = evaluate_file(data, {"base": pipe}, settings, out, progress=False)
    assert again["rows"] == report["rows"]


def test_retrieval_alone_measures_gold_recall_as_the_full_eval_does_with_no_lm_call(
        tmp_path, monkeypatch):
    """`replug eval --retrieval-only`: each retrieving mode's passages, weights and gold hits
    equal those of the full evaluation, two retrievers are compared on gold recall, and the LM
    is never called; mode none and a file naming no gold passage are refused in one line."""
    data = read_eval_file(_write(tmp_path / "qa.jsonl", QA))
    base, other = _pipe(0, k=2), _pipe(1, k=2)
    other.lm = base.lm
    full = evaluate_file(data, {"base": base}, EvalSettings(
        modes=("replug", "top1"), generate=False, resamples=200), tmp_path / "full",
        progress=False)
    for name in ("score_continuations", "score_token_ids", "next_token_logprobs_ids"):  # no LM
        monkeypatch.setattr(base.lm, name, None, raising=False)
    settings = EvalSettings(modes=("replug", "top1"), generate=False, likelihood=False,
                            resamples=200)
    alone = evaluate_file(data, {"base": base, "trained": other}, settings, tmp_path / "alone",
                          progress=False)

    def records(folder, label):
        return {(r["mode"], r["i"]): r for r in map(json.loads, (
            tmp_path / folder / "records.jsonl").open()) if r["label"].startswith(label)}

    got, want = records("alone", "replug:") | records("alone", "top1:"), records("full", "")
    assert set(got) == set(want) and len(got) == 2 * len(QA)
    for key, r in want.items():
        assert got[key]["doc_ids"] == r["doc_ids"]
        assert got[key]["weights"] == pytest.approx(r["weights"], abs=1e-6)
        assert got[key].get("gold_hit") == r.get("gold_hit")
        assert "loglik" not in got[key] and got[key]["cost"]["lm_calls"] == 0
    rows = alone["rows"]
    for mode in ("replug", "top1"):
        assert rows[mode]["gold_recall_at_k"] == full["rows"][mode]["gold_recall_at_k"]
        assert "mean_answer_loglik" not in rows[mode] and rows[mode]["lm_calls"] == 0
    assert len(records("full", "top1:")[("top1", 0)]["doc_ids"]) == 1  # recall@1
    metrics = {(c["row"], c["reference"], c["metric"]) for c in alone["comparisons"]}
    assert metrics == {("replug@trained", "replug", "gold_recall"),
                       ("top1@trained", "top1", "gold_recall")}
    assert "| top1@trained | top1 | gold_recall |" in (
        tmp_path / "alone" / "summary.md").read_text()
    with pytest.raises(ValueError, match="mode none retrieves nothing"):
        EvalSettings(modes=("none", "replug"), generate=False, likelihood=False)
    # the same golds named as passage ids of the store: the same hits, passage by passage
    by_passage = read_eval_file(_write(tmp_path / "psg.jsonl", [
        {k: v for k, v in r.items() if k != "gold_doc"}
        | ({"gold_passage": PASSAGE_OF[r["gold_doc"]]} if "gold_doc" in r else {})
        for r in QA]))
    again = evaluate_file(by_passage, {"base": base}, settings, tmp_path / "psg",
                          progress=False)
    assert again["rows"]["top1"]["gold_recall_at_k"] == rows["top1"]["gold_recall_at_k"]
    hits = {k: r.get("gold_hit") for k, r in records("psg", "").items()}
    assert hits == {k: r.get("gold_hit") for k, r in got.items()} and any(hits.values())
    unknown = read_eval_file(_write(tmp_path / "unknown.jsonl", [QA[0] | {
        "gold_doc": None, "gold_passage": [0, 99]}]))
    with pytest.raises(ValueError, match="gold_passage 99 is no passage id of the store"):
        evaluate_file(unknown, {"base": base}, settings, tmp_path / "u", progress=False)
    no_gold = read_eval_file(_write(tmp_path / "plain.jsonl", [
        {k: v for k, v in r.items() if k != "gold_doc"} for r in QA]))
    with pytest.raises(ValueError, match="no question names a gold passage"):
        evaluate_file(no_gold, {"base": base}, settings, tmp_path / "none", progress=False)


@pytest.mark.slow
def test_a_second_retriever_is_compared_mode_by_mode(tmp_path):
    data = read_eval_file(_write(tmp_path / "qa.jsonl", QA))
    base, other = _pipe(0, k=1), _pipe(1, k=1)
    other.lm = base.lm
    settings = EvalSettings(modes=("none", "replug"), generate=False, resamples=200)
    report = evaluate_file(data, {"base": base, "trained": other}, settings, tmp_path / "o",
                           progress=False)
    assert list(report["rows"]) == ["none", "replug", "replug@trained"]
    pairs = {(c["row"], c["reference"], c["metric"]) for c in report["comparisons"]}
    assert ("replug@trained", "replug", "answer_loglik") in pairs
    assert ("replug@trained", "replug", "gold_recall") in pairs
    assert report["systems"]["trained"]["retriever"]["fingerprint"] == "tiny-bert-1"


@pytest.mark.slow
def test_text_rows_equal_the_language_modelling_evaluator(tmp_path):
    texts = [{"id": "t1", "text": " ".join(f"word{i}" for i in range(60))},
             {"id": "t2", "text": "The Amber river flows through Lindholm. " * 6}]
    data = read_eval_file(_write(tmp_path / "t.jsonl", texts))
    pipe = _pipe()
    windows = WindowSettings(context_tokens=16, stride=16, query_tokens=16, skip_first=8,
                             leakage="none")
    settings = EvalSettings(modes=("none", "replug"), windows=windows, resamples=200)
    report = evaluate_file(data, {"base": pipe}, settings, tmp_path / "o", progress=False)
    reference = evaluate_lm(pipe, [Document(t["id"], t["text"]) for t in texts], windows,
                            progress=False)
    for mode in ("none", "replug"):
        assert report["rows"][mode]["bits_per_byte"] == pytest.approx(
            reference["modes"][mode]["bits_per_byte"], rel=1e-5)
    [c] = report["comparisons"]
    assert c["metric"] == "bits_per_byte" and c["clusters"] == 2
    assert c["difference"] == pytest.approx(report["rows"]["replug"]["bits_per_byte"]
                                            - report["rows"]["none"]["bits_per_byte"])


def test_the_records_key_names_every_setting_that_changes_a_number():
    """A rerun after changing --max-context, or an approximate index's nprobe or rerank,
    must not read the old records back; `top1` answers from one passage, so its k is 1."""
    from replug_jax.eval.file_eval import system_key

    retriever = tiny_retriever(0)
    index = index_in_memory(PASSAGES, retriever)

    def key(lm_context=256, **search):
        pipe = Replug(tiny_lm(0, max_context=lm_context), retriever, index, k=2, **search)
        return system_key(_DATA, pipe, EvalSettings(), "replug")

    assert key() == key()
    assert key() != key(lm_context=128)
    assert key() != key(nprobe=4) != key(rerank=8)
    pipe = Replug(tiny_lm(0), retriever, index, k=5)
    assert pipe.settings("top1", 5)["k"] == 1 and pipe.settings("replug", 5)["k"] == 5
    assert system_key(_DATA, pipe, EvalSettings(), "top1") == system_key(
        _DATA, Replug(tiny_lm(0), retriever, index, k=1), EvalSettings(), "top1")


def test_intervals_say_what_they_resample_and_one_group_is_not_called_groups(tmp_path):
    """One `group` for every question: the bootstrap cannot resample groups, so it
    resamples questions, and the comparison and the summary say so (not "over groups")."""
    from replug_jax.eval.file_eval import comparisons
    from replug_jax.eval.file_report import summary_markdown

    rng = np.random.default_rng(0)
    per_item = {mode: [{"loglik": float(x)} for x in rng.normal(size=6)]
                for mode in ("none", "replug")}
    settings = EvalSettings(resamples=200)
    for groups, unit, clusters in ((["g"] * 6, "questions", None),
                                   (["a", "a", "b", "b", "c", "c"], "groups", 3)):
        rows = [{"question": f"q{i}?", "answer": "a", "group": g} for i, g in enumerate(groups)]
        data = read_eval_file(_write(tmp_path / "qa.jsonl", rows))
        [c] = comparisons(data, per_item, ["base"], settings)
        assert c["resampled"] == unit and c.get("clusters") == clusters
        report = {"file": "qa.jsonl", "kind": "qa", "examples": 6,
                  "clusters": len(set(groups)), "settings": {"k": 2, "confidence": 0.95},
                  "systems": {}, "rows": {"none": {}, "replug": {}}, "comparisons": [c]}
        text = summary_markdown(report)
        assert f"| {clusters or 6} {unit} |" in text
        assert ("Every example is in one group" in text) == (clusters is None)


def test_a_report_without_matplotlib_says_the_plot_was_skipped(tmp_path, monkeypatch):
    from replug_jax.eval import file_report

    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    comparison = {"row": "replug", "reference": "none", "metric": "answer_loglik",
                  "difference": 0.1, "low": 0.0, "high": 0.2, "items": 2}
    report = {"file": "qa.jsonl", "kind": "qa", "examples": 2, "clusters": None,
              "settings": {"k": 2, "confidence": 0.95}, "systems": {},
              "rows": {"none": {}, "replug": {}}, "comparisons": [comparison]}
    file_report.write_report(report, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["files"]["plot"] is None and "matplotlib" in saved["files"]["plot_skipped"]
    assert "No results.png: matplotlib is not installed" in (tmp_path / "summary.md").read_text()
    assert not (tmp_path / "results.png").exists()


def test_flashrag_metrics_as_flashrag_defines_them():
    """FlashRAG's `acc` is a substring of the normalised prediction (inside words too), its
    `f1` scores a closed answer (yes / no / noanswer) only when both sides match; `em` is
    ours. Hand-computed cases."""
    from replug_jax.eval.qa import contains_answer, f1_score, flashrag_f1, substring_match

    assert substring_match("It is 140 km away.", ["14"]) == 1.0
    assert contains_answer("It is 140 km away.", ["14"]) == 0.0
    assert substring_match("The Eiffel Tower!", ["eiffel tower", "x"]) == 1.0
    assert substring_match("Paris", ["London"]) == 0.0
    assert f1_score("yes", ["yes it is"]) == pytest.approx(0.5)  # 2·1·(1/3)/(1+1/3)
    assert flashrag_f1("yes", ["yes it is"]) == 0.0
    assert flashrag_f1("yes", ["Yes."]) == 1.0
    assert flashrag_f1("the big red barn", ["red barn", "blue"]) == pytest.approx(0.8)
    assert flashrag_f1("", ["a"]) == 0.0


def test_flashrag_dataset_files_read_as_they_are_and_bad_bytes_are_named(tmp_path):
    """FlashRAG's jsonl ({id, question, golden_answers, metadata}) is a QA file without
    conversion, the same items as the project's schema; a file that is not UTF-8 is refused
    naming the file and line."""
    ours = [{"id": f"test_{i}", "question": r["question"],
             "answers": r.get("answers") or [r["answer"]]} for i, r in enumerate(QA)]
    theirs = [{"id": r["id"], "question": r["question"], "golden_answers": r["answers"],
               "metadata": {"source": "nq"}} for r in ours]
    a = read_eval_file(_write(tmp_path / "ours.jsonl", ours))
    b = read_eval_file(_write(tmp_path / "flashrag.jsonl", theirs))
    assert a.kind == b.kind == "qa" and a.items == b.items
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"question": "q?", "answer": "a"}\n{"question": "Caf\xe9?", '
                    b'"answer": "b"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8"):
        read_eval_file(bad)


def test_a_seeded_sample_spans_the_groups_of_an_article_ordered_file(tmp_path):
    rows = [{"id": f"{a}{i}", "question": f"q {a}{i}?", "answer": "x", "group": a}
            for a in "abcde" for i in range(8)]  # 40 questions, ordered by article
    path = _write(tmp_path / "qa.jsonl", rows)
    first = read_eval_file(path, limit=10)
    assert set(first.groups) == {"a", "b"}  # the first N: two articles
    drawn = read_eval_file(path, limit=10, sample_seed=3)
    assert len(drawn) == 10 and sorted(drawn.groups) == sorted("abcde" * 2)
    assert drawn.items == read_eval_file(path, limit=10, sample_seed=3).items  # seeded
    assert drawn.items != read_eval_file(path, limit=10, sample_seed=4).items
    ids = [it.id for it in drawn.items]
    assert ids == sorted(ids, key=[r["id"] for r in rows].index)  # file order kept


def test_tau_records_of_two_query_encoders_sharing_an_index_are_both_kept(tmp_path):
    """A query-tower-only retriever shares its base's index: fitting its τ must not delete
    the base's (which would then run at τ = 1 in `eval --compare-retriever`); an index's
    record in the single-record format of earlier versions still reads."""
    from replug_jax.retrieval import fitted_tau

    base = {"source": "minilm", "fingerprint": "base"}
    trained = {**base, "query_source": "trained", "query_fingerprint": "trained-q"}
    fitted_tau.write(tmp_path, 0.021, base, {"data": "dev.jsonl", "lm": "lm"})
    fitted_tau.write(tmp_path, 0.034, trained, {"data": "dev.jsonl", "lm": "lm"})
    assert fitted_tau.read(tmp_path, base)[0] == 0.021
    assert fitted_tau.read(tmp_path, trained)[0] == 0.034
    fitted_tau.write(tmp_path, 0.025, base, {"data": "dev2.jsonl", "lm": "lm"})  # a refit
    assert fitted_tau.read(tmp_path, base) == (
        0.025, "fitted on dev2.jsonl with lm (stored with the index, retrieval_temperature.json)")
    assert fitted_tau.read(tmp_path, trained)[0] == 0.034
    old = {"temperature": 0.05, "query_encoder": {"source": "minilm", "fingerprint": "base"},
           "fit": {"data": "d", "lm": "l"}}
    (tmp_path / fitted_tau.FILE).write_text(json.dumps(old))
    assert fitted_tau.read(tmp_path, base)[0] == 0.05
    with pytest.warns(UserWarning, match="τ = 0.05 for minilm"):
        assert fitted_tau.read(tmp_path, trained) is None
    fitted_tau.write(tmp_path, 0.034, trained, {})
    assert fitted_tau.read(tmp_path, base)[0] == 0.05  # the old record survives a new fit


@pytest.mark.slow
def test_fit_tau_is_the_cache_fit_and_for_index_applies_it_to_its_encoder_only(tmp_path):
    from replug_jax.retrieval import fitted_tau
    from replug_jax.retrieval.build import build_index
    from replug_jax.retrieval.encoder import Retriever

    data = read_eval_file(_write(tmp_path / "dev.jsonl", QA))
    pipe = _pipe(k=3)
    settings = EvalSettings()
    fit = fit_temperature_on_file(data, pipe, settings, progress=False)
    expected = fit_temperature(branch_cache(data, pipe, settings, progress=False))
    assert fit["temperature"] == pytest.approx(expected["temperature"], rel=1e-6)
    assert fit["loglik_per_example_at_fit"] >= fit["loglik_per_example_at_1"] - 1e-9
    assert fit["scored"] == 4 and "cross_fitted_loglik_per_example" in fit
    g = fit["gain_over_tau_1"]  # paired: the mean gain is the difference of the means
    assert g["difference"] == pytest.approx(fit["cross_fitted_loglik_per_example"]
                                            - fit["loglik_per_example_at_1"], abs=1e-6)
    assert g["low"] <= g["difference"] <= g["high"] and g["resampled"] == "groups"
    assert len(fit["cross_fitted_at_bound"]) == 2
    # stored beside an index on disk, used by for_index for the same query encoder
    folder = save_tiny_bert(tmp_path / "bert", seed=0)
    retriever = Retriever.load(str(folder))
    build_index(PASSAGES, retriever, tmp_path / "idx", progress=False)
    fitted_tau.write(tmp_path / "idx", 0.037, retriever.identity, {"data": "dev.jsonl",
                                                                    "lm": "tiny"})
    loaded, index = Retriever.for_index(tmp_path / "idx")
    assert loaded.retrieval_temperature == 0.037
    p = Replug(tiny_lm(0), loaded, index, k=2)
    s = p.settings("replug", 2)
    assert s["retrieval_temperature"] == 0.037
    assert "fitted on dev.jsonl with tiny" in s["retrieval_temperature_source"]
    assert Replug(tiny_lm(0), loaded, index, retrieval_temperature=0.5).settings(
        "replug", 2)["retrieval_temperature_source"] == "argument"
    # a query tower of its own (a retriever trained by LSR on its query side) is another
    # query encoder: the stored τ is not applied to it
    trained_query = {**retriever.identity, "query_source": "trained",
                     "query_fingerprint": "f00"}
    with pytest.warns(UserWarning, match="no τ fitted for this query encoder"):
        assert fitted_tau.read(tmp_path / "idx", trained_query) is None
    (tmp_path / "idx" / fitted_tau.FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a readable τ record"):
        Retriever.for_index(tmp_path / "idx")
    assert not math.isnan(fit["temperature"])
