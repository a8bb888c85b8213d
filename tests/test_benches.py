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
