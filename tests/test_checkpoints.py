"""The release rule holds for everything under checkpoints/: a folder with weights has a
model card that shows it beat its base (and the weights' checksum, and they load); a folder
without weights leads its card with "Not better than its base"."""

import hashlib
import pathlib
import re

import pytest

CHECKPOINTS = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"
FOLDERS = sorted(p for p in CHECKPOINTS.iterdir() if p.is_dir())


def check_release_rule(folder: pathlib.Path) -> None:
    """A card with weights leads with "Better than its base" and an interval excluding zero
    in the retriever's favour (below zero for bits per byte; above zero where the card says
    higher is better); a card without weights leads with "Not better than its base"."""
    card = (folder / "MODEL_CARD.md").read_text()
    body = card.split("\n", 1)[1].lstrip()
    weights = folder / "model.safetensors"
    if not weights.exists():
        assert body.startswith("**Not better than its base.**"), folder
        return
    assert body.startswith("Better than its base"), folder
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert digest in card, f"{folder}: the card lacks the weights' SHA-256 {digest}"
    interval = re.search(r"\[([−+-][\d.]+), ([−+-][\d.]+)\]", body)
    assert interval, folder
    low, high = (float(g.replace("−", "-")) for g in interval.groups())
    lead = body.split("\n\n", 1)[0]
    assert (low > 0 if "higher is better" in lead else high < 0), folder
    from replug_jax.retrieval.encoder import Retriever

    retriever = Retriever.load(str(folder))
    assert retriever.encode_queries(["a query"]).shape == (1, retriever.dim)


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_release_rule(folder):
    check_release_rule(folder)
