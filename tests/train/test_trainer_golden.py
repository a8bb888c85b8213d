"""The golden run of the LSR trainer on a pre-scored pool (issue 65, item 1): the losses of
the first steps, the dev curve and the parameters' total change, recorded on CPU float32 from
the pool trainer (``train_on_pool``) before the two trainers were merged, so that the merged
trainer is shown to train exactly as the one every published LSR result came from."""

import numpy as np
import pytest

from tests._pools import pool_trainer

pytestmark = pytest.mark.models

# (towers, objective) -> (loss of steps 1..4, dev bits per byte at steps 0..4, Σ|Δθ|)
GOLDEN = {
    ("shared", "kl_retriever_to_lm"): (
        [1.3227373, 1.0419167, 2.25494, 0.0642126],
        [4.3191063, 4.3191063, 4.3190047, 4.2902857, 4.2902475], 14.072509717312641),
    ("shared", "marginal"): (
        [22.1256561, 21.3092728, 21.3024826, 22.1250877],
        [4.3191063, 4.3191063, 4.3190067, 4.2902966, 4.2902527], 14.199705310398713),
    ("query", "kl_retriever_to_lm"): (
        [1.3227373, 1.0419167, 2.1569977, 0.067914],
        [4.3191063, 4.3191063, 4.3188338, 4.3376901, 4.3177956], 13.98153210838791),
    ("query", "marginal"): (
        [22.1256561, 21.3092728, 21.2865829, 22.1240826],
        [4.3191063, 4.3191063, 4.3188365, 4.3186, 4.2987872], 14.189149166806601),
}


@pytest.fixture(scope="module")
def tiny():
    from tests._models import tiny_lm, tiny_retriever

    return tiny_lm(0), tiny_retriever(0)


def _trainer(tiny, tmp_path, towers, objective, **kw):
    return pool_trainer(tiny, tmp_path, objective, towers, **kw)


def _moved(tiny, params) -> float:
    import jax

    return sum(float(np.abs(np.asarray(a) - np.asarray(b)).sum())
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(tiny[1].params)))


@pytest.mark.parametrize("towers,objective", sorted(GOLDEN))
def test_the_one_trainer_reproduces_the_pool_trainers_golden_run(tiny, tmp_path, towers,
                                                                   objective):
    """The merged trainer (``LSRTrainer``, ``supervision="pool"``) trains exactly as the pool
    trainer did: the same losses, dev curve and parameters."""
    trainer = _trainer(tiny, tmp_path, towers, objective)
    result = trainer.run()
    losses, dev_bpb, delta = GOLDEN[towers, objective]
    curve = result["curve"]
    assert [c["step"] for c in curve] == [0, 1, 2, 3, 4] and result["best_step"] == 4
    np.testing.assert_allclose([c["loss"] for c in curve[1:]], losses, rtol=2e-5)
    np.testing.assert_allclose([c["dev_bpb"] for c in curve], dev_bpb, rtol=2e-6)
    _, params = trainer.best_params()
    assert _moved(tiny, params) == pytest.approx(delta, rel=1e-4)


@pytest.mark.parametrize("towers", ["shared", "query"])
def test_a_pool_run_killed_after_a_checkpoint_resumes_to_the_same_run(tiny, tmp_path, towers):
    """Stopped after 3 steps (checkpointed every step), a new trainer on the same work folder
    resumes at step 3, reads the same curve back and ends with the golden run's numbers (the
    shared encoder's pool embeddings from the refresh before the restart, not re-embedded)."""
    _trainer(tiny, tmp_path, towers, "kl_retriever_to_lm").run(stop_after=3)
    result = _trainer(tiny, tmp_path, towers, "kl_retriever_to_lm").run()
    losses, dev_bpb, delta = GOLDEN[towers, "kl_retriever_to_lm"]
    np.testing.assert_allclose([c["loss"] for c in result["curve"][1:]], losses, rtol=2e-5)
    np.testing.assert_allclose([c["dev_bpb"] for c in result["curve"]], dev_bpb, rtol=2e-6)
    again = _trainer(tiny, tmp_path, towers, "kl_retriever_to_lm").run()  # finished: no step
    assert again["step"] == 4 and again["last"] == {}


def test_a_metrics_log_cut_mid_line_resumes(tiny, tmp_path):
    """Issue 67: a metrics.jsonl (or curve.jsonl) ending in a cut line, as an interrupted
    append or a full disk leaves it, is read to its last whole line; the resumed run ends
    where an uninterrupted one does."""
    import json

    first = _trainer(tiny, tmp_path, "query", "kl_retriever_to_lm", checkpoint_every=2)
    first.run(stop_after=2)
    for name in ("metrics.jsonl", "curve.jsonl"):
        with open(tmp_path / "run" / name, "a") as f:
            f.write('{"step": 2, "loss": 0.12')  # no newline, no closing brace
    again = _trainer(tiny, tmp_path, "query", "kl_retriever_to_lm", checkpoint_every=2)
    result = again.run()
    assert result["step"] == 4
    steps = [json.loads(line)["step"] for line in
             (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]
