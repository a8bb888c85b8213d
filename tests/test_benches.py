"""The benchmark scripts that run on other machines (benches/device_check.sh), and what the
CPU profile compares."""

import pathlib

import pytest


def test_the_device_check_fits_one_command_and_fails_loudly(tmp_path):
    """benches/device_check.sh on a fresh GPU box: its default stages fit well within one
    10-minute command (checked before anything runs), no wheels is one line at once, and a
    failed stage makes it exit 1 naming the stage (it did exit 0)."""
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    script = root / "benches" / "device_check.sh"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"),
           "VENV": str(tmp_path / "venv"), "WHEELS": str(tmp_path / "no-wheels")}
    dry = subprocess.run(["bash", str(script)], env={**env, "DRY_RUN": "1"}, cwd=root,
                         capture_output=True, text=True, timeout=60)
    stages = dict(line.split() for line in dry.stdout.splitlines()
                  if not line.startswith("total"))
    assert dry.returncode == 0 and "install" in stages
    assert sum(map(int, stages.values())) <= 480
    none = subprocess.run(["bash", str(script)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=60)
    assert none.returncode == 2 and "no wheels" in none.stderr
    failing = subprocess.run(["bash", str(script)], env={**env, "PYTHON": "false"}, cwd=root,
                             capture_output=True, text=True, timeout=120)
    assert failing.returncode == 1
    assert "FAILED stages: devices" in failing.stderr
    assert "no PyTorch" in failing.stdout


def test_the_framework_ceiling_compares_the_same_gradients():
    """profile_cpu's plain JAX vs plain PyTorch dense chain computes one gradient in both
    (it raises otherwise) and reports positive rates."""
    pytest.importorskip("torch")
    from benches.profile_cpu import dense_chain

    r = dense_chain(layers=2, n=64, d=16, f=32, repeats=1)
    assert r["ours_gflops"] > 0 and r["torch_gflops"] > 0 and r["layers"] == 2


def test_the_lsr_run_is_costed_from_the_programs_arithmetic():
    """benches/lsr_cost: at the paper's shapes the LM's scoring of 1,280 sequences of 384
    tokens is the device's work per step, by hand: 1,280 × 384 × Llama-2-7B's forward flops
    per token over 8 chips at the chip's peak; the refresh is amortised over 3,000 steps."""
    from benches.lsr_cost import PAPER, SHAPES, device_seconds
    from replug_jax.compile_check import CHIPS
    from replug_jax.lm.memory import read_lm_config
    from replug_jax.models.bert import BertConfig

    lm = read_lm_config(SHAPES / "llama-2-7b.json")
    chip = CHIPS["NVIDIA H100 80GB HBM3"]
    d = device_seconds(lm, BertConfig(), chip, 8, lm_calls=20)
    d_model, layers, ff = 4096, 32, 11008
    per_token = layers * (2 * (4 * d_model * d_model + 3 * d_model * ff)
                          + 4 * d_model * 384) + 2 * d_model * 32000
    assert d["flops"]["lm_score"] == pytest.approx(1280 * 384 * per_token / 8)
    assert d["roofline"]["lm_score"] == pytest.approx(1280 * 384 * per_token / 8 / 989.4e12)
    assert max(d["roofline"], key=d["roofline"].get) == "lm_score"
    refresh = PAPER["corpus"] * 128 * BertConfig().flops_per_token(128) / 8 / 989.4e12
    assert d["roofline"]["refresh_encode"] == pytest.approx(refresh / PAPER["refresh_every"])
