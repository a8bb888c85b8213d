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
    design = dict(supervision="pool", train_pool=str(tmp_path / "pool"),
                  dev_pool=str(tmp_path / "pool"), data=str(data), dev_data=str(data),
                  corpus=str(corpus), retriever=str(folder), lm="tiny",
                  towers="query", objective="kl", direction="retriever_to_lm", gamma="fitted",
                  beta=1.0, k=2, total_steps=4, batch_size=2, eval_every=2,
                  select_on="pool_loglik", learning_rate=3e-3, warmup_ratio=0.0,
                  query_max_length=16, doc_max_length=32, num_devices=1, checkpoint_every=2)
    (tmp_path / "lsr.json").write_text(json.dumps(design))
    assert main(["train-lsr", "--config", str(tmp_path / "lsr.json"),
                 "--workdir", str(tmp_path / "cli"), "--json"]) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the same design in process: the trainer the studies use, handed the same objects
    cfg = LSRConfig(**design)
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
