"""Builders the test modules share (fixtures are in conftest.py): the tiny LSR setup (passages,
examples, the base config, a trainer), a free port, the release rule a card must meet,
clustered unit vectors, and two processes run as one JAX job on localhost."""

import hashlib
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np

from replug_jax.retrieval.corpus import Passage
from replug_jax.train.config import LSRConfig
from replug_jax.train.data import Example
from replug_jax.train.loop import LSRTrainer
from tests._models import tiny_lm, tiny_retriever

ROOT = str(pathlib.Path(__file__).resolve().parents[1])  # the repository

TOPICS = ["rivers of Europe", "capital cities", "volcanoes", "chess openings",
          "jazz musicians", "prime numbers", "tropical fruit", "medieval castles"]
PASSAGES = [Passage(i, f"A passage about {t}: fact number {j} about {t}.", source_id=str(i))
            for i, (t, j) in enumerate((t, j) for t in TOPICS for j in range(2))]
TRAIN = [Example(f"q{i}", f"Tell me about {TOPICS[i % 8]}", f"Question: {TOPICS[i % 8]}?\nAnswer:",
                 f" It is about {TOPICS[i % 8]}.", gold_doc=2 * (i % 8)) for i in range(16)]

BASE = LSRConfig.from_tree({
    "retriever": {"name": "tiny", "query_max_length": 16, "doc_max_length": 32},
    "lm.name": "tiny", "k": 4, "batch_size": 8, "total_steps": 6, "checkpoint_every": 2,
    "retrieval": {"refresh_every": 3, "refresh_mode": "sync"},
    "optim": {"learning_rate": 1e-3, "warmup_ratio": 0.0}, "seed": 0})


def make_trainer(tmp_path, name="run", cfg=BASE, **kw):
    retriever = kw.pop("retriever", None) or tiny_retriever(0)
    return LSRTrainer(cfg, tmp_path / name, retriever=retriever,
                      lm_scorer=kw.pop("lm", tiny_lm(0)), passages=kw.pop("passages", PASSAGES),
                      train=TRAIN, progress=False, **kw)


def params_of(trainer):
    return jax.tree.leaves(jax.device_get(trainer.state.params))


def metrics_of(trainer):
    return [json.loads(x) for x in (trainer.workdir / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_release_rule(folder: pathlib.Path) -> None:
    """A card with weights leads with "Better than its base" and an interval excluding zero
    in the retriever's favour (below zero for bits per byte; above zero where the card says
    higher is better); a card without weights leads with "Not better than its base"."""
    # a study's card (MODEL_CARD.md), or the card `replug export-retriever` writes
    # (README.md: its metadata block, its title, then the verdict)
    path = folder / "MODEL_CARD.md"
    card = (path if path.exists() else folder / "README.md").read_text()
    if card.startswith("---\n"):
        card = card.split("\n---\n", 1)[1].lstrip()
    body = card.split("\n", 1)[1].lstrip()
    weights = folder / "model.safetensors"
    if not weights.exists():
        assert body.startswith("**Not better than its base.**"), folder
        return
    assert body.removeprefix("**").startswith("Better than its base"), folder
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert digest in card, f"{folder}: the card lacks the weights' SHA-256 {digest}"
    interval = re.search(r"\[([−+-][\d.]+), ([−+-][\d.]+)\]", body)
    assert interval, folder
    low, high = (float(g.replace("−", "-")) for g in interval.groups())
    lead = body.split("\n\n", 1)[0]
    assert (low > 0 if "higher is better" in lead else high < 0), folder
    from replug_jax.retrieval.encoder import Retriever

    retriever = Retriever.load(str(folder))
    assert retriever.encode_queries(["a query"]).shape == (1, retriever.dim)


def clustered(n: int, d: int = 32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(16, d))
    x = centers[rng.integers(16, size=n)] + 0.3 * rng.normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


PRELUDE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import jax
    import numpy as np
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_compilation_cache_dir", {cache!r})
    jax.distributed.initialize(coordinator_address="127.0.0.1:{port}", num_processes=2,
                               process_id={pid})
    assert jax.process_count() == 2 and len(jax.devices()) == 8
    out = {out!r}
""")


def run_two(body: str, out: str, **fmt) -> None:
    port = free_port()
    cache = str(jax.config.jax_compilation_cache_dir or "/tmp/jaxcache")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen(
        [sys.executable, "-c", PRELUDE.format(root=ROOT, cache=cache, port=port, pid=pid,
                                               out=out) + body.format(**fmt)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        for pid in (0, 1)]
    for p in procs:
        try:
            _, err = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
