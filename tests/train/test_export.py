"""`replug export-retriever` (replug_jax/train/export.py): a run that trained the query tower
alone is released as two towers at the step its dev selection kept; an `--out` whose
replacement would lose work is refused before anything is written; a re-export of the same
weights keeps the τ that `fit-tau --store retriever` recorded, and drops it for new weights."""

import json

import numpy as np
import pytest

from tests._models import save_tiny_bert, tiny_lm
from tests._pools import FACTS, pool_trainer

pytestmark = pytest.mark.models


@pytest.fixture
def query_run(tmp_path):
    """A finished pool run (query tower alone, the step kept by the dev-pool
    log-likelihood) whose config names a retriever folder export can load."""
    from replug_jax.retrieval.encoder import Retriever

    folder = save_tiny_bert(tmp_path / "bert")
    base = Retriever.load(str(folder), max_length=32, query_max_length=16)
    trainer = pool_trainer((tiny_lm(0), base), tmp_path, towers="query", **{
        "retriever.name": str(folder), "selection.metric": "pool_loglik",
        "selection.patience": 0,
        "retriever.query_max_length": 16, "retriever.doc_max_length": 32,
        "optim.learning_rate": 3e-3})
    result = trainer.run()
    return trainer, result, base


def test_a_query_tower_run_is_exported_as_two_towers_at_its_selected_step(query_run, tmp_path):
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.train.export import export_run

    trainer, result, base = query_run
    out, step, _ = export_run(tmp_path / "run", tmp_path / "release", dtype="float32")
    assert step == result["best_step"]
    settings = json.loads((out / "replug.json").read_text())
    assert settings["passage_encoder"] == "passage_encoder"
    assert (settings["query_max_length"], settings["doc_max_length"]) == (16, 32)
    loaded = Retriever.load(str(out))
    _, kept = trainer.best_params()
    questions = ["The capital of Germany is", "The capital of Spain is"]
    np.testing.assert_allclose(loaded.encode_queries(questions),
                               base.encode_queries(questions, params=kept), atol=1e-5)
    # passages keep the base encoder: a datastore embedded by the base still serves it
    np.testing.assert_allclose(loaded.encode(FACTS), base.encode(FACTS), atol=1e-5)
    assert not np.allclose(loaded.encode_queries(questions), base.encode_queries(questions),
                           atol=1e-4)  # the query tower did move
    # every library cuts as the towers were trained: the tokenizers' own limits too
    from transformers import AutoTokenizer

    long_text = " ".join(f"word{i}" for i in range(300))
    for folder, length, side in ((out, 16, "left"), (out / "passage_encoder", 32, "right")):
        tok = AutoTokenizer.from_pretrained(str(folder))
        ids = tok(long_text, truncation=True)["input_ids"]
        assert len(ids) == length and tok.truncation_side == side
    card = (out / "README.md").read_text()
    assert "the query tower alone" in card and '"gamma_used"' in card
    assert f"steps: {step} of 4" in card


def test_an_out_folder_whose_replacement_would_lose_work_is_refused(query_run, tmp_path):
    from replug_jax.train.export import export_run

    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.tex").write_text("months of work")
    for out, message in ((tmp_path / "run", "is, or holds, the work directory"),
                         (tmp_path, "is, or holds, the work directory"),
                         (other, "not a retriever exported by replug-jax"),
                         (other / "thesis.tex", "is a file")):
        with pytest.raises(ValueError, match=message):
            export_run(tmp_path / "run", out)
    assert (other / "thesis.tex").read_text() == "months of work"
    assert (tmp_path / "run" / "config.json").is_file()
    out, _, _ = export_run(tmp_path / "run", tmp_path / "release")
    assert export_run(tmp_path / "run", out)[0] == out  # an export may be replaced


def test_a_re_export_keeps_the_tau_fitted_for_its_weights(query_run, tmp_path):
    from replug_jax.train.export import TEMPERATURE_SECTION, export_run, record_temperature

    trainer, result, _ = query_run
    out, step, _ = export_run(tmp_path / "run", tmp_path / "release")
    record_temperature(out, 0.031, {"data": "dev.jsonl"}, "τ = 0.031 fitted on dev.jsonl")
    export_run(tmp_path / "run", out)  # the documented last step: export again
    settings = json.loads((out / "replug.json").read_text())
    assert settings["retrieval_temperature"] == {"temperature": 0.031,
                                                 "fit": {"data": "dev.jsonl"}}
    card = (out / "README.md").read_text()
    assert card.count(TEMPERATURE_SECTION) == 1 and "τ = 0.031 fitted on dev.jsonl" in card
    other = next(s for s in range(1, 5) if s != step and
                 (tmp_path / "run" / "checkpoints" / str(s)).exists())
    with pytest.warns(UserWarning, match="fitted for the weights this export replaces"):
        export_run(tmp_path / "run", out, step=other)
    assert "retrieval_temperature" not in json.loads((out / "replug.json").read_text())


def test_one_tau_record_in_an_index_and_a_retriever_and_the_old_keys_still_read(query_run,
                                                                                  tmp_path):
    """Issue 65: the τ an index keeps and the τ a retriever's replug.json keeps are one
    record (fitted_tau.record); a replug.json of an earlier release (`temperature`,
    `temperature_fit`) still gives its τ, and a re-export rewrites it in the one format."""
    from replug_jax.retrieval import fitted_tau
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.train.export import export_run

    out, _, _ = export_run(tmp_path / "run", tmp_path / "release")
    (tmp_path / "idx").mkdir()
    index_tau = fitted_tau.write(tmp_path / "idx", 0.02, {"fingerprint": "f", "source": "s"},
                                 {"data": "dev.jsonl"})
    stored = json.loads(index_tau.read_text())["fits"]["f"]
    path = out / "replug.json"
    settings = json.loads(path.read_text())
    path.write_text(json.dumps({**settings, "temperature": 0.02,
                                "temperature_fit": {"data": "dev.jsonl"}}))
    assert Retriever.load(str(out)).retrieval_temperature == 0.02
    assert {k: v for k, v in stored.items() if k != "query_encoder"} == \
        fitted_tau.in_settings(json.loads(path.read_text()))
    export_run(tmp_path / "run", out)
    again = json.loads(path.read_text())
    assert "temperature" not in again and again["retrieval_temperature"]["temperature"] == 0.02
    assert Retriever.load(str(out)).retrieval_temperature_source == "the retriever's replug.json"


def test_an_index_built_with_an_export_cuts_passages_at_its_trained_length(query_run, tmp_path):
    """`index build --retriever <export>` embeds passages as the export was trained to
    (replug.json's doc_max_length), as Retriever.load and sentence-transformers do; an
    explicit --max-length still wins."""
    from replug_jax.cli import main
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.retrieval.faiss_index import Index
    from replug_jax.train.export import export_run

    out, _, _ = export_run(tmp_path / "run", tmp_path / "release", dtype="float32")
    corpus = tmp_path / "c.jsonl"
    long_text = " ".join(f"word{i}" for i in range(200))
    corpus.write_text(json.dumps({"id": "long", "text": long_text}) + "\n"
                      + json.dumps({"id": "short", "text": FACTS[0]}) + "\n")
    for name, extra, length in (("idx", [], 32), ("idx64", ["--max-length", "48"], 48)):
        assert main(["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / name),
                     "--retriever", str(out), "--chunk-size", "1000"] + extra) == 0
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["encoder"]["max_length"] == length
    index = Index.load(tmp_path / "idx")
    own = Retriever.load(str(out)).encode([long_text, FACTS[0]])
    np.testing.assert_allclose(index.search(own, 1).scores[:, 0], 1.0, atol=1e-4)
