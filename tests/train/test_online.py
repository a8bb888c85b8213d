"""Online supervision (replug_jax/train/online.py): pairs scored up front for the steps to
come (supervision.prescore_pool) are the pairs the steps use, so the steps score none, and
the run is the same run as without it."""

import json

import numpy as np

from replug_jax.train.online import OnlineSupervision
from tests.helpers import BASE, TRAIN, make_trainer, metrics_of


def test_prescoring_pays_up_front_for_the_same_run(tmp_path):
    cfg = BASE.updated({"total_steps": 2, "retrieval.refresh_every": 3})  # no refresh yet
    plain = make_trainer(tmp_path, "plain", cfg)
    assert isinstance(plain, OnlineSupervision)
    plain.run()
    ahead = make_trainer(tmp_path, "ahead", cfg.updated({"supervision.prescore_pool": 6}))
    ahead.run()
    info = json.loads((ahead.workdir / "prescore.json").read_text())
    rows = [e for s in range(2) for e in ahead.step_examples(s)[0]]
    assert info["examples"] == len({e.id for e in rows}) <= len(TRAIN)
    # every example's top-6, each distinct (x, y, d) scored once: examples of one topic
    # share their x and y, so their pairs too
    assert info["new_pairs"] == 6 * len({(e.context, e.continuation) for e in rows})
    first, later = metrics_of(plain), metrics_of(ahead)
    assert [r["lm_new_pairs"] for r in later] == [0, 0]
    assert first[0]["lm_new_pairs"] > 0
    np.testing.assert_allclose([r["loss"] for r in later], [r["loss"] for r in first],
                               rtol=1e-6)
