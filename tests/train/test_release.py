"""A released two-tower retriever (the query tower trained, the passage tower the base): one
folder of float16 safetensors that loads as one retriever in replug-jax, and whose towers load
in transformers and sentence-transformers with the same embeddings within float16 rounding."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from tests._models import tiny_retriever

TEXTS = ["Where does the Zorblat river flow?", "The lighthouse of Vorn was designed in 1851.",
         "Bells cast from copper", "A market town on the Alpha River with an old bridge."]
F16 = 3e-3  # float16 weights: embeddings (unit vectors) agree to a few thousandths


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from replug_jax.models.params import split_params, to_module
    from replug_jax.train.export import write_two_towers

    base = tiny_retriever(0)
    trained = tiny_retriever(1)  # another set of weights stands in for the trained query tower
    graphdef, template, params = split_params(trained.model.encoder)
    query = dataclasses.replace(base.model, encoder=to_module(graphdef, template, params))
    out = write_two_towers(query, base.model, tmp_path_factory.mktemp("rel") / "retriever",
                           {"similarity": "cosine", "query_max_length": 64,
                            "doc_max_length": 64, "trained_from": "tiny"}, "# card\n")
    return out, base, trained, jax.device_get(params)


def test_two_towers_load_as_one_retriever(release):
    from safetensors.numpy import load_file

    from replug_jax.retrieval.encoder import Retriever

    out, base, trained, params = release
    for folder in (out, out / "passage_encoder"):
        assert {t.dtype for t in load_file(folder / "model.safetensors").values()} == {
            np.dtype(np.float16)}
    assert json.loads((out / "replug.json").read_text())["passage_encoder"] == "passage_encoder"
    both = Retriever.load(str(out))
    np.testing.assert_allclose(both.encode_queries(TEXTS), trained.encode_queries(TEXTS),
                               atol=F16)
    np.testing.assert_allclose(both.encode_passages(TEXTS), base.encode_passages(TEXTS),
                               atol=F16)
    # the towers really differ: queries are not embedded by the passage encoder
    assert np.abs(both.encode_queries(TEXTS) - both.encode_passages(TEXTS)).max() > 0.05
    assert both.identity["fingerprint"] != both.identity["query_fingerprint"]
    with pytest.raises(ValueError, match="two towers"):  # train-lsr trains one encoder
        from tests.helpers import make_trainer

        make_trainer(out.parent / "train", retriever=both)
    # the same query tower's weights given as params (what training evaluates with)
    np.testing.assert_allclose(base.encode_queries(TEXTS, params),
                               trained.encode_queries(TEXTS), atol=1e-6)


@pytest.mark.torch
def test_towers_load_in_transformers_and_sentence_transformers(release):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("sentence_transformers")
    from transformers import AutoModel, AutoTokenizer

    out, base, trained, _ = release
    for folder, ours in ((out, trained.encode_queries(TEXTS)),
                         (out / "passage_encoder", base.encode_passages(TEXTS))):
        tok = AutoTokenizer.from_pretrained(str(folder))
        model = AutoModel.from_pretrained(str(folder)).eval()
        batch = tok(TEXTS, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        theirs = torch.nn.functional.normalize(pooled, dim=-1).numpy()
        np.testing.assert_allclose(theirs, ours, atol=F16)
        np.testing.assert_allclose(st.SentenceTransformer(str(folder), device="cpu").encode(
            TEXTS), ours, atol=F16)


def _trained_query_run(tmp_path):
    """A finished pool run that trained the query tower of a saved tiny BERT: (its work
    folder, the base retriever, the kept query parameters)."""
    from replug_jax.retrieval.encoder import Retriever
    from tests._models import save_tiny_bert, tiny_lm
    from tests._pools import pool_trainer

    folder = save_tiny_bert(tmp_path / "bert")
    base = Retriever.load(str(folder), max_length=32, query_max_length=16)
    trainer = pool_trainer((tiny_lm(0), base), tmp_path, towers="query", **{
        "retriever.name": str(folder), "retriever.query_max_length": 16,
        "retriever.doc_max_length": 32, "optim.learning_rate": 3e-3})
    trainer.run()
    return tmp_path / "run", base, trainer.best_params()[1]


def test_the_qa_study_writes_its_release_as_two_towers(tmp_path):
    """What `lsr_qa` writes when its rule passes, through the writer `replug export-retriever`
    uses: the chosen run's kept step as two towers, τ in replug.json, a card led by the
    study's numbers with the SHA-256 of both weight files."""
    import hashlib

    from experiments.lib import lsr_qa_report, pool_study
    from experiments.configs.lsr_qa import CONFIGS
    from replug_jax.retrieval.encoder import Retriever

    run, base, kept = _trained_query_run(tmp_path)
    cfg = dataclasses.replace(CONFIGS["tiny"], release=str(tmp_path / "rel"))
    diff = {"difference": 0.5, "low": 0.2, "high": 0.8}
    rows = {"chosen": {"tau": 0.05, "test_loglik": -3.2, "vs_base": diff, "recall@1": 0.6,
                       "recall@1_vs_base": diff, "recall@2": 0.8, "recall@2_vs_base": diff}}
    payload = {"chosen": "chosen", "systems": rows, "questions": {"test": 3},
               "articles": {"test": 1}, "datastore_passages": 20}
    settings, card = lsr_qa_report.card(cfg, base, payload)
    out = pool_study.release(run, cfg.release, settings, card)
    back = Retriever.load(str(out))
    assert back.retrieval_temperature == 0.05
    np.testing.assert_allclose(back.encode_queries(TEXTS),
                               base.encode_queries(TEXTS, params=kept), atol=F16)
    card = (out / "README.md").read_text()
    digest = hashlib.sha256((out / "passage_encoder" / "model.safetensors").read_bytes())
    assert digest.hexdigest() in card and "+0.500 [+0.200, +0.800]" in card
    from tests.helpers import check_release_rule

    check_release_rule(out)  # the rule tests/test_checkpoints.py applies to checkpoints/


def test_a_recall_study_card_leads_with_recall_at_1_and_states_the_bases_training_data():
    """A recall study's card (issue 50): its first result is the primary endpoint (recall@1
    on every test question, clustered by article), the log-likelihood after it as the
    gatekeeping secondary, and the base's own training data are stated."""
    from experiments.lib import lsr_qa_report
    from experiments.configs.lsr_qa import CONFIGS

    cfg = CONFIGS["tiny_recall"]
    ll = {"difference": 0.05, "low": -0.04, "high": 0.13}
    rec = {"difference": 0.012, "low": 0.005, "high": 0.019}
    rows = {"chosen": {"tau": 0.02, "test_loglik": -3.2, "vs_base": ll, "recall@1": 0.6,
                       "recall@1_vs_base": rec, "recall@2": 0.8, "recall@2_vs_base": rec}}
    payload = {"chosen": "chosen", "systems": rows, "questions": {"test": 3},
               "articles": {"test": 1}, "datastore_passages": 20,
               "recall_test": {"questions": 12000, "articles": 182,
                               "recall": {"chosen": {"1": 0.556}, "base retriever": {"1": 0.544}},
                               "vs_base": {"chosen": {"1": rec}}}}
    settings, card = lsr_qa_report.card(cfg, tiny_retriever(0), payload)
    lead = card.split("\n\n")[1]
    assert lead.startswith("Better than its base: gold-paragraph recall@1 (higher is better) "
                           "0.556 vs 0.544")
    assert "+0.012 [+0.005, +0.019]" in lead and "182 test articles" in lead
    assert "12,000 questions" in lead and "+0.050 [-0.040, +0.130] nats" in lead
    assert "SQuAD, Natural Questions and TriviaQA" in card and \
        settings["retrieval_temperature"]["temperature"] == 0.02


def test_the_lm_study_writes_a_query_tower_release_as_two_towers(tmp_path):
    """What `lsr_study` writes when its rule passes with ``towers="query"`` (the enwiki
    configs): the trained query tower beside the base passage encoder, a card that leads with
    the interval and gives both weight files' SHA-256."""
    import hashlib

    from experiments import lsr_study
    from experiments.lib import lsr_study_report, pool_study
    from replug_jax.retrieval.encoder import Retriever

    run, base, kept = _trained_query_run(tmp_path)
    tiny = lsr_study.CONFIGS["tiny"]
    cfg = dataclasses.replace(tiny, release=str(tmp_path / "rel"), train=tiny.train.updated(
        {"supervision.towers": "query"}))
    payload = {"chosen": "chosen",
               "end_to_end": {"lsr_vs_base": {"difference": -0.02, "low": -0.03,
                                              "high": -0.01, "clusters": 5},
                              "min_detectable_bpb": 0.015, "lm_alone_bpb": 1.2,
                              "base_bpb": 1.1, "lsr_bpb": 1.08},
               "variants": {"chosen": {"best_step": 4, "steps_run": 6}},
               "examples": {"train": 6, "dev": 3, "test": 3}}
    settings, card = lsr_study_report.card(cfg, payload, 20, base.similarity)
    out = pool_study.release(run, cfg.release, settings, card)
    back = Retriever.load(str(out))
    np.testing.assert_allclose(back.encode_queries(TEXTS),
                               base.encode_queries(TEXTS, params=kept), atol=F16)
    np.testing.assert_allclose(back.encode_passages(TEXTS), base.encode_passages(TEXTS),
                               atol=F16)
    card = (out / "README.md").read_text()
    for name in ("model.safetensors", "passage_encoder/model.safetensors"):
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() in card
    assert "Query tower only" in card and "-0.0200 [-0.0300, -0.0100]" in card
    assert "over 5 articles" in card and "1.0800" in card and "20 passages" in card
    from tests.helpers import check_release_rule

    check_release_rule(out)


def test_an_export_does_not_bake_the_tokenizers_padding_into_its_files(tmp_path):
    """A fast tokenizer can hold fixed padding and truncation in its backend (the packaged
    MiniLM's tokenizer.json does); an export writes neither, so the same weights give the same
    files whatever state the tokenizer was loaded or left in."""
    from replug_jax.models import export_retriever

    retriever = tiny_retriever(0)
    backend = retriever.model.tokenizer.backend_tokenizer
    backend.enable_padding(length=16)
    backend.enable_truncation(16)
    out = export_retriever(retriever.model, tmp_path / "r")
    saved = json.loads((out / "tokenizer.json").read_text())
    assert saved["truncation"] is None and saved["padding"] is None
    np.testing.assert_allclose(retriever.encode_queries(TEXTS),  # encoding is unchanged
                               tiny_retriever(0).encode_queries(TEXTS), atol=1e-6)


@pytest.mark.torch
def test_both_clients_cut_long_inputs_alike(tmp_path):
    """The export states the lengths and sides it was trained with (sentence_bert_config.json,
    the tokenizer's truncation side): sentence-transformers and Retriever.load give the same
    embedding for inputs of any length, beyond the limits too (queries keep their end,
    passages their start)."""
    st = pytest.importorskip("sentence_transformers")
    from replug_jax.models.params import split_params, to_module
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.train.export import write_two_towers

    base, trained = tiny_retriever(0), tiny_retriever(1)
    graphdef, template, params = split_params(trained.model.encoder)
    query = dataclasses.replace(base.model, encoder=to_module(graphdef, template, params))
    out = write_two_towers(query, base.model, tmp_path / "short", {
        "similarity": "cosine", "query_max_length": 12, "doc_max_length": 16,
        "trained_from": "tiny"}, "# card\n")
    assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == 12
    rng = np.random.default_rng(0)
    words = "river town bridge market bell copper lighthouse north old stone".split()
    texts = [" ".join(rng.choice(words, n)) for n in rng.integers(1, 60, 12)]
    ours = Retriever.load(str(out))
    for folder, mine in ((out, ours.encode_queries(texts)),
                         (out / "passage_encoder", ours.encode_passages(texts))):
        theirs = st.SentenceTransformer(str(folder), device="cpu").encode(texts)
        np.testing.assert_allclose(theirs, mine, atol=F16)
