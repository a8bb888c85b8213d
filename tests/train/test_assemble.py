"""`replug train-lsr --config` (replug_jax/train/assemble.py) runs a pool design, the one the
studies run, end to end from files: the same trainer and the same numbers as in process, and
`replug export-retriever` releases its kept step as two towers."""

import json

import numpy as np
import pytest

from tests._models import save_tiny_bert, tiny_lm
from tests._pools import FACTS, pool_examples, tiny_pool

pytestmark = pytest.mark.models


def test_train_lsr_runs_a_pool_design_from_files_as_in_process(tmp_path, capsys):
    from replug_jax.cli import main
    from replug_jax.retrieval.corpus import Passage
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.train.config import LSRConfig
    from replug_jax.train.loop import LSRTrainer

    folder = save_tiny_bert(tmp_path / "bert")
    retriever = Retriever.load(str(folder), max_length=32, query_max_length=16)
    pool, _ = tiny_pool((tiny_lm(0), retriever), tmp_path / "pool")
    examples = pool_examples()
    answers = [e.continuation.strip() for e in examples]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"id": e.id, "question": e.query, "answer": a}) + "\n"
                            for e, a in zip(examples, answers)))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n"
                              for i, t in enumerate(FACTS)))
    design = {"supervision": {"kind": "pool", "train_pool": str(tmp_path / "pool"),
                              "dev_pool": str(tmp_path / "pool"), "towers": "query"},
              "data": {"train": str(data), "dev": str(data), "corpus": str(corpus)},
              "retriever": {"name": str(folder), "query_max_length": 16, "doc_max_length": 32},
              "lm.name": "tiny", "objective": {"kind": "kl", "direction": "retriever_to_lm",
                                               "gamma": "fitted", "beta": 1.0},
              "k": 2, "total_steps": 4, "batch_size": 2,
              "selection": {"every": 2, "metric": "pool_loglik"},
              "optim": {"learning_rate": 3e-3, "warmup_ratio": 0.0}, "num_devices": 1,
              "checkpoint_every": 2}
    (tmp_path / "lsr.json").write_text(json.dumps(design))
    assert main(["train-lsr", "--config", str(tmp_path / "lsr.json"),
                 "--workdir", str(tmp_path / "cli"), "--json"]) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the same design in process: the trainer the studies use, handed the same objects
    cfg = LSRConfig.from_tree(design)
    passages = [Passage(i, t, source_id=str(i)) for i, t in enumerate(FACTS)]
    from replug_jax.train.data import qa_examples

    ours = LSRTrainer(cfg, tmp_path / "ours", retriever=retriever, lm_scorer=None,
                      passages=passages, train=qa_examples(data), dev=qa_examples(data),
                      progress=False, pools=(pool, pool)).run()
    assert cli["best_step"] == ours["best_step"]
    np.testing.assert_allclose([p["dev_loglik"] for p in cli["curve"]],
                               [p["dev_loglik"] for p in ours["curve"]], rtol=1e-5)
    assert cli["temperatures"]["gamma_used"] == ours["temperatures"]["gamma_used"] < 1
    assert main(["export-retriever", "--workdir", str(tmp_path / "cli"),
                 "--out", str(tmp_path / "release")]) == 0
    settings = json.loads((tmp_path / "release" / "replug.json").read_text())
    assert settings["passage_encoder"] == "passage_encoder"
    card = (tmp_path / "release" / "README.md").read_text()
    assert f"steps: {cli['best_step']} of 4" in card and "the query tower alone" in card


def test_train_lsr_selects_on_recall_at_1_of_its_own_questions_over_an_index(tmp_path, capsys):
    """selection.metric="recall@1" from the command line: the recall@1 of
    `selection.recall_data` (questions apart from the dev pool's, costing no LM pair) over an
    index the base built; the dev pool guards the choice."""
    from replug_jax.cli import main
    from replug_jax.retrieval.encoder import Retriever

    folder = save_tiny_bert(tmp_path / "bert")
    retriever = Retriever.load(str(folder), max_length=32, query_max_length=16)
    tiny_pool((tiny_lm(0), retriever), tmp_path / "pool")
    examples = pool_examples()
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"id": e.id, "question": e.query,
                                        "answer": e.continuation.strip()}) + "\n"
                            for e in examples))
    recall = tmp_path / "recall.jsonl"  # each question's gold document, by the corpus's id
    recall.write_text("".join(json.dumps({"id": f"r{i}", "question": e.query, "answer": "x",
                                          "gold_doc": g}) + "\n"
                              for i, (e, g) in enumerate(zip(examples, (0, 1, 3, 4)))))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n"
                              for i, t in enumerate(FACTS)))
    assert main(["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "idx"),
                 "--retriever", str(folder), "--max-length", "32", "--json"]) == 0
    capsys.readouterr()
    design = {"supervision": {"kind": "pool", "train_pool": str(tmp_path / "pool"),
                              "dev_pool": str(tmp_path / "pool"), "towers": "query"},
              "data": {"train": str(data), "dev": str(data), "corpus": str(tmp_path / "idx")},
              "retriever": {"name": str(folder), "query_max_length": 16, "doc_max_length": 32},
              "lm.name": "tiny", "objective": {"gamma": 0.1, "beta": 1.0}, "k": 2,
              "total_steps": 4, "batch_size": 2,
              "selection": {"every": 2, "metric": "recall@1", "recall_data": str(recall)},
              "optim": {"learning_rate": 3e-3, "warmup_ratio": 0.0}, "num_devices": 1}
    (tmp_path / "lsr.json").write_text(json.dumps({"configs": {"registered": design}}))
    assert main(["train-lsr", "--config", f"{tmp_path / 'lsr.json'}:registered",
                 "--workdir", str(tmp_path / "run"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p["step"] for p in out["curve"]] == [0, 2, 4]
    assert all(0 <= p["dev_recall@1"] <= 1 for p in out["curve"])
    assert all(p["dev_recall@1"] * 4 == round(p["dev_recall@1"] * 4) for p in out["curve"])
    bad = tmp_path / "nogold.jsonl"
    bad.write_text(json.dumps({"question": "q?", "answer": "a"}) + "\n")
    (tmp_path / "bad.json").write_text(json.dumps({**design,
                                                   "selection.recall_data": str(bad)}))
    assert main(["train-lsr", "--config", str(tmp_path / "bad.json"),
                 "--workdir", str(tmp_path / "bad")]) == 2
    assert "gold_doc on every question of selection.recall_data" in capsys.readouterr().err
