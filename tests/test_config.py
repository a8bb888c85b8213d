"""Config files and --set overrides (replug_jax/config.py): a typo is one line naming the
nearest field."""

import re

import pytest


def test_a_typo_in_a_config_file_or_a_set_key_is_one_line_with_the_nearest_names(tmp_path):
    from replug_jax.cli import main
    from replug_jax.config import ConfigError, load

    cfg = tmp_path / "cfg.py"
    cfg.write_text("from replug_jax.train.config import LSRConfig\n\n"
                   "CONFIGS = {'default': LSRConfig(totl_steps=10)}\n")
    with pytest.raises(ConfigError) as err:
        load(str(cfg))
    assert str(err.value) == (f"{cfg}:3: LSRConfig has no field 'totl_steps'; did you mean "
                              "'total_steps'?")
    ok = tmp_path / "ok.py"
    ok.write_text("from replug_jax.train.config import LSRConfig\n\n"
                  "CONFIGS = {'default': LSRConfig(total_steps=10)}\n")
    with pytest.raises(ConfigError, match="unknown config key 'learning_rat'; did you mean "
                                          "'learning_rate'"):
        load(str(ok), ["learning_rat=1e-4"])
    broken = tmp_path / "broken.py"
    broken.write_text("CONFIGS = {'default': undefined_name}\n")
    with pytest.raises(ConfigError, match=r"broken.py:1: NameError"):
        load(str(broken))
    assert main(["train-lsr", "--config", f"{cfg}:default", "--workdir",
                 str(tmp_path / "w")]) == 2



def test_an_lsr_config_is_read_without_jax():
    """Issue 51: a config (and its typed pieces) can be read and checked where JAX is not
    loaded; building the optimizer is what needs optax."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from replug_jax.train.config import LSRConfig, load_config\n"
            "c = LSRConfig(lm_mesh='data=2,model=4', gamma=0.5)\n"
            "assert c.objective_config.gamma == 0.5 and c.optim_config.learning_rate == 2e-5\n"
            "c.fingerprint.__doc__\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', "
            "'optax')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_the_trainers_pieces_and_the_temperatures_as_research_variables():
    """The flat fields and the study's objective names describe the same ObjectiveConfig /
    OptimConfig; γ is a number, "fitted" or "learned", β a number or "fitted", Q the sum by
    default (the paper's P_LM(y|d,x)); a bad piece is refused where the config is made."""
    from replug_jax.train.config import LSRConfig
    from replug_jax.train.spec import ObjectiveConfig, OptimConfig

    online = LSRConfig(direction="lm_to_retriever", gamma=1.0, beta=0.5, learning_rate=1e-4,
                       warmup_ratio=0.2, grad_clip=0.5, lm_score="mean")
    assert online.objective_config == ObjectiveConfig.named(
        "kl_lm_to_retriever", 1.0, 0.5, "mean") == ObjectiveConfig(
        "kl", "lm_to_retriever", 1.0, 0.5, "mean")
    assert online.optim_config == OptimConfig("adam", 1e-4, 0.0, 0.2, 0.5)
    assert LSRConfig().lm_score == "sum" and ObjectiveConfig().lm_score == "sum"
    with pytest.raises(ValueError, match="objective must be one of"):
        ObjectiveConfig.named("kl", 0.1, 0.1, "sum")
    with pytest.raises(ValueError, match="gamma must be > 0 or one of"):
        ObjectiveConfig(gamma=0.0)
    with pytest.raises(ValueError, match="beta must be > 0 or one of"):
        ObjectiveConfig(beta="learned")  # a learned β is not offered
    pool = dict(supervision="pool", train_pool="p", dev_pool="d")
    learned = LSRConfig(gamma="learned", beta="fitted", **pool).objective_config
    assert learned.learns_gamma and learned.needs_fit
    fixed = learned.resolved(tau=0.02, beta=2.0)
    assert (fixed.gamma, fixed.beta, fixed.learns_gamma, fixed.needs_fit) == \
        (0.02, 2.0, True, False)
    with pytest.raises(ValueError, match="need dev_pool"):
        LSRConfig(gamma="fitted", supervision="pool", train_pool="p")
    with pytest.raises(ValueError, match="need supervision='pool'"):
        LSRConfig(towers="query")
    with pytest.raises(ValueError, match="warmup_ratio"):
        OptimConfig(warmup_ratio=1.0)
    schedule = OptimConfig(learning_rate=1.0, warmup_ratio=0.5).schedule(10)
    assert [float(schedule(s)) for s in (0, 5, 10)] == [0.0, 1.0, 0.0]


def test_dotted_keys_set_a_pieces_field_and_old_flat_configs_hash_as_before(tmp_path):
    """``objective.gamma=1`` (CLI), ``{"objective": {"gamma": 1}}`` (JSON) and the flat
    ``gamma=1`` of configs written before the pieces are one config with one fingerprint."""
    from replug_jax.config import ConfigError, load
    from replug_jax.train.config import LSRConfig, apply_overrides

    flat = LSRConfig(gamma=1.0, lm_dtype="bfloat16", index_factory="IVF16,Flat",
                     learning_rate=1e-4)
    dotted = apply_overrides(LSRConfig(), ["objective.gamma=1", "lm.dtype=bfloat16",
                                           "index.factory=IVF16,Flat",
                                           "optim.learning_rate=1e-4"])
    assert dotted == flat and dotted.fingerprint() == flat.fingerprint()
    assert dotted.objective_config.gamma == 1.0 and dotted.optim_config.learning_rate == 1e-4
    nested = tmp_path / "nested.json"
    nested.write_text('{"objective": {"gamma": 1.0}, "lm": {"dtype": "bfloat16"}, '
                      '"index.factory": "IVF16,Flat", "learning_rate": 1e-4}')
    assert load(str(nested), cls=LSRConfig)[0] == flat
    with pytest.raises(ConfigError, match="unknown config key 'objective.gama'; did you mean "
                                          "'objective.gamma'"):
        apply_overrides(LSRConfig(), ["objective.gama=1"])
    with pytest.raises(ConfigError, match="gamma must be > 0"):
        apply_overrides(LSRConfig(), ["objective.gamma=0"])
    pool = apply_overrides(LSRConfig(), ["supervision.kind=pool", "supervision.train_pool=p",
                                         "supervision.dev_pool=d", "objective.gamma=fitted",
                                         "objective.beta=0.5", "selection.metric=pool_loglik"])
    assert (pool.supervision, pool.gamma, pool.beta, pool.select_on) == \
        ("pool", "fitted", 0.5, "pool_loglik")


def test_a_json_value_of_the_wrong_type_is_refused_when_the_config_is_read(tmp_path):
    """Issue 67: `{"k": "4"}`, `{"lm_mesh": 8}`, `{"k": 4.5}`, `{"gamma": null}` named with
    their key at load time (not a traceback after the models load); right types still load."""
    import json

    from replug_jax.config import ConfigError, load
    from replug_jax.train.config import LSRConfig

    path = tmp_path / "c.json"
    for body, message in (({"k": "4"}, "k expects an integer, got '4'"),
                          ({"lm_mesh": 8}, "lm_mesh expects a string, got 8"),
                          ({"k": 4.5}, "k expects an integer, got 4.5"),
                          ({"gamma": None}, "gamma cannot be null"),
                          ({"remat": "yes"}, "remat expects true or false or null"),
                          ({"objective": {"gamma": [1]}}, "gamma expects a number or a name")):
        path.write_text(json.dumps(body))
        with pytest.raises(ConfigError, match=re.escape(message)):
            load(str(path), cls=LSRConfig)
    path.write_text(json.dumps({"k": 4.0, "gamma": 1, "objective": {"beta": 0.5},
                                "remat": None}))
    cfg, _ = load(str(path), cls=LSRConfig)
    assert (cfg.k, cfg.gamma, cfg.beta, cfg.remat) == (4, 1.0, 0.5, None)
    assert isinstance(cfg.k, int) and isinstance(cfg.gamma, float)
