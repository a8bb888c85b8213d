"""Which step an LSR run keeps (replug_jax/train/selection.py), on hand-made dev curves: the
rule of each `select_on`, the recall@1 guard, patience, and the logs read back after a cut."""

import json

import numpy as np
import pytest

from replug_jax.train.selection import Curve, Selection, read_jsonl

CURVE = [  # step 0 is the base retriever
    {"step": 0, "dev_bpb": 1.00, "dev_loglik": -15.0, "dev_recall@1": 0.50},
    {"step": 100, "dev_bpb": 0.98, "dev_loglik": -14.9, "dev_recall@1": 0.52},
    {"step": 200, "dev_bpb": 0.99, "dev_loglik": -15.2, "dev_recall@1": 0.56},  # guard fails
    {"step": 300, "dev_bpb": 0.97, "dev_loglik": -14.8, "dev_recall@1": 0.53},
    {"step": 400, "dev_bpb": 0.99, "dev_loglik": -14.95, "dev_recall@1": 0.51},
]


@pytest.mark.parametrize("select_on, best, since", [
    ("last", 400, 0),  # a fixed budget: the last point
    ("pool_loglik", 300, 1),  # the lowest dev bits per byte
    ("recall@1", 300, 1),  # 0.56 at step 200 is not eligible: its log-likelihood fell
])
def test_each_rule_keeps_the_step_it_names(select_on, best, since):
    assert Selection(select_on, patience=0).replay(CURVE) == (best, since)


def test_the_base_is_kept_when_no_step_beats_it_and_patience_stops_the_run():
    flat = [dict(CURVE[0])] + [{**CURVE[0], "step": s, "dev_bpb": 1.01} for s in (1, 2, 3)]
    rule = Selection("pool_loglik", patience=2)
    assert rule.replay(flat) == (0, 3)
    assert rule.stops(2) and not rule.stops(1)
    assert not Selection("pool_loglik", patience=0).stops(10)  # 0: never early
    assert not Selection("last", patience=1).stops(5)  # a fixed budget runs to its end


def test_a_curve_keeps_the_best_parameters_and_resumes_to_the_same_choice(tmp_path):
    like = {"w": np.zeros(3, np.float32)}
    curve = Curve(tmp_path, Selection("pool_loglik", patience=0))
    for entry in CURVE:
        curve.add(entry, {"w": np.full(3, entry["step"], np.float32)})
    entry, params = curve.best(like)
    assert entry["step"] == 300 and np.all(params["w"] == 300)
    again = Curve(tmp_path, Selection("pool_loglik", patience=0))
    again.resume(200)  # a restore to step 200: later points are redone
    assert [p["step"] for p in again.points] == [0, 100, 200]
    assert [p["step"] for p in read_jsonl(tmp_path / "curve.jsonl")] == [0, 100, 200]


def test_a_log_cut_at_its_end_is_read_but_damage_inside_is_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0}) + "\n" + '{"step": 1, "lo')
    assert read_jsonl(path) == [{"step": 0}]
    path.write_text('{"step": 0, "lo\n' + json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl, line 1: not JSON"):
        read_jsonl(path)
    assert read_jsonl(tmp_path / "absent.jsonl") == []
