"""The release rule holds for everything under checkpoints/: a folder with weights has a
model card that shows it beat its base (and the weights' checksum, and they load); a folder
without weights leads its card with "Not better than its base"."""

import json
import pathlib
import re

import pytest
from tests.helpers import check_release_rule

CHECKPOINTS = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"
FOLDERS = sorted(p for p in CHECKPOINTS.iterdir() if p.is_dir())




@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_release_rule(folder):
    check_release_rule(folder)


def test_every_file_of_a_two_tower_release_is_committed(tmp_path):
    """checkpoints/.gitignore keeps run leftovers out but lets every file a release needs in:
    a two-tower release's passage encoder and sentence-transformers modules too (else a clean
    clone holds a release that cannot load)."""
    import dataclasses
    import shutil
    import subprocess

    from replug_jax.train.export import write_two_towers
    from tests._models import tiny_retriever

    if shutil.which("git") is None or not (CHECKPOINTS.parent / ".git").exists():
        pytest.skip("not a git checkout")
    base = tiny_retriever(0)
    query = dataclasses.replace(base.model)
    out = write_two_towers(query, base.model, tmp_path / "release",
                           {"similarity": "cosine", "query_max_length": 16,
                            "doc_max_length": 16, "trained_from": "tiny"}, "# card\n")
    files = [f"checkpoints/release/{p.relative_to(out).as_posix()}"
             for p in out.rglob("*") if p.is_file()]
    assert any("passage_encoder/" in f for f in files)
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *files],
                             cwd=CHECKPOINTS.parent, capture_output=True, text=True).stdout
    assert not ignored.split(), f"checkpoints/.gitignore drops {ignored.split()}"
    assert subprocess.run(["git", "check-ignore", "-q", "--no-index",
                           "checkpoints/release/optimizer_state.msgpack"],
                          cwd=CHECKPOINTS.parent).returncode == 0  # leftovers stay out


def states_the_bases_training_data(text: str) -> bool:
    """Whether a card or results page says what all-MiniLM-L6-v2 was itself trained on."""
    return bool(re.search(r"all-MiniLM-L6-v2, was itself trained .*about 1(\.17)?B text pairs",
                          text)) and "Natural Questions" in text


def test_an_exported_card_states_what_its_minilm_base_was_trained_on():
    """The card `replug export-retriever` writes says it too, for MiniLM by any name."""
    from replug_jax.train.export import base_training_data

    for name in ("minilm", "sentence-transformers/all-MiniLM-L6-v2", "/models/all-minilm-l6-v2"):
        assert states_the_bases_training_data(base_training_data(name)), name
    assert base_training_data("facebook/contriever") is None


def test_every_card_and_lsr_results_page_states_the_bases_training_data():
    """MiniLM's own training pairs include SQuAD, NQ and TriviaQA: every checkpoint card and
    every results page of a retriever trained from it says so (issue 50)."""
    results = CHECKPOINTS.parent / "experiments" / "results"
    pages = [f / "MODEL_CARD.md" if (f / "MODEL_CARD.md").exists() else f / "README.md"
             for f in FOLDERS] + [
        results / name / "README.md"
        for name in ("lsr_study", "lsr_qa", "lsr_nq", "lsr_wikitext", "temperature_sweep")]
    missing = [str(p.relative_to(CHECKPOINTS.parent)) for p in pages
               if not states_the_bases_training_data(p.read_text())]
    assert not missing, missing
    # each variant's own statement (its README section says it when the variants differ)
    unstated = [f"{js.parent.name}/{js.stem}" for page in pages[len(FOLDERS):]
                for js in page.parent.glob("*.json")
                if not states_the_bases_training_data(
                    json.loads(js.read_text()).get("differences_from_paper") or "")]
    assert not unstated, unstated
    assert not states_the_bases_training_data("The base was trained on some pairs.")


def test_the_squad_release_states_the_lengths_its_study_encoded_at():
    """replug-lsr-minilm-squad was measured on passages and questions its study encoded at
    its config's lengths: its replug.json, and the tokenizers and sentence-transformers
    settings of both towers, say the same (a first export said 128 where the study used
    512, so an index built from it was not the one measured)."""
    from experiments.configs.lsr_qa import CONFIGS

    folder = CHECKPOINTS / "replug-lsr-minilm-squad"
    r = CONFIGS["tau_confirm"].train.retriever
    settings = json.loads((folder / "replug.json").read_text())
    assert (settings["query_max_length"], settings["doc_max_length"]) == (
        r.query_max_length, r.doc_max_length) == (512, 512)
    for tower, length in ((folder, r.query_max_length),
                          (folder / "passage_encoder", r.doc_max_length)):
        st = json.loads((tower / "sentence_bert_config.json").read_text())
        tok = json.loads((tower / "tokenizer_config.json").read_text())
        assert st["max_seq_length"] == tok["model_max_length"] == length
