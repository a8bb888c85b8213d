"""``replug compile-check`` (replug_jax/compile_check.py): a run's programs compiled ahead of
time for a target — a TPU topology through libtpu on this CPU machine, or the local devices —
with their memory per device against the chip's."""

import importlib.util
import json

import pytest

from replug_jax.cli import main

TINY_LM = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
TINY_BERT = {"model_type": "bert", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64}
SMALL = ["--lm-batch", "8", "--context", "64", "--new-tokens", "8", "--prefix-len", "16",
         "--suffix-len", "16", "--lsr-batch", "8", "--lsr-docs", "4", "--query-len", "16",
         "--doc-len", "16", "--corpus", "4096", "--topk-queries", "8", "--k", "4",
         "--encode-batch", "16"]
PROGRAMS = {"lm_score", "lm_kv_prefix", "lm_kv_suffix", "prefill", "decode_step", "lsr_step",
            "topk", "refresh_encode"}
GIB = 1 << 30
# the CUDA plugin (the gpu extra): GPU targets compile where it is installed
CUDA_PLUGIN = (importlib.util.find_spec("jax_plugins") is not None
               and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes")
    (d / "lm.json").write_text(json.dumps(TINY_LM))
    (d / "bert.json").write_text(json.dumps(TINY_BERT))
    return d


def _run(configs, capsys, *extra) -> tuple[int, dict]:
    code = main(["compile-check", "--lm-config", str(configs / "lm.json"), "--retriever-config",
                 str(configs / "bert.json"), "--json", *SMALL, *extra])
    return code, json.loads(capsys.readouterr().out)


def test_every_program_compiles_for_the_local_devices_and_the_cache_is_donated(configs,
                                                                                 capsys):
    code, report = _run(configs, capsys, "--mesh", "data=2,model=4", "--chip-memory", "1")
    assert code == 0, report
    rows = report["programs"]
    assert set(rows) == PROGRAMS
    assert all("error" not in r and r["fits"] for r in rows.values()), rows
    # prefill and decode update the KV cache in place: the cache comes in and goes out as one
    # buffer (donated), so it is held once, not twice
    cache = 2 * 2 * 8 * 2 * 64 * 32 * 4 / 8  # k and v: [layers, B, J, S, D] f32 over 8 devices
    for name in ("prefill", "decode_step"):
        assert rows[name]["donated_gib"] * GIB >= 0.9 * cache, (name, rows[name])
    # the prefill's head runs on the last position only: no [B, L, V] float32 logits
    logits = 8 * 56 * 512 * 4 / 2  # rows split over data=2
    assert rows["prefill"]["temporary_gib"] * GIB < logits
    assert rows["lsr_step"]["donated_gib"] > 0  # the optimizer state updated in place


def test_an_oversized_batch_is_reported_as_not_fitting(configs, capsys):
    code, report = _run(configs, capsys, "--programs", "lm", "--mesh", "data=2,model=4",
                        "--chip-memory", "0.05", "--lm-batch", "512", "--context", "256")
    assert code == 1
    assert not report["programs"]["lm_score"]["fits"]
    assert report["programs"]["lm_score"]["fraction_of_chip"] > 0.9


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu absent: install the tpu-compile extra to compile for TPUs")
def test_compiles_for_a_tpu_topology_from_this_cpu_machine(configs, capsys):
    code, report = _run(configs, capsys, "--topology", "v5e:2x2", "--mesh", "data=2,model=2")
    assert code == 0, report
    assert report["device_kind"] == "TPU v5 lite" and report["devices"] == 4
    assert report["chip_memory_gib"] == 16
    rows = report["programs"]
    assert set(rows) == PROGRAMS and all(r["fits"] for r in rows.values()), rows
    assert all(r["flops"] > 0 and r["roofline_seconds"] > 0 for r in rows.values())
    # the same batch against a chip too small for it: reported, exit status 1
    code, report = _run(configs, capsys, "--topology", "v5e:2x2", "--mesh", "model=4",
                        "--programs", "prefill", "--lm-batch", "131072", "--context", "256")
    assert code == 1 and set(report["programs"]) == {"prefill"}
    row = report["programs"]["prefill"]  # the TPU compiler itself refuses it, and says why
    assert not row["fits"] and row["does_not_fit"], row
    assert row["fraction_of_chip"] > 1 and "RESOURCE_EXHAUSTED" in row["error"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu absent: install the tpu-compile extra to compile for TPUs")
def test_a_tpu_target_is_compiled_with_the_accelerator_code_paths(configs, capsys,
                                                                  monkeypatch):
    """Issue 68: on this CPU machine, a TPU target traces the accelerator's attention (query
    chunks, not the CPU's blocked kernel) and the accelerator's exact-search block size;
    the local devices still trace the CPU's."""
    from replug_jax.models import layers
    from replug_jax.retrieval import jax_search
    from replug_jax.sharding import for_target, platform

    traced = []
    for name in ("_query_chunked", "_blocked_attention"):
        real = getattr(layers, name)
        monkeypatch.setattr(layers, name,
                            lambda *a, _n=name, _f=real: traced.append(_n) or _f(*a))
    code, _ = _run(configs, capsys, "--topology", "v5e:2x2", "--programs", "lm_score")
    assert code == 0 and traced and set(traced) == {"_query_chunked"}, traced
    traced.clear()
    code, _ = _run(configs, capsys, "--programs", "lm_score", "--mesh", "data=2,model=4")
    assert code == 0 and set(traced) == {"_blocked_attention"}, traced
    assert platform() == "cpu"
    import jax
    from jax.experimental import topologies

    tpu = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    big = 1 << 26  # corpus rows whose [n, 64] float32 scores exceed the CPU's block
    with for_target(tpu):
        assert platform() == "tpu"
        assert jax_search.block_rows(64, big) > jax_search.block_rows(64, big,
                                                                       scores_bytes=1 << 29)
    assert platform() == jax.default_backend() == "cpu"


def test_a_topology_without_libtpu_or_unknown_is_one_line(configs, capsys):
    code = main(["compile-check", "--lm-config", str(configs / "lm.json"), "--topology",
                 "v9z:7x7"])
    assert code == 2
    assert "cannot describe TPU topology 'v9z:7x7'" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--chip-memory", "inf"], "finite positive"), (["--chip-memory", "-1"], "finite positive"),
    (["--chip-memory", "0"], "finite positive"), (["--slices", "2"], "give one"),
    (["--new-tokens", "64"], "must be below --context"),
    (["--lsr-batch", "7", "--topology", "v5e:2x4"], "does not divide over the target's 8")])
def test_bad_arguments_are_one_line_before_anything_compiles(configs, capsys, extra, message):
    """Refused in one line with exit 2, not a traceback, a false "does not fit", silently
    ignored, or a compile failure reported as the target's."""
    if "--topology" in extra and importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu absent: a topology cannot be described")
    code = main(["compile-check", "--lm-config", str(configs / "lm.json"), "--retriever-config",
                 str(configs / "bert.json"), *SMALL, *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu absent: install the tpu-compile extra to compile for TPUs")
def test_a_mesh_over_two_slices_keeps_only_the_data_axis_across_them():
    """Two v5e:2x2 slices (8 chips): the hybrid mesh puts the slices along data (the slow
    data-center network) and keeps fsdp and model within each slice; a mesh with no axis the
    slices divide is refused."""
    from replug_jax.compile_check import target_devices, target_mesh

    devices = target_devices("v5e:2x2", slices=2)
    assert sorted({d.slice_index for d in devices}) == [0, 1]
    mesh = target_mesh(devices, {"data": 2, "model": 4})
    for row in range(2):
        assert len({d.slice_index for d in mesh.devices[row].ravel()}) == 1
    assert mesh.devices[0, 0].slice_index != mesh.devices[1, 0].slice_index
    with pytest.raises(ValueError, match="2 slices need a data or fsdp axis"):
        target_mesh(devices, {"model": 8})


def test_the_scanned_layers_are_all_in_the_flops_and_bytes(tmp_path):
    """XLA counts a loop's body once, and the decoder scans its layers: each LM program's
    reported flops and bytes hold every layer. At 3 layers they exceed XLA's own count by two
    layers, a layer measured apart (4 layers unrolled less 3); where the program uses every
    layer's output (whole-sequence scoring), its flops equal the program compiled unrolled."""
    from replug_jax import compile_check as cc
    from replug_jax.lm.memory import read_lm_config
    from replug_jax.compile_targets import Shapes
    from replug_jax.sharding import make_mesh

    def cfg(layers):
        (tmp_path / "lm.json").write_text(json.dumps({**TINY_LM, "num_hidden_layers": layers}))
        return read_lm_config(tmp_path / "lm.json")

    mesh = make_mesh(shape={"data": 2, "model": 4})
    s = Shapes(lm_batch=4, context=32, new_tokens=4, prefix_len=8, suffix_len=8, lsr_docs=2)
    rows = cc.compile_check(cc.lm_programs(cfg(3), mesh, "float32", s), None, progress=False,
                            missing_costs=cc.layer_costs(cfg(3), mesh, "float32", s))
    scanned = cc.lm_programs(cfg(3), mesh, "float32", s)
    unrolled = {n: cc.lm_programs(cfg(n), mesh, "float32", s, unroll_layers=True)
                for n in (3, 4)}
    for name, row in rows.items():
        xla = cc.xla_cost(scanned[name]().compile())
        u3, u4 = (cc.xla_cost(unrolled[n][name]().compile()) for n in (3, 4))
        for key, rel in (("flops", 0.01), ("bytes_accessed", 0.05)):
            layer = u4[key] - u3[key]
            assert layer > 0, (name, key)
            assert row[key] == pytest.approx(xla[key] + 2 * layer, rel=rel), (name, key)
        assert row["layers_in_cost"].startswith("every layer")
    assert rows["lm_score"]["flops"] == pytest.approx(
        cc.xla_cost(unrolled[3]["lm_score"]().compile())["flops"], rel=0.02)


MID_LM = {**TINY_LM, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 688,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
          "max_position_embeddings": 512, "tie_word_embeddings": False}
MID_BERT = {**TINY_BERT, "vocab_size": 1024, "hidden_size": 128, "num_attention_heads": 4,
            "intermediate_size": 512, "max_position_embeddings": 128}
MID = dict(lm_batch=8, context=256, new_tokens=16, prefix_len=64, suffix_len=64, lsr_batch=8,
           lsr_docs=4, query_len=32, doc_len=64, corpus=65536, topk_queries=16, k=4,
           encode_batch=64)


def _mid_args(tmp_path) -> list[str]:
    (tmp_path / "lm.json").write_text(json.dumps(MID_LM))
    (tmp_path / "bert.json").write_text(json.dumps(MID_BERT))
    return ["compile-check", "--lm-config", str(tmp_path / "lm.json"), "--retriever-config",
            str(tmp_path / "bert.json"), "--json", "--mesh", "data=2,model=4",
            *[a for k, v in MID.items() for a in (f"--{k.replace('_', '-')}", str(v))]]


def test_the_flops_arithmetic_agrees_with_xla_where_xla_counts(tmp_path, capsys):
    """program_flops, what a GPU target reports in place of XLA's missing cost analysis, is
    held against XLA's own count (every layer in it) on this machine: within 15 % for every
    program that is matmul work; the decode step, memory-bound, it counts low (sampling and
    the replicated vocabulary work are not matmuls it models), never high."""
    from replug_jax.compile_check import program_flops
    from replug_jax.lm.memory import read_lm_config
    from replug_jax.models.bert import BertConfig
    from replug_jax.compile_targets import Shapes

    assert main(_mid_args(tmp_path)) == 0
    rows = json.loads(capsys.readouterr().out)["programs"]
    ours = program_flops(read_lm_config(tmp_path / "lm.json"), BertConfig.from_hf(MID_BERT),
                         Shapes(**MID), 8)
    assert set(ours) == PROGRAMS and all(r["flops_from"] == "XLA" for r in rows.values())
    for name, row in rows.items():
        ratio = ours[name] / row["flops"]
        if name == "decode_step":
            assert 0.2 < ratio <= 1.0, (name, ratio)
        else:
            assert 0.85 < ratio < 1.15, (name, ratio)
    no_remat = program_flops(None, BertConfig.from_hf(MID_BERT), Shapes(**MID), 8, remat=False)
    assert no_remat["lsr_step"] == pytest.approx(0.75 * ours["lsr_step"])


@pytest.mark.parametrize("extra, message", [
    (["--target", "h100x0"], "name a GPU and a device count"),
    (["--target", "v100x8"], "one of h100xN, h200xN, a100xN"),
    (["--target", "h100x8", "--topology", "v5e:2x4"], "not both")])
def test_a_gpu_target_is_checked_before_anything_compiles(configs, capsys, extra, message):
    code = main(["compile-check", "--lm-config", str(configs / "lm.json"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


def test_gpu_target_descriptions_hold_the_published_properties():
    """Each description names its device, compute capability and memory as the chip table
    reads them; without the CUDA plugin a GPU target is one line naming the extra."""
    from replug_jax.compile_check import CHIPS
    from replug_jax.compile_targets import GPUS, gpu_devices, parse_target

    for key, spec in GPUS.items():
        text = spec.target_config()
        major, minor = spec.compute_capability
        assert f"cuda_compute_capability {{ major: {major} minor: {minor} }}" in text
        assert f"device_memory_size: {spec.memory_bytes}" in text
        assert f'device_description_str: "{spec.name}"' in text
        assert CHIPS[spec.name][0] == pytest.approx(spec.memory_bytes / GIB)
        assert parse_target(f"{key.upper()}x2") == (spec, 2)
    assert 79 < CHIPS["NVIDIA H100 80GB HBM3"][0] < 80 and CHIPS["NVIDIA H200"][0] > 140
    if not CUDA_PLUGIN:
        with pytest.raises(ValueError, match=r"pip install 'replug-jax\[gpu\]'"):
            gpu_devices("h100x2")


@pytest.mark.skipif(not CUDA_PLUGIN,
                    reason="the CUDA plugin (the gpu extra, ~5 GB) is not installed")
def test_every_program_compiles_for_gpus_this_machine_does_not_have(tmp_path):
    """With the CUDA plugin, 8 x H100 from a CPU machine, as a user runs it (its own
    process: JAX on the CPU before it loads): every description parses, every program
    compiles with the GPU's code paths (cuDNN's fused attention in the scoring), its memory
    is XLA's and its flops the arithmetic's, and the options a deviceless compile needs are
    stated."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv = [a for a in _mid_args(tmp_path) if a != "--json"]
    probe = f"""
from replug_jax import compile_check as cc
from replug_jax.compile_targets import COMPILE_OPTIONS, GPUS, gpu_devices
from replug_jax.lm.memory import read_lm_config
from replug_jax.compile_targets import Shapes
from replug_jax.sharding import for_target
for key, spec in GPUS.items():
    assert gpu_devices(key + 'x2')[0].device_kind == spec.name, key
devices = gpu_devices('h100x2')
with for_target(devices):
    score = cc.lm_programs(read_lm_config({str(tmp_path / "lm.json")!r}),
                           cc.target_mesh(devices, {{'model': 2}}), 'bfloat16',
                           Shapes(lm_batch=4, context=256, prefix_len=64, suffix_len=64))
    text = score['lm_score']().compile(compiler_options=COMPILE_OPTIONS).as_text()
assert '__cudnn$fmha' in text, 'no cuDNN fused attention in the scoring program'
"""
    subprocess.run([sys.executable, "-c", probe], check=True, env=env)
    out = tmp_path / "h100.json"
    done = subprocess.run([sys.executable, "-m", "replug_jax.cli", *argv, "--target", "h100x8",
                           "--out", str(out)], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "XLA options xla_gpu_enable_cub_radix_sort=False" in done.stdout
    report = json.loads(out.read_text())
    assert report["device_kind"] == "NVIDIA H100 80GB HBM3" and report["devices"] == 8
    assert report["xla_options"] == {"xla_gpu_enable_cub_radix_sort": False,
                                     "xla_gpu_enable_triton_gemm": False}
    assert report["chip_memory_gib"] == pytest.approx(81_559 / 1024)
    rows = report["programs"]
    assert set(rows) == PROGRAMS and all(r["fits"] for r in rows.values())
    assert all(r["flops_from"].startswith("arithmetic") and r["flops"] > 0
               for r in rows.values())


def test_the_top_k_scan_s_blocks_are_all_in_the_flops(monkeypatch):
    """Each device scans its corpus rows in blocks (a loop XLA counts once) when their
    scores exceed the block budget: the reported flops add the other blocks, and equal the
    same search made in one pass (a budget that holds every row) within 10 % (each block's
    own top-k of its bins is work the one pass does once)."""
    import jax

    from replug_jax import compile_check as cc
    from replug_jax.models.bert import BertConfig
    from replug_jax.retrieval import jax_search
    from replug_jax.compile_targets import Shapes
    from replug_jax.sharding import make_mesh

    mesh = make_mesh(shape={"data": 8})
    bert = BertConfig()  # 768 wide: the dot products are the search's work, as at scale
    s = Shapes(corpus=8 * 8192, topk_queries=8, k=4, lsr_batch=8, lsr_docs=2, query_len=8,
               doc_len=8, encode_batch=8)

    def topk_row():
        programs = cc.retriever_programs(bert, mesh, s)
        return cc.compile_check({"topk": programs["topk"]}, None, progress=False,
                                missing_costs=cc.topk_block_costs(bert, mesh, s))["topk"]

    one_pass = topk_row()
    assert not cc.topk_block_costs(bert, mesh, s)  # every row in one pass: nothing to add
    # a budget just under the scores of every row: blocks of 128 rows, 64 of them per device
    monkeypatch.setattr(jax_search, "CPU_BLOCK_BYTES", 4 * 8 * 8192 - 1)
    jax_search._sharded_topk_fn.cache_clear()  # traced anew: the block is read at trace time
    jax.clear_caches()
    blocks = cc.topk_block_costs(bert, mesh, s)
    assert set(blocks) == {"topk"}
    scanned = topk_row()
    assert scanned["flops"] == pytest.approx(one_pass["flops"], rel=0.10)
    assert scanned["flops"] - blocks["topk"]()["flops"] < 0.3 * one_pass["flops"]
    jax_search._sharded_topk_fn.cache_clear()  # no trace with the small budget outlives it
    jax.clear_caches()
