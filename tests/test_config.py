"""Config files and --set overrides (replug_jax/config.py): a typo is one line naming the
nearest field."""

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

