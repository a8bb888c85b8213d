"""The frozen LM on a device mesh (8 simulated CPU devices): sharded by the rules table, loaded
slice by slice, it scores and generates what one device does; each device holds its share of
the parameters; a model axis that does not divide the heads is refused; two processes x 4
devices read only their own slices of the checkpoint."""

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replug_jax.lm.flax_scorer import FlaxLM
from replug_jax.lm.memory import lm_memory
from replug_jax.models import load_lm
from replug_jax.models.weights import LazyTensor, column_block, transposed
from replug_jax.sharding import (
    addressable_bytes,
    check_heads,
    logical_spec,
    make_mesh,
    parse_mesh,
)
from tests._models import cached_tokenizer

MESHES = [{"data": 2, "model": 4}, {"model": 8}, {"fsdp": 2, "model": 4}]
LLAMA_HF = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 8, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
GPT2_HF = {"model_type": "gpt2", "vocab_size": 49152, "n_embd": 64, "n_layer": 2, "n_head": 4,
           "n_positions": 128, "bos_token_id": 1, "eos_token_id": 2}


def _need_eight():
    if len(jax.devices()) < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


def write_hf_decoder(directory: pathlib.Path, hf: dict, seed: int = 0) -> pathlib.Path:
    """A random decoder in Hugging Face layout written without PyTorch: our module's random
    parameters put through the architecture's name map in reverse, as safetensors."""
    from flax import nnx
    from safetensors.numpy import save_file

    from replug_jax.models import registry

    arch = registry.architecture("lm", hf["model_type"])
    cfg = arch.config_from_hf(hf)
    module = arch.build(cfg, jnp.float32, nnx.Rngs(seed))
    flat = dict(nnx.to_flat_state(nnx.split(module)[1]))
    tensors: dict[str, np.ndarray] = {}
    parts: dict[str, dict[int, np.ndarray]] = {}
    for path, (name, transform) in arch.hf_name_map(cfg).items():
        if path in flat:
            value = np.asarray(flat[path][...], np.float32)
        else:  # layers/3/attn/q/kernel: layer 3 of the blocks stacked along axis 0
            value = np.asarray(flat[(path[0], *path[2:])][...][path[1]], np.float32)
        if isinstance(transform, column_block):
            parts.setdefault(name, {})[transform.part] = value
        else:
            tensors[name] = value.T.copy() if transform is transposed else value
    for name, blocks in parts.items():
        tensors[name] = np.concatenate([blocks[i] for i in sorted(blocks)], axis=-1)
    prefix = "transformer." if hf["model_type"] == "gpt2" else ""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf))
    cached_tokenizer("smollm2").save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_hf_decoder(tmp_path_factory.mktemp("llama"), LLAMA_HF)


@pytest.fixture(scope="module")
def one_device(llama_dir):
    return FlaxLM(load_lm(str(llama_dir), dtype="float32"), max_context=256)


def _pairs(seed=0):
    """A shared 40-token passage before three inputs (the KV-reuse path) and one lone pair."""
    rng = np.random.default_rng(seed)
    doc = [1] + list(rng.integers(3, 49152, 40))
    prefixes = [doc + list(rng.integers(3, 49152, 5)) for _ in range(3)]
    prefixes.append([1] + list(rng.integers(3, 49152, 7)))
    conts = [list(rng.integers(3, 49152, n)) for n in (4, 9, 3, 6)]
    return prefixes, conts


def _expected_bytes(lm: FlaxLM) -> int:
    """Σ over parameters of its bytes / the devices its spec splits it over."""
    total = 0
    for x in jax.tree.leaves(lm.state):
        spec = x.sharding.spec
        split = math.prod(math.prod(lm.place.mesh.shape[a] for a in
                                    ((s,) if isinstance(s, str) else s))
                          for s in spec if s is not None)
        total += x.nbytes // split
    return total


@pytest.mark.slow
@pytest.mark.parametrize("shape", MESHES, ids=["data2_model4", "model8", "fsdp2_model4"])
def test_sharded_lm_scores_and_generates_as_one_device(llama_dir, one_device, shape):
    _need_eight()
    mesh = make_mesh(shape=shape)
    lm = FlaxLM.load(str(llama_dir), dtype="float32", mesh=mesh, max_context=256)
    prefixes, conts = _pairs()
    want = one_device.score_token_ids(prefixes, conts)
    got = lm.score_token_ids(prefixes, conts)
    assert lm.stats.reused_prefixes >= 1  # the KV-reuse path ran sharded too
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(lm.next_token_logprobs_ids(prefixes),
                               one_device.next_token_logprobs_ids(prefixes), atol=1e-5)
    weights = np.log([[0.7, 0.3], [0.5, 0.5], [0.2, 0.8]])
    prompts = [["Paris is", "The cat sat"], ["One two", "three"], ["A", "Berlin is the"]]
    g_one = one_device.generate_ensemble(prompts, weights, max_new_tokens=12)
    g_mesh = lm.generate_ensemble(prompts, weights, max_new_tokens=12)
    assert g_mesh.token_ids == g_one.token_ids  # greedy tokens identical
    for a, b in zip(g_mesh.mixture_logprobs, g_one.mixture_logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # Each device holds its share: every model-sharded kernel split M ways, the rest (norms,
    # k/v where M does not divide the kv heads) replicated.
    mine, total = addressable_bytes(lm.state), addressable_bytes(one_device.state)
    assert mine == _expected_bytes(lm)
    q = lm.state["layers"]["attn"]["q"]["kernel"][...]  # [layers, embed, heads]
    assert q.addressable_shards[0].data.shape == (2, 64 // shape.get("fsdp", 1),
                                                  64 // shape["model"])
    replicated_norms = 64 * 4 * (2 * 2 + 1)  # [64] float32 scales, 2 per layer + final
    kv_rep = 0 if 4 % shape["model"] == 0 else 2 * 2 * 64 * 32 * 4 * (1 - 1 / shape["model"])
    assert mine <= total / (shape["model"] * shape.get("fsdp", 1)) + replicated_norms + kv_rep
    # `replug lm-memory` computes the same bytes from the config alone
    plan = lm_memory(lm.lm.config, shape, "float32", batch=8, context=64)
    assert plan["parameters_bytes"] == mine


@pytest.mark.slow
def test_gpt2_sharded_load_splits_the_fused_qkv_by_slices(tmp_path):
    _need_eight()
    path = write_hf_decoder(tmp_path / "gpt2", GPT2_HF, seed=1)
    one = FlaxLM(load_lm(str(path), dtype="float32"), max_context=128)
    mesh = make_mesh(shape={"data": 2, "model": 4})
    lm = FlaxLM.load(str(path), dtype="float32", mesh=mesh, max_context=128)
    prefixes, conts = _pairs(seed=3)
    for a, b in zip(lm.score_token_ids(prefixes, conts), one.score_token_ids(prefixes, conts)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_lazy_tensor_reads_only_the_asked_block(llama_dir, monkeypatch):
    """A sharded load asks each tensor only for its devices' blocks, through the transform's
    source index (a transposed kernel's column block is a row block of the file)."""
    _need_eight()
    seen = []
    real = LazyTensor.__getitem__

    def spy(self, index):
        out = real(self, index)
        seen.append((self.name, out.size, math.prod(self.shape)))
        return out

    monkeypatch.setattr(LazyTensor, "__getitem__", spy)
    load_lm(str(llama_dir), dtype="float32", mesh=make_mesh(shape={"model": 8}))
    q_reads = [(n, size) for n, size, whole in seen
               if n.endswith("layers.0.self_attn.q_proj.weight")]
    assert len(q_reads) == 8 and all(size == 64 * 64 // 8 for _, size in q_reads)
    assert max(size / whole for _, size, whole in seen if "proj" in _) <= 1.0


def test_model_axis_not_dividing_the_heads_is_refused_in_one_line(tmp_path):
    _need_eight()
    path = write_hf_decoder(tmp_path / "gpt2", GPT2_HF)  # 4 heads
    with pytest.raises(ValueError, match=r"model axis 8 does not divide the 4 attention heads"
                                         r".*model sizes that work are 1, 2, 4$"):
        load_lm(str(path), mesh=make_mesh(shape={"model": 8}))
    check_heads(4, None, "x")  # no mesh: nothing to check


def test_parse_mesh_and_its_errors():
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh(" model=8 ") == {"model": 8}
    for bad, why in [("data=2,data=2", "each at most once"), ("tensor=2", "axes from"),
                     ("model=x", "not an integer"), ("model=0", "at least 1"), ("", "no axes")]:
        with pytest.raises(ValueError, match=why):
            parse_mesh(bad)
    with pytest.raises(ValueError, match="has 6 devices but 8 are visible"):
        make_mesh(shape={"data": 2, "model": 3})


def test_rules_replicate_what_the_mesh_does_not_divide():
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    assert logical_spec(("embed", "heads"), (64, 64), mesh) == jax.sharding.PartitionSpec(
        None, "model")
    with pytest.warns(UserWarning, match="'vocab' of size 50257 is not divisible"):
        spec = logical_spec(("vocab", "embed"), (50257, 64), mesh)
    assert spec == jax.sharding.PartitionSpec(None, None)
    assert logical_spec(("batch", "length"), (8, 16), mesh)[0] == "data"


@pytest.mark.slow
def test_bert_sharded_over_heads_embeds_as_one_device():
    """The retriever's parameters carry the same logical axes: sharded model=2 (its 30522-row
    vocabulary replicated, as 2 does divide it), the embeddings are unchanged."""
    _need_eight()
    from flax import nnx

    from replug_jax.lm.placement import Placement
    from replug_jax.models.bert import BertConfig, BertEncoder, pool

    cfg = BertConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                     max_position=64, has_pooler=False)
    enc = BertEncoder(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(enc)
    placed = Placement(make_mesh(shape={"data": 4, "model": 2}), jnp.float32).shard_state(
        enc, state)
    ids = np.random.default_rng(0).integers(0, 30522, (8, 16)).astype(np.int32)
    mask = np.ones_like(ids)

    @jax.jit
    def run(st):
        return pool(nnx.merge(graphdef, st)(ids, mask), mask)

    np.testing.assert_allclose(run(placed), run(state), atol=1e-5)
    assert addressable_bytes(placed) < addressable_bytes(state)


def test_fused_causal_attention_arguments_match_the_decoder_mask():
    """The arguments given to cuDNN's kernel on a GPU (causal, per-row lengths, grouped KV
    heads) mean what the decoder's own mask means: checked with the same call's XLA
    implementation, which runs anywhere."""
    from replug_jax.models.decoder import attention_mask
    from replug_jax.models.layers import attention, flash_attention

    rng = np.random.default_rng(0)
    b, length, h, j, d = 3, 16, 8, 2, 8
    q = jnp.asarray(rng.normal(size=(b, length, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, length, j, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, length, j, d)), jnp.float32)
    lengths = np.array([16, 9, 1], np.int32)
    pos = np.where(np.arange(length)[None] < lengths[:, None], np.arange(length)[None], -1)
    got = flash_attention(q, k, v, jnp.asarray(lengths), "xla")
    r = h // j  # the decoder's head-major GQA layout
    q_BJMD = q.reshape(b, length, j, r, d).transpose(0, 2, 3, 1, 4).reshape(b, j, r * length, d)
    mask = attention_mask(jnp.asarray(pos), jnp.asarray(pos))
    mask = jnp.broadcast_to(mask[:, None, None], (b, 1, r, length, length)).reshape(
        b, 1, r * length, length)
    out = attention(q_BJMD, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)
    want = out.reshape(b, j, r, length, d).transpose(0, 3, 1, 2, 4).reshape(b, length, h, d)
    for row, n in enumerate(lengths):  # padded query rows are ignored by every caller
        np.testing.assert_allclose(got[row, :n], want[row, :n], atol=1e-5)


def test_query_chunked_attention_equals_one_pass():
    """Accelerators take the query rows in chunks bounded in bytes: the same result."""
    from replug_jax.models.layers import _attention_block, _query_chunked

    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 3, n, 8)), jnp.float32) for n in (24, 20, 20))
    mask = jnp.asarray(rng.random((2, 1, 24, 20)) > 0.3)
    whole = _attention_block(q, k, v, mask)[0]
    for budget in (2 * 3 * 20 * 4 * 5, 2 * 3 * 20 * 4):  # chunks of 4 rows, then of 1
        np.testing.assert_allclose(_query_chunked(q, k, v, mask, budget), whole, atol=1e-6)


_TWO = """
import json, math
from replug_jax.lm.flax_scorer import FlaxLM
from replug_jax.lm.memory import lm_memory
from replug_jax.models.weights import LazyTensor
from replug_jax.sharding import make_mesh
from tests.lm.test_sharded import _pairs
read = [0]
real = LazyTensor.__getitem__

def spy(self, index):
    block = real(self, index)
    read[0] += block.size
    return block

LazyTensor.__getitem__ = spy
lm = FlaxLM.load({path!r}, dtype="float32", mesh=make_mesh(shape={{"fsdp": 2, "model": 4}}),
                 max_context=256)
prefixes, conts = _pairs()
got = lm.score_token_ids(prefixes, conts)
gen = lm.generate_ensemble([["Paris is", "The cat"]], np.log([[0.6, 0.4]]), max_new_tokens=8)
with open(out + f".{{jax.process_index()}}.json", "w") as f:
    json.dump({{"read": read[0], "logp": [g.tolist() for g in got],
               "tokens": gen.token_ids}}, f)
"""


@pytest.mark.slow
def test_two_processes_read_only_their_slices_and_score_as_one_device(llama_dir, one_device,
                                                                       tmp_path):
    """fsdp=2 across the two processes x model=4 within each: each process reads about half
    of the checkpoint (the model width is split between them), and both get the one-device
    log-probs and tokens."""
    _need_eight()
    from safetensors import safe_open

    from tests.helpers import run_two

    out = str(tmp_path / "two")
    run_two(_TWO, out, path=str(llama_dir))
    with safe_open(str(llama_dir / "model.safetensors"), framework="numpy") as f:
        whole = sum(math.prod(f.get_slice(n).get_shape()) for n in f.keys())
    prefixes, conts = _pairs()
    want = one_device.score_token_ids(prefixes, conts)
    gen = one_device.generate_ensemble([["Paris is", "The cat"]], np.log([[0.6, 0.4]]),
                                       max_new_tokens=8)
    for pid in (0, 1):
        res = json.loads(pathlib.Path(f"{out}.{pid}.json").read_text())
        # each of a process's 4 devices reads its own block: together half the file, plus
        # the small replicated norms read once per device
        assert 0.45 * whole <= res["read"] <= 0.55 * whole
        for a, b in zip(res["logp"], want):
            np.testing.assert_allclose(a, b, atol=1e-5)
        assert res["tokens"] == gen.token_ids


def test_sharded_top_logprobs_of_every_position_equal_one_device(llama_dir, one_device):
    """The serving path's per-position top-n (echo log-probs) on a mesh: a tuple output,
    replicated for the host like the rest."""
    _need_eight()
    lm = FlaxLM.load(str(llama_dir), dtype="float32", mesh=make_mesh(shape={"data": 2,
                                                                             "model": 4}),
                     max_context=256)
    seqs = [[1, 5, 9, 200, 3000], [1, 7, 7]]
    for (lp_a, top_a), (lp_b, top_b) in zip(lm.positions_top_logprobs(seqs, 3),
                                            one_device.positions_top_logprobs(seqs, 3)):
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-5)
        np.testing.assert_array_equal(top_a, top_b)


def test_fused_attention_only_where_q_k_v_shardings_agree():
    """cuDNN's fused attention needs q, k and v sharded alike: a model axis that does not
    divide the kv heads (TinyLlama's 4 at model=8) replicates k and v, and the partitioner
    refuses at compile time; such layers keep XLA's attention."""
    import jax.numpy as jnp
    from flax import nnx

    from replug_jax.models.decoder import (
        Attention,
        CausalLM,
        DecoderConfig,
        configure_attention,
        fused_attention_agrees,
    )

    assert fused_attention_agrees(4, 1) and fused_attention_agrees(4, 4)
    assert fused_attention_agrees(8, 2) and not fused_attention_agrees(4, 8)
    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=8, num_kv_heads=2, head_dim=4, max_position=32)
    model = CausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, Attention)]
    assert len(layers) == 1 and all(m.fused_ok for m in layers)  # both layers, stacked
    assert not configure_attention(model, 4)
    assert not any(m.fused_ok for m in layers)
    assert configure_attention(model, 2) and all(m.fused_ok for m in layers)


@pytest.mark.parametrize("mesh_shape", [{"fsdp": 2}, {"fsdp": 2, "model": 4},
                                        {"data": 2, "fsdp": 4}, {"fsdp": 8}])
def test_no_parameter_maps_two_dimensions_to_one_mesh_axis(mesh_shape):
    """Every architecture (Llama, GPT-2, OPT, OPT-350m's narrower embedding with its
    ("embed", "embed") projections) on meshes with fsdp: a PartitionSpec naming a mesh axis
    twice is a DuplicateSpecError at load; the second dimension is replicated instead."""
    import math

    import jax.numpy as jnp
    from flax import nnx

    from replug_jax.lm.memory import lm_memory
    from replug_jax.models import registry
    from replug_jax.models.decoder import DecoderConfig
    from replug_jax.sharding import param_shardings

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                num_heads=4, num_kv_heads=4, head_dim=8, max_position=32)
    configs = [DecoderConfig(**base, family="llama"),
               DecoderConfig(**base, family="gpt2", norm="layer", mlp="gelu_tanh",
                             position="learned", attn_bias=True, mlp_bias=True),
               DecoderConfig(**base, family="opt", norm="layer", mlp="relu",
                             position="learned", position_offset=2, attn_bias=True,
                             mlp_bias=True, embed_dim=16, norm_position="post",
                             final_norm=False)]
    names = tuple(a for a in ("data", "fsdp", "model") if a in mesh_shape)
    mesh = jax.sharding.AbstractMesh(tuple(mesh_shape[a] for a in names), names)
    for cfg in configs:
        abstract = nnx.eval_shape(lambda: registry.architecture("lm", cfg.family).build(
            cfg, jnp.float32, nnx.Rngs(0)))
        for path, sharding in param_shardings(nnx.to_flat_state(nnx.split(abstract)[1]),
                                              mesh).items():
            axes_used = [a for part in sharding.spec if part is not None
                         for a in ((part,) if isinstance(part, str) else part)]
            assert len(axes_used) == len(set(axes_used)), (cfg.family, path, sharding.spec)
        plan = lm_memory(cfg, mesh_shape, "float32", batch=8, context=16)
        assert plan["parameters_bytes"] * math.prod(mesh_shape.values()) >= \
            plan["parameters_total_gib"] * (1 << 30) * 0.999  # no kernel split twice
