"""The real-datastore language-modelling experiment's pieces (experiments/lib/lm_datastore.py):
window selection in rounds over articles and the n-gram leakage check (its mixtures and
cross-fitted τ are the library's: tests/test_branches.py, tests/eval/test_temperature.py)."""

from __future__ import annotations

import numpy as np

from experiments.lib import lm_datastore
from replug_jax.eval.perplexity import WindowSettings
from replug_jax.retrieval.corpus import Document, Passage


class _WordTokenizer:
    """Whitespace tokens with character offsets, as sliding_windows asks of a tokenizer."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=True):
        import re

        return {"offset_mapping": [m.span() for m in re.finditer(r"\S+", text)]}


def test_windows_taken_in_rounds_over_articles():
    docs = [Document(f"d{i}", " ".join(f"w{i}_{j}" for j in range(n)), f"T{i}")
            for i, n in enumerate((100, 30, 12, 60))]
    settings = WindowSettings(4, 4, 4, 4, "none")
    windows, article_of = lm_datastore.select_windows(docs, _WordTokenizer(), settings, 10)
    assert len(windows) == 10
    counts = np.bincount(article_of, minlength=4)
    assert counts.max() - counts.min() <= 1 and counts.min() >= 2  # every article counts
    assert list(article_of) == sorted(article_of)
    # each article's windows are spread over it, not its first ones
    first = [w for w, a in zip(windows, article_of) if a == 0]
    assert first[-1].target_span[1] > 0.6 * len(docs[0].text)
    every, _ = lm_datastore.select_windows(docs, _WordTokenizer(), settings, 0)
    assert len(every) == sum((n - 4 + 3) // 4 for n in (100, 30, 12, 60))


def test_leaking_passages_share_a_word_ngram():
    from replug_jax.eval.perplexity import Window

    target = " The river rises in the hills and meets the sea at Port @-@ Vane ."
    w = Window("d", "", target, "", (0, 1), (0, 1))
    passages = [Passage(0, "Far away the river rises in the hills and meets the sea."),
                Passage(1, "The River rises in the hills, and meets the sea at Port-Vane!"),
                Passage(2, "Nothing here matches anything at all in that window text.")]
    assert lm_datastore.leaking_passages([w], passages, 13, progress=False) == [{1}]
    assert lm_datastore.leaking_passages([w], passages, 8, progress=False) == [{0, 1}]
