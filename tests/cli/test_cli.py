"""The `replug` command end to end: --help everywhere, index build/search, score, --json."""

import json
import re

import numpy as np
import pytest

from replug_jax.cli import build_parser, main
from tests._models import packaged_or_skip


def _subcommands(parser, prefix=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,), sub
                yield from _subcommands(sub, prefix + (name,))


def test_every_command_has_help_for_every_option(capsys):
    parser = build_parser()
    commands = list(_subcommands(parser))
    assert {c for c, _ in commands} >= {("index",), ("index", "build"), ("index", "search"),
                                        ("score",), ("generate",), ("ask",), ("demo",),
                                        ("serve",)}
    for cmd, sub in commands:
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{' '.join(cmd)} {action.option_strings} has no help"
        # every command that prints a result (not `serve`, which runs until stopped)
        if not any(a.__class__.__name__ == "_SubParsersAction" for a in sub._actions) \
                and cmd != ("serve",):
            assert any(a.dest == "json" for a in sub._actions), f"{cmd} lacks --json"
    assert main(["score", "--help"]) == 0 and "--mode" in capsys.readouterr().out


@pytest.mark.models
def test_index_build_search_and_score(tmp_path, capsys):
    packaged_or_skip("minilm")
    packaged_or_skip("smollm2")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"id": str(i), "text": t}) for i, t in enumerate([
        "The Zorblat river flows through the small town of Quenwick.",
        "Berlin is the capital of Germany.", "Madrid is the capital of Spain."])) + "\n")
    index = tmp_path / "idx"
    assert main(["index", "build", "--corpus", str(corpus), "--out", str(index), "--json"]) == 0
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert built["n"] == 3 and built["truncated_passages"] == 0 and built["notes"] == []
    # an empty text is not dropped without a word: the summary names its line
    gaps = tmp_path / "gaps.jsonl"
    gaps.write_text(corpus.read_text().replace('{"id": "1"', '{"id": "x", "text": ""}\n{"id": "1"'))
    assert main(["index", "build", "--corpus", str(gaps), "--out", str(tmp_path / "g"),
                 "--json"]) == 0
    noted = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert noted["n"] == 3 and noted["notes"] == [
        f"{gaps}: skipped 1 record(s) with empty text (line 2): not indexed"]
    assert main(["index", "search", str(index), "Where does the Zorblat flow?", "-k", "2",
                 "--json"]) == 0
    hit = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert hit["ids"][0] == 0 and len(hit["scores"]) == 2
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"context": "The Zorblat river flows through the town of",
                               "continuation": " Quenwick."}) + "\n")
    assert main(["score", "--index", str(index), "--input", str(inp), "-k", "2", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert lines[0]["doc_ids"][0] == 0 and len(lines[0]["weights"]) == 2
    summary = lines[-1]["summary"]
    assert summary["num_tokens"] > 0 and summary["bits_per_byte"] > 0
    assert lines[-1]["settings"]["k"] == 2
    # k above the corpus: the k used is reported, and the one asked for, with a note
    assert main(["score", "--index", str(index), "--input", str(inp), "-k", "10", "--json"]) == 0
    over = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["settings"]
    assert over["k"] == 3 and over["k_requested"] == 10 and "holds 3 passages" in over["note"]
    assert main(["score", "--mode", "none", "--input", str(inp), "--json"]) == 0
    none = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert none["loglik"] < summary["loglik"]
    # The same scores with the LM sharded over 8 devices (SmolLM2's 576-wide layers split by
    # fsdp, the batch by data); a model axis that does not divide its 9 heads is refused.
    assert main(["score", "--index", str(index), "--input", str(inp), "-k", "2", "--json",
                 "--mesh", "data=4,fsdp=2", "--dtype", "float32"]) == 0
    sharded = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert sharded["loglik"] == pytest.approx(summary["loglik"], abs=1e-4)
    assert main(["score", "--mode", "none", "--input", str(inp), "--mesh", "model=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("model sizes that work are 1, 3, 9") and len(err.splitlines()) == 1


def test_clear_errors(tmp_path, capsys):
    assert main(["index", "search", str(tmp_path / "missing"), "q"]) == 2
    assert "no such index directory" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["index", "build", "--corpus", str(empty), "--out", str(tmp_path / "x")]) == 2
    assert "empty" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["index", "search", "IDX", "q", "-k", "0"], "argument -k: must be positive, got 0"),
    (["ask", "what?", "--retrieval-temperature", "0"],
     "--retrieval-temperature: must be positive, got 0.0"),
    (["ask", "what?", "--temperature", "0.5"], "--temperature is now --retrieval-temperature"),
    (["score", "--baseline", "none"], "--baseline is now --mode"),
    (["generate", "p", "--temperature-sample", "1"],
     "--temperature-sample is now --sampling-temperature"),
    (["score", "--input", "MISSING.jsonl"], "argument --input: MISSING.jsonl: no such file"),
    (["index", "build", "--corpus", "MISSING.tsv", "--out", "o"], "--corpus MISSING.tsv"),
    (["generate", "p", "--top-p", "1.5"], "argument --top-p: must be in (0, 1], got 1.5"),
    (["generate", "p", "--sampling-temperature", "-0.5"], "must be >= 0, got -0.5"),
    (["serve", "--port", "70000"], "argument --port: must be in 1..65535, got 70000"),
    (["serve", "--max-batch", "0"], "--max-batch must be positive, got 0"),
    (["serve", "--host", "0.0.0.0"], "refusing to serve on 0.0.0.0 without an API key"),
    (["api", "check", "--api-base", "http://x", "--api-timeout", "0"],
     "argument --api-timeout: must be positive, got 0.0"),
    (["train-lsr", "--config", "NOPE.py", "--workdir", "w"],
     "argument --config: NOPE.py: no such file"),
    (["index", "build", "--corpus", "demo", "--out", "o", "--overlap", "100"],
     "--overlap (100) must be smaller than --chunk-size (100)"),
])
def test_bad_arguments_are_rejected_before_any_model_loads(
        tmp_path, monkeypatch, capsys, argv, message):
    import replug_jax.lm.flax_scorer as flax_scorer
    import replug_jax.retrieval.encoder as encoder

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(encoder, "load_retriever", no_loading)
    monkeypatch.setattr(flax_scorer, "load_lm", no_loading)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "IDX").mkdir()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.models
def test_index_build_from_embeddings_verify_and_search(tmp_path, capsys):
    packaged_or_skip("minilm")
    corpus = tmp_path / "psgs.tsv"
    corpus.write_text("id\ttext\ttitle\n" + "".join(
        f"{i}\tpassage number {i} about topic {i % 5}\tT{i}\n" for i in range(300)))
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(300, 384)).astype(np.float32)
    np.save(tmp_path / "emb.npy", emb / np.linalg.norm(emb, axis=1, keepdims=True))
    out = tmp_path / "idx"
    assert main(["index", "build", "--corpus", str(corpus), "--chunk-unit", "none",
                 "--embeddings", str(tmp_path / "emb.npy"), "--shards", "2", "--out", str(out),
                 "--json"]) == 0
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert built["n"] == 300 and len(built["shards"]) == 2 and built["bytes"] > 300 * 384 * 4
    assert main(["index", "verify", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert main(["index", "search", str(out), "anything", "-k", "3", "--json"]) == 0
    hit = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(hit["ids"]) == 3 and hit["titles"][0] == f"T{hit['ids'][0]}"
    np.save(tmp_path / "bad.npy", emb[:299])
    assert main(["index", "build", "--corpus", str(corpus), "--chunk-unit", "none",
                 "--embeddings", str(tmp_path / "bad.npy"), "--out", str(tmp_path / "b")]) == 2
    assert "bad.npy: 299 embeddings for 300 passages" in capsys.readouterr().err


@pytest.mark.models
def test_index_recall_info_tune_and_search_knobs(tmp_path, capsys):
    """`index build --target-recall` prints and stores recall; `index info` shows it;
    `index tune` re-tunes a built index; `index search` takes --nprobe/--rerank and returns
    each hit's source document id and span."""
    packaged_or_skip("minilm")
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(20, 384))
    emb = centers[rng.integers(20, size=2000)] + 0.1 * rng.normal(size=(2000, 384))
    emb = (emb / np.linalg.norm(emb, axis=1, keepdims=True)).astype(np.float32)
    np.save(tmp_path / "emb.npy", emb)
    (tmp_path / "docs.jsonl").write_text("".join(
        json.dumps({"id": f"doc-{i}", "text": f"passage number {i}"}) + "\n"
        for i in range(2000)))
    idx = tmp_path / "idx"
    assert main(["index", "build", "--corpus", str(tmp_path / "docs.jsonl"), "--chunk-unit",
                 "none", "--embeddings", str(tmp_path / "emb.npy"), "--factory", "IVF8,PQ8",
                 "--train-size", "2000", "--target-recall", "0.9", "--out", str(idx),
                 "--json"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert built["recall"]["tuning"]["reached"] and built["recall"]["at"]["10"]["low"] >= 0.9
    assert main(["index", "info", str(idx)]) == 0
    out = capsys.readouterr().out
    assert "recall@10" in out and "IVF8,PQ8" in out and "search defaults" in out
    assert main(["index", "tune", str(idx), "--embeddings", str(tmp_path / "emb.npy"),
                 "--target-recall", "0.99", "--json"]) == 0
    tuned = json.loads(capsys.readouterr().out)
    assert tuned["recall"]["tuning"]["target"] == 0.99
    assert json.loads((idx / "manifest.json").read_text())["rerank_factor"] == \
        tuned["rerank_factor"]
    assert main(["index", "search", str(idx), "passage number 7", "-k", "3", "--nprobe", "1",
                 "--rerank", "0", "--json"]) == 0
    hit = json.loads(capsys.readouterr().out)
    assert len(hit["ids"]) == 3 and all(s["source_id"].startswith("doc-")
                                        for s in hit["sources"])


@pytest.mark.models
def test_ask_puts_the_passage_inside_a_chat_lm_s_user_turn(tmp_path, capsys):
    """With a chat template (the packaged SmolLM2-Instruct), each passage goes inside the
    user's turn before the question, not in front of `<|im_start|>system`; --json gives the
    exact prompt of every branch."""
    packaged_or_skip("minilm")
    packaged_or_skip("smollm2")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "p", "text": "Pirath was founded in 1821 by the "
                                  "shipwright Olek Varnay."}) + "\n")
    assert main(["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "i"),
                 "--json"]) == 0
    capsys.readouterr()
    for layout in ("inside", "before"):
        assert main(["ask", "--index", str(tmp_path / "i"), "Who founded Pirath?", "-k", "1",
                     "--max-new-tokens", "12", "--chat-layout", layout, "--json"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        [branch] = out["branch_prompts"]
        passage = branch.index("Olek Varnay")
        if layout == "inside":
            assert branch.index("<|im_start|>user") < passage < branch.index("Who founded")
            assert branch.index("<|im_start|>system") < passage
        else:
            assert passage < branch.index("<|im_start|>")
        assert out["chat_layout"] == layout


# -- one line and exit 2 for malformed corpora, queries and index folders --------------------

def _one_line_error(capsys, argv, match):
    from replug_jax.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    lines = [e for e in err if e.startswith("replug: error:")]
    assert len(lines) == 1 and "Traceback" not in "\n".join(err), err
    assert __import__("re").search(match, lines[0]), lines[0]


@pytest.fixture(scope="module")
def small_index(tmp_path_factory):
    from tests._models import packaged_or_skip
    from replug_jax.cli import main

    packaged_or_skip("minilm")
    d = tmp_path_factory.mktemp("cli")
    corpus = d / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"passage {i} about topic {i % 5}"}) + "\n"
                              for i in range(20)))
    assert main(["index", "build", "--corpus", str(corpus), "--out", str(d / "idx")]) == 0
    return d, corpus


@pytest.mark.parametrize("case", ["bogus_factory", "ivf_too_big", "pq_too_big", "empty",
                                  "not_json", "null_text_only", "numeric_text", "missing"])
def test_index_build_refuses_bad_input_in_one_line_before_work(case, small_index, capsys):
    d, corpus = small_index
    out = d / f"out_{case}"
    args = {"bogus_factory": ["--factory", "bogus"], "ivf_too_big": ["--factory", "IVF64,Flat"],
            "pq_too_big": ["--factory", "IVF2,PQ8"]}.get(case, [])
    bad = d / f"{case}.jsonl"
    bad.write_text({"empty": "\n\n", "not_json": '{"text": "a"}\n{oops\n',
                    "null_text_only": '{"text": null}\n', "numeric_text": '{"text": 5}\n'}
                   .get(case, ""))
    source = corpus if case in args or case.endswith("big") or case == "bogus_factory" else bad
    if case == "missing":
        source = d / "nowhere.jsonl"
    match = {"bogus_factory": "FAISS cannot build it", "ivf_too_big": "needs at least 64",
             "pq_too_big": "needs at least 256", "empty": "empty", "not_json": "not valid JSON",
             "null_text_only": "empty", "numeric_text": "must be a string",
             "missing": "no such file"}[case]
    _one_line_error(capsys, ["index", "build", "--corpus", str(source), "--out", str(out),
                             *args], match)
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


@pytest.mark.parametrize("case", ["no_folder", "manifest_corrupt", "manifest_missing",
                                  "store_truncated"])
def test_index_search_refuses_broken_folders_in_one_line(case, small_index, capsys, tmp_path):
    import shutil

    d, _ = small_index
    broken = tmp_path / "idx"
    if case != "no_folder":
        shutil.copytree(d / "idx", broken)
    if case == "manifest_corrupt":
        (broken / "manifest.json").write_text("{not json")
    elif case == "manifest_missing":
        (broken / "manifest.json").unlink()
    elif case == "store_truncated":
        store = broken / "passages.arrow"
        store.write_bytes(store.read_bytes()[:100])
    _one_line_error(capsys, ["index", "search", str(broken), "topic"], str(broken.name))


@pytest.mark.parametrize("content, match", [('{"context": "a"}\n', "needs 'context'"),
                                            ("not json\n", "not valid JSON"),
                                            ("\n", "no examples")])
def test_malformed_score_inputs_are_one_line(content, match, tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text(content)
    _one_line_error(capsys, ["score", "--input", str(path), "--mode", "none"], match)



@pytest.mark.parametrize("case", ["confidence_1", "same_labels", "output_is_file", "no_index",
                                  "other_corpus", "modes_twice", "bounds_reversed",
                                  "store_retriever_without_export", "retrieval_only_none",
                                  "retrieval_only_texts"])
def test_eval_and_fit_tau_refuse_bad_arguments_before_the_lm_loads(case, tmp_path, capsys,
                                                                   monkeypatch):
    """Each refusal comes in one line before any model is loaded or anything is scored."""
    from replug_jax.cli import main

    def no_lm(args):
        raise AssertionError("the LM was loaded before the arguments were checked")

    monkeypatch.setattr("replug_jax.cli.infer.make_lm", no_lm)
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "Who?", "answer": "Me"}) + "\n")
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"text": "A text to model."}) + "\n")
    for name, checksum in (("idx", "c0ffee" * 4), ("idx2", "beef" * 6)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"corpus_checksum":
                                                                   checksum}))
    (tmp_path / "a_file").write_text("x")
    out, idx = str(tmp_path / "out"), str(tmp_path / "idx")
    argv, match = {
        "confidence_1": (["eval", str(qa), "--output", out, "--confidence", "1"], "in \\(0, 1\\)"),
        "same_labels": (["eval", str(qa), "--output", out, "--index", idx,
                         "--compare-retriever", "minilm", "--compare-label", "base"],
                        "equals --label"),
        "output_is_file": (["eval", str(qa), "--output", str(tmp_path / "a_file")], "is a file"),
        "no_index": (["eval", str(qa), "--output", out, "--modes", "none,replug"],
                     "needs --index"),
        "other_corpus": (["eval", str(qa), "--output", out, "--index", idx,
                          "--compare-retriever", "minilm", "--compare-index",
                          str(tmp_path / "idx2")], "holds another corpus"),
        "modes_twice": (["eval", str(qa), "--output", out, "--modes", "replug,replug"],
                        "listed twice"),
        "bounds_reversed": (["fit-tau", str(qa), "--index", idx, "--bounds", "5", "1"],
                            "LOW < HIGH"),
        "store_retriever_without_export": (["fit-tau", str(qa), "--index", idx, "--store",
                                            "retriever"], "needs --retriever"),
        "retrieval_only_none": (["eval", str(qa), "--output", out, "--retrieval-only",
                                 "--modes", "none"], "--modes none has none"),
        "retrieval_only_texts": (["eval", str(texts), "--output", out, "--index", idx,
                                  "--retrieval-only"], "this file holds texts")}[case]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.models
def test_eval_of_the_lm_alone_needs_no_index(tmp_path, capsys):
    """`--modes none` (a documented mode: the LM without retrieval) runs without --index."""
    from replug_jax.cli import main
    from tests._models import packaged_or_skip

    packaged_or_skip("smollm2")
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "What is the capital of France?",
                              "answer": "Paris"}) + "\n")
    assert main(["eval", str(qa), "--output", str(tmp_path / "out"), "--modes", "none",
                 "--no-generate", "--json"]) == 0
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(report["rows"]) == ["none"]
    assert report["rows"]["none"]["mean_answer_loglik"] < 0


@pytest.mark.models
def test_eval_reads_and_fills_a_score_store_shared_by_key(tmp_path, monkeypatch):
    """`--lm-scores DIR`: the first run adds each pair's scores, a second run reads them
    all and calls the LM for none (same numbers); the keys are those LSR training uses."""
    from replug_jax.cli import main
    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.lm.score_store import ScoreStore
    from tests._models import packaged_or_skip

    packaged_or_skip("smollm2")
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in
                          (("What is the capital of France?", "Paris"),
                           ("How many legs has a spider?", "eight"))))
    store = tmp_path / "scores"
    argv = ["eval", str(qa), "--modes", "none", "--no-generate", "--json",
            "--lm-scores", str(store)]
    assert main(argv + ["--output", str(tmp_path / "one")]) == 0
    assert len(ScoreStore(store, "smollm2 (float32)")) == 2

    def no_call(self, prompts, continuations):
        raise AssertionError(f"the LM was called for {len(prompts)} pairs")

    monkeypatch.setattr(FlaxLM, "score_continuations", no_call)
    assert main(argv + ["--output", str(tmp_path / "two")]) == 0
    one, two = (json.loads((tmp_path / d / "results.json").read_text())["rows"]["none"]
                for d in ("one", "two"))
    assert one["mean_answer_loglik"] == two["mean_answer_loglik"] < 0
