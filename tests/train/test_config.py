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
    with pytest.raises(ConfigError, match="unknown config key 'optim.learning_rat'; did you "
                                          "mean 'optim.learning_rate'"):
        load(str(ok), ["optim.learning_rat=1e-4"])
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
            "c = LSRConfig.from_tree({'lm.mesh': 'data=2,model=4', 'objective.gamma': 0.5})\n"
            "assert c.objective.gamma == 0.5 and c.optim.learning_rate == 2e-5\n"
            "c.fingerprint.__doc__\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', "
            "'optax')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_the_trainers_pieces_and_the_temperatures_as_research_variables():
    """The tree's pieces and the study's objective names describe the same ObjectiveConfig /
    OptimConfig; γ is a number, "fitted" or "learned", β a number or "fitted", Q the sum by
    default (the paper's P_LM(y|d,x)); a bad piece is refused where it is declared, a bad
    combination where the run is."""
    from replug_jax.train.config import LSRConfig, SupervisionConfig
    from replug_jax.train.spec import ObjectiveConfig, OptimConfig

    online = LSRConfig.from_tree({
        "objective": {"direction": "lm_to_retriever", "gamma": 1.0, "beta": 0.5,
                      "lm_score": "mean"},
        "optim": {"learning_rate": 1e-4, "warmup_ratio": 0.2, "grad_clip": 0.5}})
    assert online.objective == ObjectiveConfig.named(
        "kl_lm_to_retriever", 1.0, 0.5, "mean") == ObjectiveConfig(
        "kl", "lm_to_retriever", 1.0, 0.5, "mean")
    assert online.optim == OptimConfig("adam", 1e-4, 0.0, 0.2, 0.5)
    assert LSRConfig().objective.lm_score == "sum" == ObjectiveConfig().lm_score
    with pytest.raises(ValueError, match="objective must be one of"):
        ObjectiveConfig.named("kl", 0.1, 0.1, "sum")
    with pytest.raises(ValueError, match="gamma must be > 0 or one of"):
        ObjectiveConfig(gamma=0.0)
    with pytest.raises(ValueError, match="beta must be > 0 or one of"):
        ObjectiveConfig(beta="learned")  # a learned β is not offered
    pool = SupervisionConfig(kind="pool", train_pool="p", dev_pool="d")
    learned = LSRConfig(objective=ObjectiveConfig(gamma="learned", beta="fitted"),
                        supervision=pool).objective
    assert learned.learns_gamma and learned.needs_fit
    fixed = learned.resolved(tau=0.02, beta=2.0)
    assert (fixed.gamma, fixed.beta, fixed.learns_gamma, fixed.needs_fit) == \
        (0.02, 2.0, True, False)
    with pytest.raises(ValueError, match="need supervision.dev_pool"):
        LSRConfig(objective=ObjectiveConfig(gamma="fitted"),
                  supervision=SupervisionConfig(kind="pool", train_pool="p"))
    with pytest.raises(ValueError, match=r"bad config: supervision: .*need kind='pool'"):
        SupervisionConfig(towers="query")
    with pytest.raises(ValueError, match="warmup_ratio"):
        OptimConfig(warmup_ratio=1.0)
    schedule = OptimConfig(learning_rate=1.0, warmup_ratio=0.5).schedule(10)
    assert [float(schedule(s)) for s in (0, 5, 10)] == [0.0, 1.0, 0.0]


def test_one_tree_from_set_json_and_python_and_old_flat_names_refused_naming_the_new(tmp_path):
    """Issue 65: ``objective.gamma=1`` (CLI), ``{"objective": {"gamma": 1}}`` and
    ``{"objective.gamma": 1}`` (JSON) and the Python pieces are one config; every flat name
    of earlier releases is refused in one line naming its new key."""
    from replug_jax.config import ConfigError, apply_overrides, load
    from replug_jax.train.config import LMConfig, LSRConfig, RetrievalConfig
    from replug_jax.train.spec import ObjectiveConfig, OptimConfig

    python = LSRConfig(objective=ObjectiveConfig(gamma=1.0), lm=LMConfig(dtype="bfloat16"),
                       retrieval=RetrievalConfig(index_factory="IVF16,Flat"),
                       optim=OptimConfig(learning_rate=1e-4))
    dotted = apply_overrides(LSRConfig(), ["objective.gamma=1", "lm.dtype=bfloat16",
                                           "retrieval.index_factory=IVF16,Flat",
                                           "optim.learning_rate=1e-4"])
    assert dotted == python and dotted.fingerprint() == python.fingerprint()
    nested = tmp_path / "nested.json"
    nested.write_text('{"objective": {"gamma": 1.0}, "lm": {"dtype": "bfloat16"}, '
                      '"retrieval.index_factory": "IVF16,Flat", "optim.learning_rate": 1e-4}')
    assert load(str(nested), cls=LSRConfig)[0] == python
    for old, new in LSRConfig.RENAMED.items():  # every retired name, from --set and JSON
        with pytest.raises(ConfigError, match=f"^config key '{old}' is now '{new}'$"):
            apply_overrides(LSRConfig(), [f"{old}=1"])
        with pytest.raises(ConfigError, match=f"config key '{old}' is now '{new}'$"):
            LSRConfig.from_tree({old: 1})
    with pytest.raises(ConfigError, match="unknown config key 'objective.gama'; did you mean "
                                          "'objective.gamma'"):
        apply_overrides(LSRConfig(), ["objective.gama=1"])
    with pytest.raises(ConfigError, match="gamma must be > 0"):
        apply_overrides(LSRConfig(), ["objective.gamma=0"])
    with pytest.raises(ConfigError, match="optim is a group of settings: give an object of "
                                          "optim.optimizer, optim.learning_rate"):
        LSRConfig.from_tree({"optim": 2e-5})
    pool = apply_overrides(LSRConfig(), ["supervision.kind=pool", "supervision.train_pool=p",
                                         "supervision.dev_pool=d", "objective.gamma=fitted",
                                         "objective.beta=0.5", "selection.metric=pool_loglik"])
    assert (pool.supervision.kind, pool.objective.gamma, pool.objective.beta,
            pool.selection.metric) == ("pool", "fitted", 0.5, "pool_loglik")


def test_a_stored_flat_run_record_loads_and_keeps_its_fingerprint():
    """Nothing stored is lost: a run's config.json written before the pieces (flat names)
    loads through ``from_record`` and hashes as it did (the hash below was computed by the
    flat LSRConfig of the release before the tree, on this record); the tree round-trips."""
    import json

    from replug_jax.train.config import LSRConfig

    flat = {"retriever": "minilm", "lm": "smollm2", "k": 4, "gamma": 0.05, "beta": 1.0,
            "lm_score": "sum", "objective": "kl", "direction": "retriever_to_lm",
            "supervision": "pool", "train_pool": "w:train", "dev_pool": "w:dev",
            "towers": "query", "select_on": "recall@1", "patience": 0, "eval_every": 100,
            "eval_tau": 0.0, "tau_grid": [0.01, 0.02], "total_steps": 1000, "batch_size": 16,
            "num_devices": 1, "checkpoint_every": 100, "keep_checkpoints": 1}
    cfg = LSRConfig.from_record(flat)
    assert (cfg.retriever.name, cfg.objective.gamma, cfg.supervision.towers,
            cfg.selection.every, cfg.selection.tau_grid) == ("minilm", 0.05, "query", 100,
                                                             (0.01, 0.02))
    assert cfg.flat()["select_on"] == "recall@1" and cfg.flat()["data"] == ""
    assert cfg.fingerprint() == FLAT_RECORD_FINGERPRINT
    again = LSRConfig.from_record(json.loads(json.dumps(cfg.to_json())))
    assert again == cfg and again.fingerprint() == cfg.fingerprint()


def test_a_json_value_of_the_wrong_type_is_refused_when_the_config_is_read(tmp_path):
    """Issue 67: `{"k": "4"}`, `{"lm": {"mesh": 8}}`, `{"k": 4.5}`, a null γ named with
    their key at load time (not a traceback after the models load); right types still load."""
    import json

    from replug_jax.config import ConfigError, load
    from replug_jax.train.config import LSRConfig

    path = tmp_path / "c.json"
    for body, message in (({"k": "4"}, "k expects an integer, got '4'"),
                          ({"lm": {"mesh": 8}}, "mesh expects a string, got 8"),
                          ({"k": 4.5}, "k expects an integer, got 4.5"),
                          ({"objective.gamma": None}, "gamma cannot be null"),
                          ({"remat": "yes"}, "remat expects true or false or null"),
                          ({"objective": {"gamma": [1]}}, "gamma expects a number or a name")):
        path.write_text(json.dumps(body))
        with pytest.raises(ConfigError, match=re.escape(message)):
            load(str(path), cls=LSRConfig)
    path.write_text(json.dumps({"k": 4.0, "objective.gamma": 1, "objective": {"beta": 0.5},
                                "remat": None}))
    cfg, _ = load(str(path), cls=LSRConfig)
    assert (cfg.k, cfg.objective.gamma, cfg.objective.beta, cfg.remat) == (4, 1.0, 0.5, None)
    assert isinstance(cfg.k, int) and isinstance(cfg.objective.gamma, float)


# LSRConfig(**flat).fingerprint() of test_a_stored_flat_run_record...'s record, computed by
# the flat LSRConfig (commit ef9cd0c) before the tree replaced it
FLAT_RECORD_FINGERPRINT = "35cfc256736844cc"
