"""The golden run of the LSR trainer on a pre-scored pool (issue 65, item 1): the losses of
the first steps, the dev curve and the parameters' total change, recorded on CPU float32 from
the pool trainer before the two trainers were merged, so that the merged trainer is shown to
train exactly as the one every published LSR result came from."""

import numpy as np
import pytest

from tests.test_pool import _examples, _pool

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


@pytest.mark.parametrize("towers,objective", sorted(GOLDEN))
def test_the_pool_trainer_reproduces_its_golden_run(tiny, tmp_path, towers, objective):
    import jax

    from replug_jax.train.pool import PoolTrainConfig, train_on_pool

    pool, passages = _pool(tiny, tmp_path / "pool")
    cfg = PoolTrainConfig(objective=objective, k=2, steps=4, batch_size=2, refresh_every=2,
                          eval_every=1, patience=10, learning_rate=1e-3, towers=towers,
                          lm_score="sum" if objective == "marginal" else "mean",
                          early_stop=False)
    fit = train_on_pool(tiny[1], pool, _examples(), pool, _examples(),
                        {p.id: p for p in passages}, cfg, progress=False)
    losses, dev_bpb, delta = GOLDEN[towers, objective]
    np.testing.assert_allclose([c["loss"] for c in fit["curve"][1:]], losses, rtol=2e-5)
    np.testing.assert_allclose([c["dev_bpb"] for c in fit["curve"]], dev_bpb, rtol=2e-6)
    moved = sum(float(np.abs(np.asarray(a) - np.asarray(b)).sum())
                for a, b in zip(jax.tree.leaves(fit["params"]), jax.tree.leaves(tiny[1].params)))
    assert moved == pytest.approx(delta, rel=1e-4)
