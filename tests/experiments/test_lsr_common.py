"""experiments/lib/lsr_common.py: the variant a registered config names by its rule."""

import dataclasses
import json

import pytest

from experiments.configs.lsr_qa import CONFIGS
from experiments.lib.lsr_common import label, registered_variant, variants


def _row(objective, direction, gamma, beta, recall, loglik, lm_score="sum"):
    return {"config": {"objective": objective, "direction": direction, "gamma": gamma,
                       "beta": beta, "lm_score": lm_score, "total_steps": 1000},
            "dev_recall@1": recall, "dev_pool_loglik": loglik}


def _study(tmp_path, rows, finished):
    path = tmp_path / "default.json"
    path.write_text(json.dumps({"finished": finished, "rows": rows}))
    return dataclasses.replace(CONFIGS["tau_confirm"], variant_from=str(path))


def test_the_registered_rule_picks_the_best_dev_recall_then_loglik_then_order(tmp_path):
    rows = [_row("kl", "retriever_to_lm", "fitted", 1.0, 0.548, -15.47),
            _row("marginal", "retriever_to_lm", 0.05, 1.0, 0.552, -15.43),
            _row("kl", "retriever_to_lm", 0.05, 1.0, 0.552, -15.33),  # tie: better loglik
            _row("kl", "retriever_to_lm", "learned", "fitted", 0.552, -15.33)]  # later
    cfg = registered_variant(_study(tmp_path, rows, "4 of 4 variants"))
    assert cfg.objectives == ("kl_retriever_to_lm",)
    assert cfg.grid == ((0.05, 1.0),) and cfg.train.objective.lm_score == "sum"
    runs = [v for v in variants(cfg) if not v.supervision.shuffle_q]
    assert [label(v) for v in runs] == ["kl_retriever_to_lm/γ=0.05/β=1/Q=sum"]
    # the shuffled-Q control is the same variant, trained a fixed budget
    control = [v for v in variants(cfg) if v.supervision.shuffle_q]
    assert len(control) == 1 and control[0].total_steps == cfg.control_steps
    assert control[0].selection.metric == "last"

    rows[1]["dev_recall@1"] = 0.560  # the marginal likelihood now leads: it has no β
    cfg = registered_variant(_study(tmp_path, rows, "4 of 4 variants"))
    assert cfg.objectives == ("marginal",) and cfg.grid == ((0.05, 1.0),)


def test_the_rule_refuses_a_partial_or_missing_study(tmp_path):
    rows = [_row("kl", "retriever_to_lm", 0.05, 1.0, 0.552, -15.33)]
    with pytest.raises(ValueError, match="not finished"):
        registered_variant(_study(tmp_path, rows, "1 of 15 variants (partial result)"))
    with pytest.raises(ValueError, match="not finished"):
        registered_variant(_study(tmp_path, [], "0 of 15 variants"))
    cfg = dataclasses.replace(CONFIGS["tau_confirm"], variant_from=str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match="no such results file"):
        registered_variant(cfg)


def test_the_registered_config_selects_as_its_temperature_study_trained():
    """tau_confirm's variant is trained with the temperature study's settings (budget,
    cadence, selection, Q), so the study's dev numbers are what it registered on."""
    from experiments.configs.lsr_temperature import CONFIGS as TEMPERATURE

    reg, study = CONFIGS["tau_confirm"], TEMPERATURE["default"]
    assert reg.train == study.train  # one training config: budget, cadence, selection, Q
    assert (reg.recall_dev, reg.seed) == (study.recall_dev, study.seed)
    assert reg.train.selection.patience == 0 and reg.train.selection.tau == 0.0
    assert (reg.test_source, reg.test_articles, reg.test_skip_articles) == (
        "unused_train", 120, 0)  # `confirm`'s draw, never run
    base = CONFIGS[study.study]
    assert (reg.max_train, reg.max_dev, reg.dev_articles, reg.train_articles) == (
        base.max_train, base.max_dev, base.dev_articles, base.train_articles)


def test_a_study_config_holds_its_training_config_in_one_vocabulary():
    """A study's training settings live in its ``train`` piece, addressed as the trainer's
    (``--set train.total_steps=…``); a study's old flat name is refused naming the new key;
    a results file written with the flat names still reads, into the same tree; a piece whose
    default is a template keeps the template's other settings when a JSON tree changes one."""
    from experiments.configs.lsr_qa import QAStudyConfig
    from replug_jax import config

    tiny = CONFIGS["tiny"]
    cfg = config.apply_overrides(tiny, ["train.total_steps=7", "train.objective.gamma=0.5"])
    assert (cfg.train.total_steps, cfg.train.objective.gamma, cfg.train.k) == (7, 0.5, 2)
    assert all(v.total_steps == 7 and v.k == 2 for v in variants(cfg))
    with pytest.raises(config.ConfigError, match="'steps' is now 'train.total_steps'"):
        config.apply_overrides(tiny, ["steps=7"])
    old = {"k": 2, "steps": 4, "eval_every": 2, "select_on": "recall@1", "lm_score": "sum",
           "tau_grid": [0.1, 1.0], "retriever": "minilm", "lm_max_context": 512,
           "grid": [[0.1, 0.1]], "max_train": 8}
    read = config.from_record(QAStudyConfig, old)
    assert read.train.selection == dataclasses.replace(
        read.train.selection, metric="recall@1", every=2, tau_grid=(0.1, 1.0))
    assert (read.train.k, read.train.total_steps, read.train.lm.max_context,
            read.train.objective.lm_score, read.grid) == (2, 4, 512, "sum", ((0.1, 0.1),))
    assert read.train.retriever.doc_max_length == 512  # the template's, kept
    built = config.build(QAStudyConfig, {"train": {"k": 3}})
    assert built.train == QAStudyConfig().train.updated({"k": 3})
    assert config.from_record(QAStudyConfig, dataclasses.asdict(cfg)) == cfg  # new records


@pytest.mark.parametrize("study", ["lsr_qa", "lsr_study", "lsr_temperature"])
def test_every_committed_study_result_reads_back_into_its_config(study):
    """Results written with the flat names of earlier releases read into today's tree (the
    temperature study's into exactly its current default training config)."""
    import importlib
    import pathlib

    from replug_jax import config

    configs = importlib.import_module(f"experiments.configs.{study}")
    cls = type(configs.CONFIGS["default"])
    results = sorted((pathlib.Path(__file__).parents[2] / "experiments" / "results" / study)
                     .glob("*.json"))
    assert results
    for path in results:
        read = config.from_record(cls, json.loads(path.read_text())["config"])
        assert isinstance(read.train.total_steps, int)
    if study == "lsr_temperature":
        assert read.train == configs.CONFIGS["default"].train
