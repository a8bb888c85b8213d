"""Every experiment script end to end on its ``tiny`` config, with the packaged models.

The evaluation data of ``../shared/data`` is not part of the project, so the scripts read a small
folder in the same layout written here (our own sentences, questions and articles). Results go
to a temporary folder; the test checks the files and that the numbers are well-formed."""

import dataclasses
import gzip
import json
import pathlib

import numpy as np
import pytest

from tests._models import packaged_or_skip

pytestmark = pytest.mark.models

FACTS = [
    ("Quenwick", "The Zorblat river flows through the small town of Quenwick in the north.",
     "Which town does the Zorblat river flow through?"),
    ("Ardel Pim", "The lighthouse of Vorn was designed by the engineer Ardel Pim in 1851.",
     "Who designed the lighthouse of Vorn?"),
    ("copper", "The bells of Tessamor are cast from copper mined in the eastern hills.",
     "What are the bells of Tessamor cast from?"),
    ("1902", "The Halvard bridge opened to traffic in 1902 after six years of work.",
     "When did the Halvard bridge open?"),
    ("Mirela Dusk", "The novel Glass Harbour was written by Mirela Dusk.",
     "Who wrote the novel Glass Harbour?"),
    ("seven", "The island of Ostry has seven villages and one harbour.",
     "How many villages does the island of Ostry have?"),
    ("Lake Senn", "The Orvel trout lives only in Lake Senn.",
     "Where does the Orvel trout live?"),
    ("blue", "The flag of Calder Province is blue with a white star.",
     "What colour is the flag of Calder Province?"),
    ("Tobin Vale", "The first mayor of Brightwater was Tobin Vale.",
     "Who was the first mayor of Brightwater?"),
    ("salt", "Merrow Bay was famous for its salt works in the eighteenth century.",
     "What was Merrow Bay famous for?"),
    ("Pellis", "The capital of the fictional kingdom of Aranor is Pellis.",
     "What is the capital of Aranor?"),
    ("wool", "The main export of the Dunmore valley is wool.",
     "What is the main export of the Dunmore valley?"),
]

ARTICLE = ("{name} is a river in the north of the country . It rises in the hills above the "
           "town of {town} and flows for about forty miles to the sea . The river was used for "
           "trade in the middle ages , and mills were built along its banks to grind corn and "
           "to full cloth . In the nineteenth century a canal joined it to the larger river to "
           "the south , and barges carried coal and stone from the quarries . Today the valley "
           "is known for its walking paths , its old stone bridges and the birds that nest in "
           "the reeds near the mouth of the river . The town of {town} holds a fair each summer "
           "on the green beside the water , and boats may be hired there . ")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    packaged_or_skip("minilm")
    packaged_or_skip("smollm2")
    root = tmp_path_factory.mktemp("shared_data")
    nq = root / "nq_gold_passages"
    nq.mkdir()
    with open(nq / "nq_openbook.jsonl", "w") as fo, open(nq / "nq_closedbook.jsonl", "w") as fc:
        for answer, passage, question in FACTS:
            row = {"answer": answer, "aliases": [answer]}
            fo.write(json.dumps({**row, "query": f"Context: {passage}\n\nQuestion: {question}"
                                                 "\nAnswer:"}) + "\n")
            fc.write(json.dumps({**row, "query": f"Question: {question}\nAnswer:"}) + "\n")
    (root / "nq_open").mkdir()
    (root / "nq_open" / "NQ-open.dev.jsonl").write_text("".join(
        json.dumps({"question": q[:-1].lower(), "answer": [a]}) + "\n" for a, _, q in FACTS))
    wiki = root / "wikitext2"
    wiki.mkdir()
    articles = [(name, ARTICLE.format(name=name, town=town))
                for name, town in (("Alder River", "Quenwick"), ("Bram Water", "Ostry"),
                                   ("Carrow Beck", "Vorn"))]
    # wiki.test.raw as shipped: non-empty rows only; wiki.test.tokens: blank lines kept
    (wiki / "wiki.test.raw").write_text("".join(f" = {n} = \n {a}\n" for n, a in articles))
    (root / "wikitext103").mkdir()
    (root / "wikitext103" / "wiki.test.tokens").write_text(
        "".join(f" \n = {n} = \n \n {a}\n" for n, a in articles))
    # a raw-text Wikipedia sample: the FACTS as articles, and one that copies a sentence of
    # an evaluated article (a leak the n-gram check must find)
    (root / "enwiki2015").mkdir()
    rows = [{"id": str(i), "title": f"Article {i}", "url": "", "text": f"{p} " * 12}
            for i, (_, p, _) in enumerate(FACTS)]
    rows.append({"id": "99", "title": "Alder River (copy)", "url": "",
                 "text": ARTICLE.format(name="Alder River", town="Quenwick")[:400]})
    with gzip.open(root / "enwiki2015" / "enwiki_2015_sample10k.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    # SQuAD layout: three train articles and one dev article of three one-question paragraphs
    (root / "squad_v1.1").mkdir()
    for name, chunk in (("train-v1.1.json", FACTS[:9]), ("dev-v1.1.half_a.json", FACTS[9:])):
        arts = [{"title": f"{name[:3]}_{a}", "paragraphs": [
            {"context": passage, "qas": [{"id": f"{name[:3]}_{a}/{j}/0", "question": question,
                                          "answers": [{"text": answer,
                                                       "answer_start": passage.find(answer)}]}]}
            for j, (answer, passage, question) in enumerate(chunk[3 * a:3 * a + 3])]}
            for a in range(len(chunk) // 3)]
        (root / "squad_v1.1" / name).write_text(json.dumps({"data": arts}))
    for split in ("dev", "test"):
        (root / "mmlu" / split).mkdir(parents=True)
    (root / "mmlu" / "dev" / "astronomy_dev.csv").write_text(
        "What is the closest star to Earth?,The Sun,Sirius,Vega,Polaris,A\n")
    (root / "mmlu" / "test" / "astronomy_test.csv").write_text(
        "Which planet is known as the red planet?,Venus,Mars,Jupiter,Saturn,B\n"
        '"Which body orbits the Earth, once a month?",Mars,The Sun,The Moon,Io,C\n')
    return root


@pytest.fixture()
def data(shared, monkeypatch):
    import experiments.lib.common as common

    monkeypatch.setattr(common, "SHARED_DATA", shared)
    return shared


def _result(out: pathlib.Path, name: str) -> dict:
    folder = out / name
    for suffix in (".json", ".md", ".png"):
        assert (folder / f"tiny{suffix}").stat().st_size > 0
    readme = (folder / "README.md").read_text()
    assert "command" in readme and "differs from the paper" in readme
    return json.loads((folder / "tiny.json").read_text())


def test_table3_qa_tiny(data, tmp_path):
    from experiments import table3_qa

    table3_qa.main(["--config", "tiny", "--out", str(tmp_path), "--no-progress"])
    res = _result(tmp_path, "table3_qa")["results"]
    assert set(res) == {"none", "replug", "random"}
    # Invented facts: only the retrieved passage can teach them.
    assert res["replug"]["mean_answer_loglik"] > res["none"]["mean_answer_loglik"]
    assert 0 <= res["replug"]["exact_match"] <= 1 and res["replug"]["gold_recall_at_k"] > 0.5
    # NQ-open questions against the offline Wikipedia text (here: the passages + articles).
    table3_qa.main(["--config", "tiny", "--out", str(tmp_path / "open"), "--no-progress",
                    "--set", "dataset=nq_open", "corpus=both", "num_questions=3",
                    'modes=["none", "replug"]', "generate_modes=[]"])
    res = json.loads((tmp_path / "open" / "table3_qa" / "tiny.json").read_text())
    assert res["questions"] == 3 and res["corpus_passages"] > len(FACTS)
    assert "mean_gold_weight" not in res["results"]["replug"]


def test_table3_qa_compares_layouts_on_the_same_questions(data, tmp_path):
    """compare_layout: the demonstrations-first rows beside the paper's, paired per question.
    With no document both layouts are the same prompt: the differences are exactly zero;
    with documents they are measured (and the per-question values are saved)."""
    from experiments import table3_qa

    table3_qa.main(["--config", "tiny", "--out", str(tmp_path), "--no-progress", "--set",
                    "num_questions=4", 'modes=["none", "replug"]', 'generate_modes=["none"]',
                    "compare_layout=demonstrations_first", "max_new_tokens=4"])
    res = _result(tmp_path, "table3_qa")
    assert set(res["results"]) == {"none", "replug", "none (demonstrations_first)",
                                   "replug (demonstrations_first)"}
    none = res["layout_differences"]["none"]
    assert set(none) == {"mean_answer_loglik", "exact_match", "f1"}
    for d in none.values():
        assert d["difference"] == d["low"] == d["high"] == 0.0 and d["items"] == 4
    replug = res["layout_differences"]["replug"]["mean_answer_loglik"]
    per_q = res["per_question"]
    assert replug["difference"] == pytest.approx(
        np.mean(per_q["replug (demonstrations_first)"]["loglik"])
        - np.mean(per_q["replug"]["loglik"]), abs=1e-9)
    assert replug["difference"] != 0.0  # the document moved: another prompt


def test_table3_qa_corpus_file_and_lsr_intervals(data, tmp_path):
    """A JSONL corpus whose gold passages sit after distractors and out of order (found by
    id), demonstrations from a file, and the LSR row with paired intervals: the same retriever
    twice gives differences of exactly zero."""
    from experiments import table3_qa

    corpus = [{"id": f"d{j}", "text": ARTICLE.format(name=f"River {j}", town=f"Town {j}")}
              for j in range(3)]
    corpus += [{"id": str(i), "text": FACTS[i][1]} for i in reversed(range(len(FACTS)))]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus))
    (tmp_path / "dev.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "question": FACTS[i][2], "answer": FACTS[i][0],
                    "gold_doc": i}) + "\n" for i in (2, 5, 7)))
    (tmp_path / "demos.jsonl").write_text(json.dumps(
        {"question": "What colour is the sky on a clear day?", "answer": "blue"}) + "\n")
    table3_qa.main(["--config", "tiny", "--out", str(tmp_path / "out"), "--no-progress",
                    "--set", f"corpus_file={tmp_path / 'corpus.jsonl'}",
                    f"question_file={tmp_path / 'dev.jsonl'}",
                    f"demonstrations_file={tmp_path / 'demos.jsonl'}", "shots=1",
                    "lsr_retriever=minilm", 'modes=["replug"]', 'generate_modes=["replug"]',
                    "max_new_tokens=4"])
    res = json.loads((tmp_path / "out" / "table3_qa" / "tiny.json").read_text())
    assert res["questions"] == 3 and res["corpus_passages"] == len(corpus)
    rows = res["results"]
    assert rows["replug"]["gold_recall_at_k"] == 1.0  # each gold passage found by its id
    assert rows["replug_lsr"] == rows["replug"]
    diffs = res["lsr_minus_replug"]
    assert set(diffs) == {"mean_answer_loglik", "exact_match", "f1", "gold_recall_at_k"}
    for d in diffs.values():
        assert d["difference"] == d["low"] == d["high"] == 0.0 and d["items"] == 3
    assert len(res["predictions"]["replug"]) == 3


def test_table1_and_figure4_tiny(data, tmp_path):
    from experiments import figure4_num_docs, table1_lm

    table1_lm.main(["--config", "tiny", "--out", str(tmp_path), "--no-progress"])
    res = _result(tmp_path, "table1_lm")
    assert res["windows"] == 2 and res["mean_excluded_passages"] >= 1
    for mode in ("none", "replug", "random", "concat"):
        r = res["results"][mode]
        assert np.isfinite(r["bits_per_byte"]) and r["bits_per_byte"] > 0
        assert r["num_bytes"] == res["results"]["none"]["num_bytes"]
    figure4_num_docs.main(["--config", "tiny", "--out", str(tmp_path), "--no-progress"])
    fig = _result(tmp_path, "figure4_num_docs")
    assert set(fig["perplexity"]["replug"]) == {"1", "2"}
    assert all(np.isfinite(v) for v in fig["perplexity"]["random"].values())


def _stored(cache):
    """The LM-score store's files and their times (a new pair scored writes a new part)."""
    return {p: p.stat().st_mtime_ns for p in (cache / "lm_scores").rglob("*") if p.is_file()}


def test_table1_and_figure4_real_datastore_tiny(data, tmp_path):
    """The real-datastore setting end to end on a few enwiki articles: every row, per-window
    values with article ids, the leakage rate, the format control; Figure 4 from the same
    stored pairs (no LM call the second time)."""
    from experiments import figure4_num_docs, table1_lm
    from experiments.lib import lm_datastore

    common = ["--config", "tiny_enwiki", "--out", str(tmp_path), "--no-progress",
              "--set", f"cache={tmp_path / 'cache'}"]
    # the LM alone and the control scored first (before any enwiki index): reused after
    lm_datastore.main(common + ["--sources", "none", "control_random"])
    early = _stored(tmp_path / "cache")
    assert early
    table1_lm.main(common)
    stored = _stored(tmp_path / "cache")
    assert stored.items() >= early.items() and len(stored) > len(early)
    res = json.loads((tmp_path / "table1_lm" / "tiny_enwiki.json").read_text())
    assert res["windows"] == 4 and len(set(res["per_window"]["article"])) == 2
    rows = res["per_window"]["loglik"]
    assert len(rows) == 10 and all(len(v) == 4 for v in rows.values())
    levels = res["bits_per_byte"]
    assert all(d["low"] <= d["difference"] <= d["high"] for d in levels.values())
    assert res["datastore_passages"] >= 13  # the twelve FACT articles and the copy
    assert 0 < res["leakage"]["windows_with_a_leaking_passage"] <= 1  # the copy leaks
    assert "format (k=1): random WikiText − random datastore passages" in res[
        "paired_differences"]
    # Figure 4 and a second scoring of the early sources: every pair from the store
    figure4_num_docs.main(common)
    lm_datastore.main(common + ["--sources", "none", "control_random"])
    assert _stored(tmp_path / "cache") == stored
    fig = json.loads((tmp_path / "figure4_num_docs" / "tiny_enwiki.json").read_text())
    k2 = fig["bits_per_byte"]["retrieved, τ=1"]["2"]["difference"]
    assert k2 == pytest.approx(levels["REPLUG (k=2, τ=1)"]["difference"], abs=1e-9)


def test_sample_questions_spread_over_articles_and_grouped_by_article():
    """Every article counts (rounds over the articles) and the sample comes grouped by
    article, so a pool's parts hold few articles (document KV reuse within a part)."""
    from experiments.lib.squad import Question, sample_questions

    qs = [Question(f"{a}{i}", f"q {a}{i}", ("x",), a, 0) for a in "cab" for i in range(5)]
    got = sample_questions(qs, 7, seed=0)
    titles = [q.article for q in got]
    assert sorted(titles.count(a) for a in "abc") == [2, 2, 3]
    assert titles == sorted(titles, key="cab".index)  # grouped, articles in their order
    assert sample_questions(qs, 7, seed=0) == got and len(set(q.id for q in got)) == 7


def test_lsr_qa_tiny(data, tmp_path):
    """The cross-fitted SQuAD study end to end on a few questions: pools, oracle, variants,
    τ fitted on dev, end-to-end test retrieval from the merged datastore, recall, EM/F1,
    intervals over articles, per-question values; a rerun resumes from what is stored."""
    from experiments import lsr_qa

    argv = ["--config", "tiny", "--out", str(tmp_path / "out"), "--no-progress",
            "--set", f"workdir={tmp_path / 'work'}"]
    lsr_qa.main(argv)
    res = json.loads((tmp_path / "out" / "lsr_qa" / "tiny.json").read_text())
    assert res["questions"] == {"train": 6, "dev": 3, "test": 3}
    assert res["articles"]["test"] == 1 and res["datastore_passages"] > 12
    systems = res["systems"]
    assert set(systems) == {"base retriever", "kl_retriever_to_lm/γ=0.1/β=0.1",
                            "marginal/γ=0.1", "kl_retriever_to_lm/γ=0.1/β=0.1/shuffled-Q control"}
    base = systems["base retriever"]
    assert base["tau"] in (0.1, 1.0) and base["test_loglik"] < 0
    assert 0 <= base["recall@1"] <= base["recall@2"] <= 1
    per = res["per_example"]["test"]
    assert len(per["loglik"]["base retriever"]) == 3 and len(per["lm_alone"]) == 3
    assert np.mean(per["loglik"]["base retriever"]) == pytest.approx(base["test_loglik"])
    assert res["chosen"] in systems and "shuffled" not in res["chosen"]
    assert "low" in res["primary"] and res["release_rule"].startswith(("passes", "fails"))
    assert len(res["qa"]["base retriever"]["em"]) == 2
    readme = (tmp_path / "out" / "lsr_qa" / "README.md").read_text()
    assert "Primary endpoint (pre-registered)" in readme
    lsr_qa.main(argv)  # resumed: pools, runs and the extra pairs are read back
    again = json.loads((tmp_path / "out" / "lsr_qa" / "tiny.json").read_text())
    assert again["per_example"] == res["per_example"]


def test_lsr_qa_pools_resume_on_a_new_machine_from_the_carried_folder(data, tmp_path,
                                                                     monkeypatch):
    """What a study carries (``--carry``: the LM's pair scores keyed by their text, the base
    retrievals) is enough to score its pools in a fresh work folder: no datastore encoded, no
    LM call, the same pools."""
    from experiments import lsr_qa
    from experiments.lib import common, lm_datastore
    from replug_jax.train.pool import ScoredPool

    carry = tmp_path / "carry"
    common_args = ["--config", "tiny", "--stage", "pools", "--no-progress", "--carry", str(carry)]
    lsr_qa.main([*common_args, "--set", f"workdir={tmp_path / 'a'}"])
    assert list((carry / "lm_scores").glob("part-*.npz"))
    assert sorted(p.name for p in (carry / "retrievals").iterdir()) == [
        "base_dev.npz", "base_test.npz", "base_train.npz"]
    lm = common.load_lm("smollm2", 512)  # the cached LM the study loads
    monkeypatch.setattr(lm, "score_continuations", lambda *a: pytest.fail("an LM call"))
    monkeypatch.setattr(lm_datastore, "build_index", lambda *a, **k: pytest.fail("encoded"))
    monkeypatch.setattr(lm_datastore.Index, "load", lambda *a, **k: pytest.fail("loaded"))
    lsr_qa.main([*common_args, "--set", f"workdir={tmp_path / 'b'}"])
    for split in ("train", "dev", "test"):
        a = ScoredPool.load(tmp_path / "a" / "tiny" / f"pool_{split}")
        b = ScoredPool.load(tmp_path / "b" / "tiny" / f"pool_{split}")
        np.testing.assert_array_equal(a.doc_ids_EM, b.doc_ids_EM)
        np.testing.assert_array_equal(a.branches.logprobs_NKT, b.branches.logprobs_NKT)


def test_lsr_qa_confirmatory_test_on_fresh_articles_reuses_the_trained_study(data, tmp_path):
    """The confirmatory design: a config sharing another run's work folder reads back its
    train and dev pools and trained variant (nothing rescored or retrained) and tests on
    questions of train articles that neither split holds, from a test pool of the base's
    top-k (no test oracle then)."""
    from experiments import lsr_qa
    from experiments.configs.lsr_qa import CONFIGS
    from experiments.lib.lsr_qa_data import open_study
    from replug_jax.retrieval.encoder import Retriever

    work, out = tmp_path / "work", tmp_path / "out"
    common = ["--out", str(out), "--no-progress", "--set", f"workdir={work}"]
    lsr_qa.main(["--config", "tiny", *common, "train_articles=1"])
    kept = {p: p.stat().st_mtime_ns for p in (work / "tiny").rglob("*")  # scores, weights
            if p.parent.name in ("pool_train", "pool_dev", "runs") and p.suffix == ".npz"
            and p.name != "branches.npz"}
    assert any(p.suffix == ".npz" and p.parent.name == "runs" for p in kept)
    lsr_qa.main(["--config", "tiny_confirm", *common])
    assert [p.name for p, t in kept.items() if p.stat().st_mtime_ns != t] == []
    res = json.loads((out / "lsr_qa" / "tiny_confirm.json").read_text())
    assert res["chosen"] == "kl_retriever_to_lm/γ=0.1/β=0.1" and res["questions"]["test"] == 3
    assert res["oracle_vs_base"]["test"] is None and res["qa"] == {}
    cfg = dataclasses.replace(CONFIGS["tiny_confirm"], workdir=str(work))
    study = open_study(cfg, Retriever.load("minilm"), None, work / "tiny", False)
    arts = {s: {q.article for q in study.questions(0, s)} for s in ("train", "dev", "test")}
    assert arts["test"] and not arts["test"] & (arts["train"] | arts["dev"])
    assert set(study.pool_sets) == {"train", "dev", "fresh_test"}
    assert np.load(work / "tiny" / "pool_fresh_test" / "candidates.npy").shape == (3, 2)


def test_lsr_qa_recall_design_selects_at_the_fitted_tau_on_dev_recall(data, tmp_path):
    """confirm_recall's design on a few questions: the dev curve at the τ fitted at each
    evaluation, the step chosen by dev recall@1 over the whole datastore (guarded by the dev
    pool's log-likelihood), the control trained for its fixed budget, recall@1 on every test
    question while only a subset gets an LM pool, the log-likelihood gating the release."""
    from experiments import lsr_qa

    out = tmp_path / "out"
    lsr_qa.main(["--config", "tiny_recall", "--out", str(out), "--no-progress", "--set",
                 f"workdir={tmp_path / 'work'}"])
    res = json.loads((out / "lsr_qa" / "tiny_recall.json").read_text())
    assert res["questions"]["test"] == 2  # the LM endpoint's subset
    wide = res["recall_test"]
    assert wide["questions"] == 3 and res["primary"] == wide["vs_base"][res["chosen"]]["1"]
    assert "recall@1" in res["primary_endpoint"]
    runs = res["runs"]
    chosen, control = runs[res["chosen"]], runs[res["chosen"] + "/shuffled-Q control"]
    for c in chosen["curve"]:
        assert c["tau"] in (0.1, 1.0) and "dev_recall@1" in c and "dev_loglik" in c
    base = chosen["curve"][0]
    best = next(c for c in chosen["curve"] if c["step"] == chosen["best_step"])
    assert best["dev_loglik"] >= base["dev_loglik"]  # the guard
    eligible = [c for c in chosen["curve"] if c["dev_loglik"] >= base["dev_loglik"]]
    assert best["dev_recall@1"] == max(c["dev_recall@1"] for c in eligible)
    assert control["steps_run"] == 2 and control["best_step"] == 2  # fixed budget, no stop
    assert res["release_rule"].startswith(("passes", "fails")) and "−0.1 nats" in \
        res["release_rule"]
    nq = res["transfer_nq"]  # reported, not gated: the NQ questions with gold passages
    assert nq["questions"] > 0 and 0 <= nq["recall@1"]["chosen"] <= 1
    assert "low" in nq["recall@1_chosen_vs_base"]
    md = (out / "lsr_qa" / "tiny_recall.md").read_text()
    # the table's recall columns are on the LM-pool subset, the primary on every question
    assert "recall@1 (2 LM-pool questions)" in md and "on 3 questions of" in md
    assert (out / "lsr_qa" / "tiny_recall.png").stat().st_size > 0
    # the results file keeps the study's config as a tree that reads back, training config
    # and all; and its report is rewritten from the JSON alone
    from experiments.configs.lsr_qa import CONFIGS, QAStudyConfig
    from experiments.lib import lsr_qa_report
    from replug_jax import config

    assert config.from_record(QAStudyConfig, res["config"]).train == \
        CONFIGS["tiny_recall"].train
    lsr_qa_report.main(["--config", "tiny_recall", "--out", str(out)])
    assert (out / "lsr_qa" / "tiny_recall.md").read_text() == md


def test_lsr_qa_nq_folds_test_every_question_once_by_retrievers_never_trained_on_it(
        data, tmp_path):
    """NQ cross-fitted in 2 folds by question: in each fold train, dev and test are disjoint;
    every question is tested exactly once; the results hold all of them, per fold."""
    from experiments import lsr_qa
    from experiments.configs.lsr_qa import CONFIGS
    from experiments.lib.lsr_qa_data import open_study
    from replug_jax.retrieval.encoder import Retriever

    cfg = dataclasses.replace(CONFIGS["tiny_nq"], workdir=str(tmp_path / "work"))
    study = open_study(cfg, Retriever.load("minilm"), None, tmp_path / "work" / "x", False)
    tested = []
    for f in range(2):
        ids = {s: {q.id for q in study.questions(f, s)} for s in ("train", "dev", "test")}
        assert not (ids["train"] & ids["test"] or ids["dev"] & ids["test"]
                    or ids["train"] & ids["dev"])
        assert len(ids["dev"]) == 2 and ids["train"]
        tested += sorted(ids["test"])
    assert len(tested) == len(set(tested)) == 8
    lsr_qa.main(["--config", "tiny_nq", "--out", str(tmp_path / "out"), "--no-progress",
                 "--set", f"workdir={tmp_path / 'work'}"])
    res = json.loads((tmp_path / "out" / "lsr_qa" / "tiny_nq.json").read_text())
    assert res["folds"] == 2 and res["questions_per_fold"]["test"] == [4, 4]
    assert sorted(res["per_example"]["test"]["ids"]) == sorted(tested)
    assert len(res["chosen_per_fold"]) == 2 and "released" not in res
    base = res["systems"]["base retriever"]
    assert len(base["tau_per_fold"]) == 2 and "tau" not in base
    assert np.mean(res["per_example"]["test"]["loglik"]["base retriever"]) == pytest.approx(
        base["test_loglik"])
    assert len(res["qa"]["base retriever"]["em"]) == 2  # one per fold
    for f in range(2):  # each fold keeps its runs and generated answers in its own folder
        fold = tmp_path / "work" / "tiny_nq" / f"fold{f}"
        assert list((fold / "runs").glob("*.npz")) and list(fold.glob("answers_*.json"))


def test_table2_mmlu_tiny(data, tmp_path):
    from experiments import table2_mmlu

    table2_mmlu.main(["--config", "tiny", "--out", str(tmp_path), "--no-progress"])
    res = _result(tmp_path, "table2_mmlu")["results"]
    for mode in ("none", "replug"):
        assert res[mode]["overall"]["questions"] == 2
        assert res[mode]["categories"]["STEM"]["micro"] in (0.0, 0.5, 1.0)


def test_temperature_sweep_tiny(data, tmp_path):
    from experiments import temperature_sweep
    from experiments.prepare import nq as prepare_nq

    prepare_nq.main(["--out", str(tmp_path / "nq")])
    temperature_sweep.main(["--config", "tiny", "--out", str(tmp_path), "--no-progress",
                            "--set", f"workdir={tmp_path / 'runs'}",
                            f"data_dir={tmp_path / 'nq'}", "train_examples=8",
                            "dev_examples=2"])
    runs = _result(tmp_path, "temperature_sweep")["runs"]
    assert [(r["gamma"], r["beta"]) for r in runs] == [(0.1, 0.1), (1.0, 0.1)]
    assert all(np.isfinite(r["loss_last"]) for r in runs)
    # The second run reuses the first run's LM scores through the one store both read and
    # write (supervision.lm_scores), none of their own: the LM is frozen.
    assert runs[1]["lm_cache_misses"] < runs[0]["lm_cache_misses"]
    assert list((tmp_path / "runs" / "tiny" / "lm_scores").glob("part-*.npz"))
    assert not list((tmp_path / "runs" / "tiny").glob("*/lm_scores"))
    # A finished LSR work directory summarised for experiments/results.
    from experiments import lsr_report

    workdir = tmp_path / "runs" / "tiny" / "retriever_to_lm_g0.1_b0.1"
    lsr_report.main(["--workdir", str(workdir), "--name", "tiny", "--out", str(tmp_path)])
    rep = _result(tmp_path, "lsr_nq")
    assert rep["steps"] == 2 and rep["dev"]["initial"]["examples"] == 2
    assert 0 <= rep["dev"]["final"]["recall@1"] <= 1


def test_every_config_file_has_tiny_default_and_a_gpu_variant():
    """docs/experiments.md's promise: `tiny` (CI), `default` (a bare run on 2 CPU cores) and a
    GPU variant (`gpu` or `*_gpu`) in every config file, and every variant its own class."""
    import importlib
    import pkgutil

    import experiments.configs as configs

    names = [m.name for m in pkgutil.iter_modules(configs.__path__) if not m.ispkg]
    assert len(names) >= 9, names
    for name in names:
        table = importlib.import_module(f"experiments.configs.{name}").CONFIGS
        assert {"tiny", "default"} <= table.keys(), (name, sorted(table))
        assert [v for v in table if v == "gpu" or v.endswith("_gpu")], (name, sorted(table))
        assert len({type(c) for c in table.values()}) == 1, name


def test_repeated_set_flags_accumulate():
    """`--set a=1 --set b=2` keeps both (argparse's default would keep only the last)."""
    import argparse

    from experiments.lib.common import add_standard_args
    from experiments.configs.table1_lm import CONFIGS
    from replug_jax.cli import build_parser

    ap = argparse.ArgumentParser()
    add_standard_args(ap, CONFIGS)
    assert ap.parse_args(["--set", "k=5", "--set", "seed=1", "stride=64"]).set == [
        "k=5", "seed=1", "stride=64"]
    assert ap.parse_args([]).set == []
    cli = build_parser().parse_args(["train-lsr", "--config", "experiments/configs/lsr_nq.py",
                                     "--workdir", "w",
                                     "--set", "k=3", "--set", "remat=true"])
    assert cli.set == ["k=3", "remat=true"]


def test_lm_lsr_data_and_inference_temperature_tiny(data, tmp_path):
    """The WikiText article split, the NQ corpus with distractors, and the τ sweep on both
    datasets from scored branches (with the τ fitted and intervals reported)."""
    from experiments import inference_temperature
    from experiments.prepare import nq as prepare_nq, wikitext as prepare_wikitext

    wiki, nq = tmp_path / "wikitext", tmp_path / "nq"
    prepare_wikitext.main(["--out", str(wiki), "--dev", "1", "--test", "1", "--no-python-docs"])
    split = json.loads((wiki / "split.json").read_text())
    assert sorted(split["train"] + split["dev"] + split["test"]) == [
        "Alder River", "Bram Water", "Carrow Beck"]
    prepare_nq.main(["--out", str(nq), "--distractors", str(wiki / "distractors.jsonl")])
    corpus = (nq / "corpus_distractors.jsonl").read_text().splitlines()
    assert len(corpus) == len(FACTS) + len((wiki / "distractors.jsonl").read_text().splitlines())
    assert json.loads(corpus[0])["id"] == "0"  # the gold passages keep their ids
    demos = (nq / "demonstrations.jsonl").read_text().splitlines()
    asked = {json.loads(x)["question"] for name in ("train", "dev")
             for x in (nq / f"{name}.jsonl").read_text().splitlines()}
    assert len(demos) == 4 and not asked & {json.loads(x)["question"] for x in demos}
    out = tmp_path / "out"
    inference_temperature.main([
        "--config", "tiny", "--out", str(out), "--no-progress", "--set",
        f"questions={nq}/dev.jsonl", f"demonstrations={nq}/demonstrations.jsonl",
        f"corpus={nq}/corpus_distractors.jsonl", f"workdir={tmp_path}/work"])
    res = json.loads((out / "inference_temperature" / "tiny.json").read_text())
    assert set(res["rows"]) == {"base/1.0", "base/0.1", "base/uniform", "base/top1",
                                "base/fitted"}
    d = res["rows"]["base/0.1"]["vs_tau1"]
    assert d["low"] <= d["difference"] <= d["high"]
    assert 1e-3 <= res["fits"]["base"]["temperature"] <= 10
    assert np.isfinite(res["lm_alone"]) and "recall@1" in res["recall"]["base"]
    wiki_args = [
        "--config", "tiny_wikitext", "--out", str(out), "--no-progress", "--set",
        f"corpus={wiki}/corpus.jsonl", f"fit_articles={wiki}/dev.jsonl",
        f"test_articles={wiki}/test.jsonl", f"workdir={tmp_path}/work",
        'retrievers=["base=minilm", "again=minilm"]', "steps=[0, 1]"]
    inference_temperature.main(wiki_args)
    res = json.loads((out / "inference_temperature" / "tiny_wikitext.json").read_text())
    assert 0 < res["rows"]["base/1.0"]["metric"] < 10  # bits per byte
    assert (out / "inference_temperature" / "tiny_wikitext.png").stat().st_size > 0
    # The dev curve: dev bits per byte per retriever; the same retriever twice differs by 0.
    assert 0 < res["dev"]["base"]["metric"] == res["dev"]["again"]["metric"] < 10
    assert res["dev"]["again"]["vs_base"]["difference"] == 0
    assert (out / "inference_temperature" / "tiny_wikitext_curve.png").stat().st_size > 0
    # A rerun scores no pair again (the store unchanged), with the same numbers; another k
    # or fewer examples reads the pairs it shares with the first run
    stored = _stored(tmp_path / "work" / "tiny_wikitext")
    inference_temperature.main(wiki_args)
    again = json.loads((out / "inference_temperature" / "tiny_wikitext.json").read_text())
    assert again["rows"] == res["rows"] and again["dev"] == res["dev"]
    inference_temperature.main(wiki_args + ["k=1", "num_examples=2"])
    assert _stored(tmp_path / "work" / "tiny_wikitext") == stored
    fewer = json.loads((out / "inference_temperature" / "tiny_wikitext.json").read_text())
    assert fewer["examples"] == 2 and fewer["config"]["k"] == 1


def test_lsr_study_tiny(data, tmp_path, monkeypatch):
    """The LSR study end to end on its tiny config: pools scored once, two objectives trained
    on them, the chosen one evaluated from the re-embedded datastore, the release rule
    applied; a rerun reads every pool and run from its work directory."""
    from experiments import lsr_study
    from experiments.prepare import wikitext as prepare_wikitext

    wiki = tmp_path / "wikitext"
    prepare_wikitext.main(["--out", str(wiki), "--dev", "1", "--test", "1", "--no-python-docs"])
    out = tmp_path / "out"
    argv = ["--config", "tiny", "--out", str(out), "--no-progress", "--set",
            f"train_data={wiki}/train.jsonl", f"dev_data={wiki}/dev.jsonl",
            f"test_data={wiki}/test.jsonl", f"corpus={wiki}/corpus.jsonl",
            f"workdir={tmp_path}/work"]
    lsr_study.main(argv)
    res = json.loads((out / "lsr_study" / "tiny.json").read_text())
    assert set(res["variants"]) == {"kl_retriever_to_lm/γ=0.1/β=0.1", "marginal/γ=0.1",
                                    "kl_retriever_to_lm/γ=0.1/β=0.1/shuffled-Q control"}
    assert "shuffled-Q" not in res["chosen"]
    diag = res["diagnostics"]  # the oracle ceiling, measured before any training
    assert diag["oracle_bpb"]["dev"] <= res["base"]["dev"]["bpb"] + 1e-9
    assert "oracle" in diag["verdict"] and isinstance(diag["headroom"], bool)
    e2e = res["end_to_end"]
    d = e2e["lsr_vs_base"]
    assert d["low"] <= d["difference"] <= d["high"] and e2e["min_detectable_bpb"] >= 0
    assert e2e["release_rule"].startswith(("passes", "fails"))
    assert res["lm_pairs_scored"] > 0 and (out / "lsr_study" / "tiny.png").stat().st_size > 0
    assert "End to end" in (out / "lsr_study" / "README.md").read_text()
    # every test window's log-likelihood under each system, with its id, article and bytes,
    # and each variant's: the differences can be re-bootstrapped from the JSON alone
    per = res["per_example"]["test"]
    n = res["examples"]["test"]
    assert all(len(per[f]) == n for f in ("ids", "articles", "bytes", "lm_alone", "base",
                                          "lsr_end_to_end"))
    assert all(len(v["test"]["logliks"]) == n for v in res["variants"].values())
    from replug_jax.eval.stats import bpb_difference

    again_d = bpb_difference(per["lsr_end_to_end"], per["base"], per["bytes"],
                             resamples=d["resamples"], seed=res["config"]["seed"])
    assert again_d["difference"] == pytest.approx(d["difference"])
    lsr_study.main(argv)  # resumed: the same numbers from the stored pools and runs
    again = json.loads((out / "lsr_study" / "tiny.json").read_text())
    assert again["end_to_end"] == res["end_to_end"] and again["variants"] == res["variants"]
    # work="tiny": another config tests tiny's trained runs on other test data (a
    # replication), scoring its own test pool and training nothing
    import dataclasses

    monkeypatch.setitem(lsr_study.CONFIGS, "tiny_fresh",
                        dataclasses.replace(lsr_study.CONFIGS["tiny"], work="tiny"))
    from replug_jax.train import loop

    monkeypatch.setattr(loop.LSRTrainer, "run", lambda *a, **k: pytest.fail("trained"))
    fresh = argv[:1] + ["tiny_fresh"] + argv[2:]
    fresh[fresh.index(f"test_data={wiki}/test.jsonl")] = f"test_data={wiki}/dev.jsonl"
    lsr_study.main(fresh)
    rep = json.loads((out / "lsr_study" / "tiny_fresh.json").read_text())
    assert (tmp_path / "work" / "tiny" / "pool_test_tiny_fresh").is_dir()
    assert rep["chosen"] == res["chosen"]
    assert not set(rep["per_example"]["test"]["ids"]) & set(res["per_example"]["test"]["ids"])
    assert [n for n, v in rep["variants"].items() if v["test"]] == [rep["chosen"]]
    assert "only the chosen variant's is shown" in (out / "lsr_study" / "tiny_fresh.md"
                                                      ).read_text()


def test_lsr_study_on_a_built_index_trains_the_query_tower_only(data, tmp_path):
    """``index=`` (a datastore built by ``replug index build``, as the enwiki config's): the
    pools come from the index with each example's own article out, only the query tower
    learns, and the end-to-end test searches the same index's base embeddings; a shared
    encoder is refused in one line."""
    from experiments import lsr_study
    from experiments.prepare import wikitext as prepare_wikitext
    from replug_jax.models import load_tokenizer
    from replug_jax.retrieval.build import build_index
    from replug_jax.retrieval.corpus import chunk_documents, read_documents
    from replug_jax.retrieval.encoder import Retriever

    wiki = tmp_path / "wikitext"
    prepare_wikitext.main(["--out", str(wiki), "--dev", "1", "--test", "1", "--no-python-docs"])
    cfg = lsr_study.CONFIGS["tiny"]
    r = cfg.train.retriever
    retriever = Retriever.load(r.name, max_length=r.doc_max_length,
                               query_max_length=r.query_max_length)
    passages = chunk_documents(read_documents(wiki / "corpus.jsonl"), size=cfg.passage_tokens,
                               unit="tokens", tokenizer=load_tokenizer("smollm2"))
    build_index(passages, retriever, tmp_path / "index", progress=False)
    out = tmp_path / "out"
    argv = ["--config", "tiny", "--out", str(out), "--no-progress", "--set",
            f"train_data={wiki}/train.jsonl", f"dev_data={wiki}/dev.jsonl",
            f"test_data={wiki}/test.jsonl", f"index={tmp_path / 'index'}",
            "train.supervision.towers=query", f"workdir={tmp_path}/work"]
    with pytest.raises(ValueError, match="towers=query"):
        lsr_study.main(argv[:-2] + [f"workdir={tmp_path}/work"])
    lsr_study.main(argv)
    res = json.loads((out / "lsr_study" / "tiny.json").read_text())
    assert res["config"]["index"] == str(tmp_path / "index")
    assert all(v["config"]["supervision"]["towers"] == "query"
               for v in res["variants"].values())
    per = res["per_example"]["test"]
    assert len(per["lsr_end_to_end"]) == res["examples"]["test"] > 0
    assert res["end_to_end"]["base_bpb"] > 0 and res["end_to_end"]["lsr_bpb"] > 0


def test_lsr_study_on_the_first_enwiki_articles_indexes_them_once(data, tmp_path):
    """``index="enwiki:N"``: the first N enwiki-sample articles in 100-word passages, indexed
    once in the work folder (what 2 CPU cores allow in place of the 220,948-passage index)."""
    from experiments import lsr_study
    from experiments.prepare import wikitext as prepare_wikitext

    wiki = tmp_path / "wikitext"
    prepare_wikitext.main(["--out", str(wiki), "--dev", "1", "--test", "1", "--no-python-docs"])
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["--config", "tiny", "--out", str(out), "--no-progress", "--set",
            f"train_data={wiki}/train.jsonl", f"dev_data={wiki}/dev.jsonl",
            f"test_data={wiki}/test.jsonl", "index=enwiki:2", "train.supervision.towers=query",
            f"workdir={work}"]
    lsr_study.main(argv)
    made = (work / "index_enwiki2" / "manifest.json").stat().st_mtime_ns
    res = json.loads((out / "lsr_study" / "tiny.json").read_text())
    assert res["config"]["index"] == "enwiki:2" and res["end_to_end"]["base_bpb"] > 0
    notes = (out / "lsr_study" / "tiny.md").read_text()  # the setting as run, in words
    assert "the first 2 enwiki-sample articles" in notes and "WikiText-2" not in notes
    assert f"{len(lsr_study.lm_datastore.enwiki_passages(2)):,} passages" in notes
    lsr_study.main(argv)  # the index is read back, not built again
    assert (work / "index_enwiki2" / "manifest.json").stat().st_mtime_ns == made


def test_prepare_enwiki_lm_adds_fresh_articles_without_changing_train_and_dev(data, tmp_path):
    """``fresh_test.jsonl`` (the replication's test articles) comes after train and dev in the
    same seeded order: disjoint from both, and the two files do not change with it."""
    from experiments.prepare import enwiki_lm as prepare_enwiki_lm

    def split(out, fresh):
        prepare_enwiki_lm.main(["--out", str(out), "--train", "3", "--dev", "2", "--fresh",
                                str(fresh), "--min-words", "10"])
        return {n: [json.loads(x)["id"] for x in (out / f"{n}.jsonl").read_text().split("\n")
                    if x.strip()] for n in ("train", "dev", "fresh_test")}

    with_fresh, without = split(tmp_path / "a", 4), split(tmp_path / "b", 0)
    assert with_fresh["train"] == without["train"] and with_fresh["dev"] == without["dev"]
    assert len(with_fresh["fresh_test"]) == 4 and not without["fresh_test"]
    assert not set(with_fresh["fresh_test"]) & set(with_fresh["train"] + with_fresh["dev"])
    with pytest.raises(SystemExit, match="fresh"):
        split(tmp_path / "c", 10_000)


def test_lsr_temperature_tiny(data, tmp_path):
    """The temperature study end to end on lsr_qa's tiny pools: γ fitted and learned × β 1 and
    fitted × KL and the marginal likelihood, each run by the one trainer; per run the γ and β
    used (learned: where it went), the kept step's dev recall@1 and dev-pool log-likelihood
    against the base with intervals, the measured entropies, the figure; a rerun trains
    nothing."""
    from experiments import lsr_temperature

    argv = ["--config", "tiny", "--out", str(tmp_path / "out"), "--no-progress",
            "--set", f"workdir={tmp_path / 'work'}"]
    lsr_temperature.main(argv)
    res = json.loads((tmp_path / "out" / "lsr_temperature" / "tiny.json").read_text())
    names = [r["variant"] for r in res["rows"]]
    assert names == ["kl_retriever_to_lm/γ=fitted/β=1/Q=sum", "marginal/γ=fitted",
                     "kl_retriever_to_lm/γ=fitted/β=fitted/Q=sum",
                     "kl_retriever_to_lm/γ=learned/β=1/Q=sum", "marginal/γ=learned",
                     "kl_retriever_to_lm/γ=learned/β=fitted/Q=sum"]
    fit = res["base"]["fitted"]
    assert fit["tau"] in (0.1, 1.0) and fit["beta"] > 0
    for r in res["rows"]:
        t = r["temperatures"]
        assert t["gamma_used"] == pytest.approx(fit["tau"])  # fitted, or learned's start
        assert ("gamma_now" in t) == (r["config"]["gamma"] == "learned")
        if r["config"]["beta"] == "fitted" and r["config"]["objective"] == "kl":
            assert t["beta_used"] == pytest.approx(fit["beta"])
        d = r["dev_recall@1_vs_base"]
        assert d["low"] <= d["difference"] <= d["high"]
        assert [c["step"] for c in r["curve"]] == [0, 2, 4]
    learned = [r for r in res["rows"] if r["config"]["gamma"] == "learned"]
    assert any(r["temperatures"]["gamma_now"] != pytest.approx(fit["tau"]) for r in learned)
    ent = res["entropies"]
    assert all(0 <= v <= ent["uniform"] + 1e-9 for v in ent["retriever"].values())
    assert (tmp_path / "out" / "lsr_temperature" / "tiny.png").stat().st_size > 0
    kept = sorted((tmp_path / "out" / "lsr_temperature" / "tiny_runs").glob("*.json"))
    assert len(kept) == 6  # each finished run's JSON, for the next machine
    import shutil

    shutil.rmtree(tmp_path / "work" / "lsr_temperature_tiny")  # another machine: runs lost
    lsr_temperature.main(argv)  # every run read back from the results folder, none trained
    assert not list((tmp_path / "work" / "lsr_temperature_tiny").glob("*/checkpoints"))
    again = json.loads((tmp_path / "out" / "lsr_temperature" / "tiny.json").read_text())
    assert [r["dev_recall@1"] for r in again["rows"]] == [r["dev_recall@1"] for r in res["rows"]]
    assert res["finished"] == "6 of 6 variants" and "**6 of 6 variants.**" in (
        tmp_path / "out" / "lsr_temperature" / "tiny.md").read_text()
    # the registered design (tau_confirm): the finished study's rule names the variant, which
    # is trained, selected on recall@1 of more dev questions than the dev pool, and tested
    from experiments import lsr_qa

    best = max(enumerate(res["rows"]), key=lambda ir: (
        ir[1]["dev_recall@1"], ir[1]["dev_pool_loglik"], -ir[0]))[1]["variant"]
    reg_argv = ["--config", "tiny_tau", "--out", str(tmp_path / "out"), "--no-progress",
                "--set", f"workdir={tmp_path / 'work'}", "--set",
                f"variant_from={tmp_path / 'out' / 'lsr_temperature' / 'tiny.json'}"]
    # trained while the test pool waits (another process scores it): no test pair scored
    lsr_qa.main(reg_argv + ["--stage", "train", "--pool-sets", "train,dev"])
    work = tmp_path / "work" / "tiny_tau"
    assert not (work / "pool_fresh_test").exists() and not (tmp_path / "out" / "lsr_qa").exists()
    trained = {p.name: p.stat().st_mtime_ns for p in (work / "runs").glob("*.npz")}
    assert len(trained) == 2  # the variant and its shuffled-Q control
    lsr_qa.main(reg_argv + ["--stage", "primary"])  # recall alone: no LM pair, no release
    primary = json.loads((tmp_path / "out" / "lsr_qa" / "tiny_tau_primary.json").read_text())
    assert primary["partial"].startswith("the primary endpoint alone")
    assert not (tmp_path / "out" / "lsr_qa" / "tiny_tau.json").exists()
    lsr_qa.main(reg_argv)  # the test: the trained runs are read back, not trained again
    assert {p.name: p.stat().st_mtime_ns for p in (work / "runs").glob("*.npz")} == trained
    reg = json.loads((tmp_path / "out" / "lsr_qa" / "tiny_tau.json").read_text())
    assert reg["chosen"] == best and set(reg["runs"]) == {best, best + "/shuffled-Q control"}
    assert primary["recall_test"] == reg["recall_test"]  # the full test's endpoint, early
    assert reg["questions"]["dev_recall"] > reg["questions"]["dev"] == 2  # all dev articles
    assert reg["variant_rule"]["rule"].startswith("the finished temperature study's variant")
    # the command line reruns the primary endpoint: the study's datastore merged into one
    # index, the chosen run exported, an index of its passage tower, `replug eval` comparing
    from experiments.lib.lsr_common import slug
    from experiments.lib.lsr_qa_results import BASE
    from experiments.lib.squad import DISTRACTOR_OFFSET
    from replug_jax.cli import main as replug

    questions = work / "test_questions.jsonl"
    rows = [json.loads(line) for line in questions.read_text().splitlines()]
    assert len(rows) == reg["test_questions"]["questions"] == reg["recall_test"]["questions"]
    assert all(isinstance(r["gold_passage"], int) and r["group"] for r in rows)
    store, rel = tmp_path / "store", tmp_path / "released"
    assert replug(["index", "merge", str(work / "squad_index"),
                   str(tmp_path / "work" / "index_enwiki4"), "--out", str(store),
                   "--offsets", "0", str(DISTRACTOR_OFFSET)]) == 0
    assert replug(["export-retriever", "--workdir", str(work / "runs" / slug(best)),
                   "--out", str(rel)]) == 0
    assert replug(["index", "build", "--corpus", str(store / "passages.arrow"), "--retriever",
                   str(rel / "passage_encoder"), "--out", str(tmp_path / "rel_index"),
                   "--chunk-unit", "none"]) == 0
    assert replug(["eval", str(questions), "--index", str(store), "--retriever", "minilm",
                   "--lm", "smollm2", "--modes", "top1", "--retrieval-only", "-k", "1",
                   "--compare-retriever", str(rel), "--compare-index", str(tmp_path / "rel_index"),
                   "--output", str(tmp_path / "verdict"), "--resamples", "200"]) == 0
    verdict = json.loads((tmp_path / "verdict" / "results.json").read_text())
    recall = reg["recall_test"]["recall"]
    assert verdict["rows"]["top1"]["gold_recall_at_k"] == pytest.approx(recall[BASE]["1"])
    assert verdict["rows"]["top1@trained"]["gold_recall_at_k"] == pytest.approx(
        recall[best]["1"])  # float16 towers: the same top passage on these questions
    # a partial result while the study runs: --report-only trains nothing and says so
    for folder in (tmp_path / "out" / "lsr_temperature" / "tiny_runs",
                   tmp_path / "work" / "lsr_temperature_tiny"):
        (folder / kept[-1].name).unlink()
    lsr_temperature.main(argv + ["--report-only"])
    partial = json.loads((tmp_path / "out" / "lsr_temperature" / "tiny.json").read_text())
    assert partial["finished"] == "5 of 6 variants (partial result)" and len(partial["rows"]) == 5
    assert not list((tmp_path / "work" / "lsr_temperature_tiny").glob("*/checkpoints"))
