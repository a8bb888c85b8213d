"""Two processes x 4 CPU devices (jax.distributed on localhost, gloo collectives) give what one
process with 8 devices gives: the sharded exact top-k, and LSR steps across an index refresh."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from tests.helpers import free_port, run_two


from tests.helpers import ROOT  # noqa: E402 (the repository)

_TOPK = textwrap.dedent("""
    from replug_jax.retrieval import corpus_rows, shard_corpus, sharded_topk
    from replug_jax.sharding import host_copy, make_mesh
    from tests.helpers import clustered
    emb, queries = clustered(1003, d=32), clustered(16, d=32, seed=2)
    mesh = make_mesh()
    mine = emb[corpus_rows(len(emb), mesh)]  # this process never sees the other rows
    corpus, n = shard_corpus(mine, mesh, dtype=np.float32, n=len(emb))
    scores, rows = host_copy(sharded_topk(queries, corpus, 20, n, mesh, block=50))
    if jax.process_index() == 0:
        np.savez(out, scores=scores, rows=rows, local=len(mine))
""")

_LSR = textwrap.dedent("""
    import pathlib
    from tests.helpers import BASE, PASSAGES, make_trainer
    from replug_jax.retrieval.store import PassageStore
    from replug_jax.sharding import host_copy
    cfg = BASE.updated({overrides!r})
    store = {store!r}  # a passage store file both processes read, or None: the list
    api = {api!r}  # a served LM's URL (prompt lists per request), or None: the tiny LM
    kw = {{}}
    if api:
        from replug_jax.lm.api_scorer import APIScorer
        kw["lm"] = APIScorer.connect(api, model="smollm2", tokenizer="smollm2",
                                     max_context=512, batch_size=4)
    t = make_trainer(pathlib.Path(out), "two", cfg,
                     passages=PassageStore.open(store) if store else PASSAGES, **kw)
    t.run()
    if jax.process_index() == 0:
        leaves = jax.tree_util.tree_flatten_with_path(host_copy(t.state.params))[0]
        np.savez(pathlib.Path(out) / "params.npz",
                 **{{jax.tree_util.keystr(p): v for p, v in leaves}})
""")


def _assert_two_equal_one(tmp_path, one) -> None:
    """The parameters the two-process run saved equal ``one``'s (the attention key bias
    skipped: zero true gradient, see test_eight_devices_equal_one)."""
    two = np.load(tmp_path / "params.npz")
    for path, a in jax.tree_util.tree_flatten_with_path(jax.device_get(one.state.params))[0]:
        name = jax.tree_util.keystr(path)
        if "['key']['bias']" not in name:
            np.testing.assert_allclose(two[name], a, atol=1e-5, err_msg=name)


def _need_eight():
    if len(jax.devices()) < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


@pytest.mark.slow
def test_two_processes_sharded_topk_equals_one_process(tmp_path):
    _need_eight()
    from replug_jax.retrieval import shard_corpus, sharded_topk
    from replug_jax.sharding import make_mesh
    from tests.helpers import clustered

    out = str(tmp_path / "topk.npz")
    run_two(_TOPK, out)
    two = np.load(out)
    emb, queries = clustered(1003, d=32), clustered(16, d=32, seed=2)
    mesh = make_mesh(8)
    corpus, n = shard_corpus(emb, mesh, dtype=np.float32)
    scores, rows = sharded_topk(queries, corpus, 20, n, mesh, block=50)
    assert int(two["local"]) == 504  # half of the corpus padded to 1008 rows
    np.testing.assert_array_equal(two["rows"], np.asarray(rows))
    np.testing.assert_allclose(two["scores"], np.asarray(scores), atol=1e-6)


@pytest.mark.slow
def test_two_processes_lsr_equals_one_process_across_a_refresh(tmp_path):
    _need_eight()
    from tests.helpers import BASE, make_trainer, metrics_of

    overrides = {"num_devices": 8, "total_steps": 5, "retrieval.refresh_every": 2,
                 "retrieval.index_backend": "jax", "retrieval.index_dtype": "float32"}
    run_two(_LSR, str(tmp_path), overrides=overrides, store=None, api=None)
    one = make_trainer(tmp_path, "one", BASE.updated(overrides))
    one.run()
    two = np.load(tmp_path / "params.npz")
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(one.state.params))[0]
    assert len(flat) == len(two.files)
    for path, a in flat:
        name = jax.tree_util.keystr(path)
        if "['key']['bias']" in name:  # zero true gradient: see test_eight_devices_equal_one
            continue
        np.testing.assert_allclose(two[name], a, atol=1e-5, err_msg=name)
    log_two = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text()
               .splitlines()]
    log_one = metrics_of(one)
    assert [r["step"] for r in log_two] == list(range(5))
    # float32 sums in another order: step 0's loss, before any update, differs by 4e-6 of
    # itself under jax 0.10.2 (3e-5 nats of 7.9); later steps differ no more than that
    for ra, rb in zip(log_one, log_two):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["gold_in_topk"] == rb["gold_in_topk"]  # the same passages retrieved
        assert ra["index_version"] == rb["index_version"]
    # each process caches the LM scores of its own rows: a pair that the other process scored
    # earlier is scored again, never fewer
    assert sum(r["lm_new_pairs"] for r in log_two) >= sum(r["lm_new_pairs"] for r in log_one)
    assert log_two[-1]["index_version"] == 2  # two refreshes crossed
    assert list((tmp_path / "two" / "lm_scores.p1").glob("part-*.npz"))


@pytest.mark.slow
@pytest.mark.models
def test_two_process_index_build_splits_embedding_and_shards(tmp_path):
    """`replug index build` under jax.distributed (the standard JAX_* environment): each process
    embeds its own embedding shards and builds its own FAISS shard; the result equals a
    one-process build."""
    from tests._models import packaged_or_skip

    packaged_or_skip("minilm")
    from replug_jax.cli import main
    from replug_jax.retrieval import Index

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": f"Fact {i}: the number {i} "
                                          f"is {'even' if i % 2 == 0 else 'odd'}."}) + "\n"
                              for i in range(40)))
    args = ["index", "build", "--corpus", str(corpus), "--shards", "2",
            "--embed-shard-rows", "8", "--json"]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = ("import sys; sys.path.insert(0, {root!r}); from replug_jax.cli import main; "
            "sys.exit(main({argv!r}))")
    procs = [subprocess.Popen(
        [sys.executable, "-c",
         code.format(root=ROOT, argv=args + ["--out", str(tmp_path / "two")])],
        env={**env, "HF_HUB_OFFLINE": "1", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
             "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for pid in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    assert main(args + ["--out", str(tmp_path / "one")]) == 0
    one, two = Index.load(tmp_path / "one"), Index.load(tmp_path / "two")
    np.testing.assert_allclose(two.reconstruct_all(), one.reconstruct_all(), atol=1e-5)
    assert two.manifest["corpus_checksum"] == one.manifest["corpus_checksum"]
    assert [s["lo"] for s in two.manifest["shards"]] == [0, 20]
    assert not (tmp_path / "two.partial").exists()


def test_every_process_restores_the_newest_step_all_of_them_can_read():
    """Each process lists the checkpoints it can read; all restore the newest common one."""
    from replug_jax.train.checkpoint import newest_common

    assert newest_common([[6, 4, 2], [4, 2]]) == [4, 2]  # process 1 cannot read step 6
    assert newest_common([[6, 4], [6, 2]]) == [6]
    assert newest_common([[4], [2]]) == []  # nothing in common: a new run, for both
    assert newest_common([[8, 6]]) == [8, 6]


_LSR_STOP = textwrap.dedent("""
    import pathlib
    from tests.helpers import BASE, make_trainer
    cfg = BASE.updated({overrides!r})
    make_trainer(pathlib.Path(out), "moved", cfg).run(stop_after=3)
""")


@pytest.mark.slow
def test_a_two_process_run_resumes_on_one_process(tmp_path):
    """Killed after 3 steps of two processes (sharded JAX index: embeddings saved per
    process), resumed by one process: it re-embeds the index version from its parameter
    snapshot, and finishes with the parameters of a run that never moved."""
    _need_eight()
    from tests.helpers import BASE, make_trainer, params_of

    overrides = {"num_devices": 8, "total_steps": 5, "retrieval.refresh_every": 2,
                 "retrieval.index_backend": "jax", "retrieval.index_dtype": "float32"}
    cfg = BASE.updated(overrides)
    run_two(_LSR_STOP, str(tmp_path), overrides=overrides)
    assert list((tmp_path / "moved" / "index" / "v1").glob("emb.p1of2.npy"))
    moved = make_trainer(tmp_path, "moved", cfg)
    moved.run()
    assert list((tmp_path / "moved" / "index" / "v1").glob("emb.npy"))  # re-embedded
    straight = make_trainer(tmp_path, "straight", cfg)
    straight.run()
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(straight.state.params))[0]
    for (path, b), a in zip(flat, params_of(moved)):
        if "['key']['bias']" in jax.tree_util.keystr(path):  # zero true gradient: noise
            continue  # (see test_lsr.test_eight_devices_equal_one)
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=jax.tree_util.keystr(path))


_LSR_RESUME = textwrap.dedent("""
    import json, pathlib
    from tests.helpers import BASE, make_trainer
    from replug_jax.sharding import host_copy
    cfg = BASE.updated({overrides!r})
    t = make_trainer(pathlib.Path(out), "moved", cfg)
    # the step this process restores, before running on
    step, _, _ = t.checkpoints.restore(t.state)
    (pathlib.Path(out) / f"restored.p{{jax.process_index()}}.json").write_text(json.dumps(step))
    t.run()
    if jax.process_index() == 0:
        leaves = jax.tree_util.tree_flatten_with_path(host_copy(t.state.params))[0]
        np.savez(pathlib.Path(out) / "params.npz",
                 **{{jax.tree_util.keystr(p): v for p, v in leaves}})
""")


@pytest.mark.slow
def test_a_killed_two_process_run_resumes_both_at_one_step(tmp_path):
    """Two processes stopped after 3 steps, then restarted as two: both restore the same
    step (the newest all can read), and finish with the parameters of a run never stopped."""
    _need_eight()
    from tests.helpers import BASE, make_trainer

    overrides = {"num_devices": 8, "total_steps": 5, "retrieval.refresh_every": 2,
                 "retrieval.index_backend": "jax", "retrieval.index_dtype": "float32"}
    run_two(_LSR_STOP, str(tmp_path), overrides=overrides)
    run_two(_LSR_RESUME, str(tmp_path), overrides=overrides)
    restored = [json.loads((tmp_path / f"restored.p{i}.json").read_text()) for i in (0, 1)]
    assert restored[0] == restored[1] and restored[0] >= 2
    straight = make_trainer(tmp_path, "straight", BASE.updated(overrides))
    straight.run()
    two = np.load(tmp_path / "params.npz")
    for path, a in jax.tree_util.tree_flatten_with_path(
            jax.device_get(straight.state.params))[0]:
        name = jax.tree_util.keystr(path)
        if "['key']['bias']" in name:  # zero true gradient: see test_eight_devices_equal_one
            continue
        np.testing.assert_allclose(two[name], a, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_two_processes_with_prefetched_scoring_equal_one_synchronous_process(tmp_path):
    """Two processes prefetching their next rows' LM scores (FAISS index: a local search per
    process), reading the corpus from a memory-mapped passage store, train to the parameters
    of one process scoring every pair in its step with the corpus as a list."""
    _need_eight()
    from replug_jax.retrieval.corpus import corpus_text
    from tests.helpers import BASE, PASSAGES, make_trainer

    overrides = {"num_devices": 8, "total_steps": 4, "retrieval.refresh_every": 2,
                 "lm.prefetch": True}
    from replug_jax.retrieval.store import write_store

    write_store(PASSAGES, tmp_path / "passages.arrow")  # and the corpus read from disk
    run_two(_LSR, str(tmp_path), overrides=overrides, store=str(tmp_path / "passages.arrow"),
             api=None)
    one = make_trainer(tmp_path, "one", BASE.updated({**overrides, "lm.prefetch": False}))
    one.run()
    # the refresh at step 2: each process embedded its half of the corpus, and both built
    # the index from the two halves
    shares = [np.load(tmp_path / "two" / "index" / "v1" / f"emb.p{i}of2.npy") for i in (0, 1)]
    assert [len(x) for x in shares] == [len(PASSAGES) // 2, len(PASSAGES) - len(PASSAGES) // 2]
    np.testing.assert_allclose(
        np.concatenate(shares),
        one.retriever.encode([corpus_text(p) for p in PASSAGES],
                             params=one.refresher.load_snapshot(1, jax.device_get(
                                 one.state.params))), atol=1e-5)
    _assert_two_equal_one(tmp_path, one)


@pytest.mark.slow
@pytest.mark.models
def test_two_processes_prefetching_from_a_batched_served_lm_equal_one_in_process(served,
                                                                                 tmp_path):
    """The three paths of LSR at scale at once, on two processes: the next rows' LM scores
    prefetched, from `replug serve` in requests of 4 prompts, the corpus read from a
    memory-mapped store; they train to the parameters of one process scoring in its steps
    with the same LM in-process and the corpus as a list."""
    _need_eight()
    from replug_jax.retrieval.store import write_store
    from tests.helpers import BASE, PASSAGES, make_trainer

    lm, url = served
    overrides = {"num_devices": 8, "total_steps": 3, "retrieval.refresh_every": 2,
                 "lm.prefetch": True}
    write_store(PASSAGES, tmp_path / "passages.arrow")
    run_two(_LSR, str(tmp_path), overrides=overrides, store=str(tmp_path / "passages.arrow"),
             api=url)
    one = make_trainer(tmp_path, "one", BASE.updated({**overrides, "lm.prefetch": False}),
                       lm=lm)
    one.run()
    _assert_two_equal_one(tmp_path, one)


def test_slurm_starts_distributed_only_inside_a_step_of_several_tasks():
    from replug_jax.sharding import distributed_launch

    job = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"}
    assert not distributed_launch({})
    assert not distributed_launch(job)  # an salloc/sbatch shell: no step, one process
    assert not distributed_launch({**job, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"})
    assert distributed_launch({**job, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8"})
    assert distributed_launch({**job, "SLURM_STEP_ID": "0"})  # srun of the job's 8 tasks
    assert distributed_launch({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
    assert distributed_launch({"TPU_WORKER_HOSTNAMES": "a,b"})


def test_initialize_distributed_is_a_no_op_in_an_salloc_shell(monkeypatch):
    import jax

    from replug_jax.sharding import initialize_distributed

    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    called = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: called.append(1))
    initialize_distributed()
    assert not called
