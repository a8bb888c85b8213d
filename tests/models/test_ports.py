"""Model ports against PyTorch transformers on the same weights, plus loader errors."""

import json
import math
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from replug_jax.models import (
    WeightsError,
    export_retriever,
    functional,
    init_cache,
    load_lm,
    load_retriever,
    pool,
    target_logprobs,
    token_logprobs,
)
from tests._models import (
    packaged_or_skip,
    random_ids,
    save_tiny_bert,
    torch_or_skip,
    write_smollm_tokenizer,
)

FACTUAL = ("Paris is the capital and most populous city of France. With an estimated population "
           "of 2,102,650 residents in January 2023 in an area of more than 105 km2, Paris is the "
           "fourth-most populous city in the European Union and the 30th most densely populated "
           "city in the world in 2022.")


# -- BERT / Contriever ---------------------------------------------------------------------

def _our_embeddings(retriever, ids, mask):
    apply, state = functional(retriever.encoder)
    hidden = apply(state, jnp.asarray(ids), jnp.asarray(mask))
    return np.asarray(pool(hidden, jnp.asarray(mask), retriever.pooling, False))


def _torch_embeddings(directory, ids, mask):
    torch = torch_or_skip()
    from transformers import BertModel

    model = BertModel.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor(ids, dtype=torch.long),
                       attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    m = mask[..., None].astype(np.float32)
    return (hidden * m).sum(1) / m.sum(1)


def _padded_batch(rng, lengths, max_len, vocab):
    ids = np.zeros((len(lengths), max_len), np.int32)
    mask = np.zeros((len(lengths), max_len), np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = random_ids(rng, n, vocab)
        ids[i, 0] = 101  # [CLS]
        mask[i, :n] = 1
    return ids, mask


@pytest.mark.torch
@pytest.mark.models
def test_bert_parity_real_minilm():
    directory = packaged_or_skip("minilm")
    retriever = load_retriever("minilm")
    assert retriever.pooling == "mean" and retriever.normalize
    ids, mask = _padded_batch(np.random.default_rng(0), [1, 7, 64, 129, 256], 256, 30522)
    ours = _our_embeddings(retriever, ids, mask)
    ref = _torch_embeddings(directory, ids, mask)
    assert np.abs(ours - ref).max() <= 1e-4


@pytest.mark.torch
def test_bert_parity_tiny_random_and_export_round_trip(tmp_path):
    directory = save_tiny_bert(tmp_path / "tiny")
    retriever = load_retriever(str(directory))
    assert retriever.pooling == "mean" and not retriever.normalize
    ids, mask = _padded_batch(np.random.default_rng(1), [1, 5, 33, 64], 64, 30522)
    ours = _our_embeddings(retriever, ids, mask)
    np.testing.assert_allclose(ours, _torch_embeddings(directory, ids, mask), atol=1e-5)
    out = export_retriever(retriever, tmp_path / "exported")
    assert not (tmp_path / "exported.partial").exists()
    np.testing.assert_allclose(_torch_embeddings(out, ids, mask), ours, atol=1e-5)
    np.testing.assert_allclose(_our_embeddings(load_retriever(str(out)), ids, mask), ours,
                               atol=1e-6)


@pytest.mark.torch
def test_bert_gradients_equal_pytorch_autograd(tmp_path):
    """The encoder's parameter gradients (our dense backward with serialised dx/dW/db, the
    fused Q/K/V projection, the blocked attention's own backward) against PyTorch autograd on
    the same weights and loss, with padding."""
    import jax

    from replug_jax.models.params import split_params, to_module

    torch = torch_or_skip()
    from transformers import BertModel

    directory = save_tiny_bert(tmp_path / "tiny")
    retriever = load_retriever(str(directory))
    ids, mask = _padded_batch(np.random.default_rng(2), [3, 17, 40], 40, 30522)
    weights_D = np.random.default_rng(3).standard_normal(32).astype(np.float32)
    graphdef, template, params = split_params(retriever.encoder)

    def loss(p):
        hidden = to_module(graphdef, template, p)(jnp.asarray(ids), jnp.asarray(mask))
        return jnp.sum(jnp.tanh(pool(hidden, jnp.asarray(mask))) @ weights_D)

    grads = jax.jit(jax.grad(loss))(params)
    model = BertModel.from_pretrained(str(directory)).eval()
    hidden = model(input_ids=torch.tensor(ids, dtype=torch.long),
                   attention_mask=torch.tensor(mask)).last_hidden_state
    m = torch.tensor(mask, dtype=torch.float32)[..., None]
    (torch.tanh((hidden * m).sum(1) / m.sum(1)) @ torch.from_numpy(weights_D)).sum().backward()
    prefix = "encoder.layer.{}.attention.self."
    theirs = dict(model.named_parameters())
    for i in range(2):
        layer = grads["layers"][i]
        for ours, name in (("query", prefix + "query"), ("key", prefix + "key"),
                           ("value", prefix + "value"),
                           ("intermediate", "encoder.layer.{}.intermediate.dense"),
                           ("output", "encoder.layer.{}.output.dense")):
            ref_w = theirs[name.format(i) + ".weight"].grad.numpy().T
            ref_b = theirs[name.format(i) + ".bias"].grad.numpy()
            scale = np.abs(ref_w).max()
            assert scale > 0
            np.testing.assert_allclose(np.asarray(layer[ours]["kernel"]), ref_w,
                                       atol=1e-4 * scale)
            if ours == "key":  # q·b_k shifts a softmax row by a constant: zero gradient
                assert np.abs(np.asarray(layer[ours]["bias"])).max() < 1e-6 * scale
                continue
            np.testing.assert_allclose(np.asarray(layer[ours]["bias"]), ref_b,
                                       atol=1e-4 * np.abs(ref_b).max())


# -- Llama (SmolLM2 from the GGUF) ---------------------------------------------------------

@pytest.fixture(scope="module")
def smollm():
    packaged_or_skip("smollm2")
    return load_lm("smollm2")


def _forward_logprobs(lm, ids_BL, positions_BL):
    apply, state = functional(lm.model)
    logits, _ = apply(state, jnp.asarray(ids_BL), jnp.asarray(positions_BL))
    return np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(ids_BL[:, 1:])))


@pytest.mark.models
def test_smollm_perplexity_and_capital(smollm):
    tok = smollm.tokenizer
    ids = np.array([tok(FACTUAL).input_ids])
    lp = _forward_logprobs(smollm, ids, np.arange(ids.shape[1])[None])
    ppl = math.exp(-lp.mean())
    words = FACTUAL.split()
    np.random.default_rng(0).shuffle(words)
    ids_s = np.array([tok(" ".join(words)).input_ids])
    ppl_shuffled = math.exp(-_forward_logprobs(smollm, ids_s, np.arange(ids_s.shape[1])[None])
                            .mean())
    assert 3.0 < ppl < 8.0, ppl
    assert ppl_shuffled > 20 * ppl
    prompt = np.array([tok("The capital of Germany is").input_ids])
    apply, state = functional(smollm.model)
    logits, _ = apply(state, jnp.asarray(prompt), jnp.arange(prompt.shape[1])[None])
    assert tok.decode([int(np.argmax(logits[0, -1]))]) == " Berlin"


@pytest.mark.models
def test_left_padding_changes_nothing(smollm):
    tok = smollm.tokenizer
    a = tok("The capital of Germany is Berlin.").input_ids
    b = tok("Water boils at").input_ids
    L = max(len(a), len(b)) + 3
    ids = np.zeros((2, L), np.int32)
    pos = np.full((2, L), -1, np.int32)
    for i, seq in enumerate((a, b)):
        ids[i, L - len(seq):] = seq
        pos[i, L - len(seq):] = np.arange(len(seq))
    batched = _forward_logprobs(smollm, ids, pos)
    for i, seq in enumerate((a, b)):
        alone = _forward_logprobs(smollm, np.array([seq]), np.arange(len(seq))[None])[0]
        np.testing.assert_allclose(batched[i, L - len(seq):], alone, atol=2e-4)


@pytest.mark.models
def test_kv_cache_equals_full_forward(smollm):
    rng = np.random.default_rng(0)
    ids = random_ids(rng, (2, 12), smollm.config.vocab_size)
    pos = np.broadcast_to(np.arange(12), (2, 12)).astype(np.int32)
    apply, state = functional(smollm.model)
    full, _ = apply(state, jnp.asarray(ids), jnp.asarray(pos))
    cache = init_cache(smollm.config, 2, 16)
    step_logits = []
    logits, cache = apply(state, jnp.asarray(ids[:, :8]), jnp.asarray(pos[:, :8]), cache)
    step_logits.append(logits)
    for t in range(8, 12):
        logits, cache = apply(state, jnp.asarray(ids[:, t:t + 1]), jnp.asarray(pos[:, t:t + 1]),
                              cache)
        step_logits.append(logits)
    np.testing.assert_allclose(np.concatenate(step_logits, axis=1), full, atol=2e-3, rtol=1e-4)
    assert int(cache["end"]) == 12


@pytest.mark.torch
@pytest.mark.models
def test_llama_parity_against_transformers_gguf_loader(smollm):
    torch = torch_or_skip()
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    from transformers import AutoModelForCausalLM

    gguf = packaged_or_skip("smollm2")
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                               dtype=torch.float32).eval()
    ids = np.array([smollm.tokenizer(FACTUAL).input_ids])
    with torch.no_grad():
        ref_logp = torch.log_softmax(ref(torch.tensor(ids, dtype=torch.long)).logits, -1)
    ref_lp = np.take_along_axis(ref_logp[0, :-1].numpy(), ids[0, 1:, None], -1)[:, 0]
    ours = _forward_logprobs(smollm, ids, np.arange(ids.shape[1])[None])[0]
    assert np.abs(ours - ref_lp).max() <= 1e-3


# Llama 3.1/3.2's RoPE scaling. With head_dim 16 and theta 50000 the wavelengths
# (6.3, 24, 94, ...) fall in each band around original/high = 8 and original/low = 32.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


@pytest.mark.torch
@pytest.mark.models
@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["plain_rope", "llama3_rope"])
def test_llama_hf_layout_tiny_random(tmp_path, rope):
    torch = torch_or_skip()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      rope_theta=50000.0, tie_word_embeddings=False,
                      max_position_embeddings=128, rope_parameters=rope)
    ref = LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path)
    write_smollm_tokenizer(tmp_path)
    lm = load_lm(str(tmp_path))
    assert (lm.config.rope_llama3 is None) == (rope is None)
    ids = random_ids(np.random.default_rng(2), (2, 40), 49152)  # longer than original (32)
    apply, state = functional(lm.model)
    ours, _ = apply(state, jnp.asarray(ids), jnp.broadcast_to(jnp.arange(40), (2, 40)))
    with torch.no_grad():
        theirs = ref(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(np.asarray(ours) - theirs).max() <= 1e-4
    # Scoring projects a slice of rows at a time: the log-probs of the full logits.
    x_BLD, _ = lm.model.hidden(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(40), (2, 40)))
    targets = np.roll(ids, -1, axis=1)
    want = token_logprobs(jnp.asarray(theirs), jnp.asarray(targets))
    for rows in (1, 2):
        got = target_logprobs(lm.model, x_BLD, jnp.asarray(targets), rows)
        np.testing.assert_allclose(got, want, atol=1e-4)


# -- GPT-2 --------------------------------------------------------------------------------

@pytest.mark.torch
def test_gpt2_parity_tiny_random(tmp_path):
    torch = torch_or_skip()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=49152, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    ref = GPT2LMHeadModel(cfg).eval()
    ref.save_pretrained(tmp_path)
    write_smollm_tokenizer(tmp_path)
    lm = load_lm(str(tmp_path))
    ids = random_ids(np.random.default_rng(3), (2, 16), 49152)
    apply, state = functional(lm.model)
    ours, _ = apply(state, jnp.asarray(ids), jnp.broadcast_to(jnp.arange(16), (2, 16)))
    with torch.no_grad():
        theirs = ref(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(np.asarray(ours) - theirs).max() <= 1e-4
    # GPT-2 with a KV cache too.
    cache = init_cache(lm.config, 2, 16)
    pos = np.broadcast_to(np.arange(16), (2, 16)).astype(np.int32)
    first, cache = apply(state, jnp.asarray(ids[:, :10]), jnp.asarray(pos[:, :10]), cache)
    rest, cache = apply(state, jnp.asarray(ids[:, 10:]), jnp.asarray(pos[:, 10:]), cache)
    np.testing.assert_allclose(np.concatenate([first, rest], 1), theirs, atol=1e-4)


# -- OPT ----------------------------------------------------------------------------------

@pytest.mark.torch
@pytest.mark.parametrize("variant", ["pre_ln", "post_ln_projected"])
def test_opt_parity_tiny_random(tmp_path, variant):
    """OPT (learned positions offset by 2, ReLU, biases): pre-LN as OPT-125m..66b, and the
    OPT-350m variant (post-LN, no final norm, 32-wide embedding projected to the 64-wide
    model), against transformers' OPTForCausalLM; right padding, and a KV cache."""
    torch = torch_or_skip()
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    post = variant == "post_ln_projected"
    cfg = OPTConfig(vocab_size=49152, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=64,
                    do_layer_norm_before=not post, word_embed_proj_dim=32 if post else 64,
                    pad_token_id=2, bos_token_id=1, eos_token_id=2)
    ref = OPTForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path)
    write_smollm_tokenizer(tmp_path)
    lm = load_lm(str(tmp_path))
    assert lm.config.family == "opt" and lm.config.final_norm is (not post)
    assert (lm.config.embed_dim == 32) is post
    ids = random_ids(np.random.default_rng(4), (2, 24), 49152)
    apply, state = functional(lm.model)
    pos = np.broadcast_to(np.arange(24), (2, 24)).astype(np.int32)
    ours, _ = apply(state, jnp.asarray(ids), jnp.asarray(pos))
    with torch.no_grad():
        theirs = ref(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(np.asarray(ours) - theirs).max() <= 1e-4
    # Row 1 right-padded after 15 tokens: its real positions are unchanged.
    pos_pad = pos.copy()
    pos_pad[1, 15:] = -1
    padded, _ = apply(state, jnp.asarray(ids), jnp.asarray(pos_pad))
    np.testing.assert_allclose(np.asarray(padded)[1, :15], theirs[1, :15], atol=1e-4)
    cache = init_cache(lm.config, 2, 24)
    first, cache = apply(state, jnp.asarray(ids[:, :10]), jnp.asarray(pos[:, :10]), cache)
    rest, cache = apply(state, jnp.asarray(ids[:, 10:]), jnp.asarray(pos[:, 10:]), cache)
    np.testing.assert_allclose(np.concatenate([first, rest], 1), theirs, atol=1e-4)


# -- bad input ------------------------------------------------------------------------------

def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(WeightsError, match="no weights found"):
        load_retriever(str(tmp_path))


@pytest.mark.torch
def test_truncated_safetensors(tmp_path):
    directory = save_tiny_bert(tmp_path / "tiny")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(WeightsError, match="model.safetensors.*truncated or corrupt"):
        load_retriever(str(directory))


@pytest.mark.torch
def test_wrong_shape_and_missing_tensor_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = save_tiny_bert(tmp_path / "tiny")
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["encoder.layer.1.intermediate.dense.weight"] = np.zeros((7, 32), np.float32)
    save_file(tensors, str(weights))
    with pytest.raises(WeightsError, match="encoder.layer.1.intermediate.dense.weight"):
        load_retriever(str(directory))
    del tensors["encoder.layer.1.intermediate.dense.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(WeightsError, match="missing tensor.*encoder.layer.1.intermediate"):
        load_retriever(str(directory))


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="config.json.*unsupported architecture.*mamba"):
        load_lm(str(tmp_path))


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WeightsError, match="tiny.gguf.*architecture 'mamba'"):
        load_lm(str(path))


def test_missing_source_and_offline_hub(monkeypatch):
    with pytest.raises(WeightsError, match="no such file"):
        load_lm("./does/not/exist.gguf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsError, match="HF_HUB_OFFLINE"):
        load_lm("someone/not-a-cached-model")


def test_packaged_names_resolve():
    from replug_jax.models.weights import resolve

    minilm = packaged_or_skip("minilm")
    assert resolve("minilm").path == minilm and resolve("minilm").kind == "hf_dir"
    assert resolve("smollm2").kind == "gguf"
    assert isinstance(pathlib.Path(resolve("smollm2").path), pathlib.Path)


@pytest.mark.torch
@pytest.mark.models
def test_gguf_tokenizer_equals_transformers_conversion():
    torch_or_skip()
    from transformers import AutoTokenizer

    from replug_jax.models import load_tokenizer

    gguf = packaged_or_skip("smollm2")
    ours = load_tokenizer("smollm2")
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for text in [FACTUAL, "  spaces\n\nnewlines\ttabs", "12345 3.14 émigré café ☕ 中文",
                 "<|im_start|>user\nHi<|im_end|>\n", "def f(x):\n    return x**2"]:
        assert ours(text).input_ids == ref(text).input_ids
        assert ours.decode(ours(text).input_ids) == text
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)


BF16_TEXT = ("The Danube is the second-longest river in Europe, after the Volga. It flows through "
             "much of Central and Southeastern Europe, from the Black Forest into the Black Sea. "
             "Its drainage basin extends into nine more countries.")


def test_bfloat16_path_within_its_stated_tolerance_of_float32():
    """The bf16 contract (weights and activations bf16, f32 accumulation and log-softmax): per
    token |Δ log p| ≤ 0.15 nats (measured 0.084), mean ≤ 0.03 (0.023), bits per byte within
    1 % (0.4 %) of the float32 path on SmolLM2-135M. The f32 parity tests stay exact."""
    from replug_jax.lm.flax_scorer import FlaxLM

    packaged_or_skip("smollm2")
    logprobs = {}
    for dtype in ("float32", "bfloat16"):
        lm = FlaxLM.load("smollm2", dtype=dtype, max_context=256)
        [s] = lm.score_continuations(["Rivers of Europe.\n\n"], [BF16_TEXT])
        logprobs[dtype] = s.logprobs.astype(np.float64)
    diff = np.abs(logprobs["float32"] - logprobs["bfloat16"])
    assert diff.max() <= 0.15 and diff.mean() <= 0.03
    nbytes = len(BF16_TEXT.encode())
    bpb = {k: -v.sum() / (math.log(2) * nbytes) for k, v in logprobs.items()}
    assert abs(bpb["bfloat16"] - bpb["float32"]) <= 0.01 * bpb["float32"]


def test_xla_cpu_defaults_added_once_and_never_over_the_users_flags():
    """Importing replug_jax adds the YNNPACK dot flag on verified jaxlib releases only, keeps
    flags the user set, and adds nothing when opted out."""
    import os
    import subprocess
    import sys
    from importlib.metadata import version

    import replug_jax

    def flags(**env):
        out = subprocess.run([sys.executable, "-c", "import os, replug_jax; "
                              "print(os.environ.get('XLA_FLAGS', ''))"],
                             env={**{k: v for k, v in os.environ.items()
                                     if k not in ("XLA_FLAGS", "REPLUG_XLA_CPU_DEFAULTS")},
                                  **env}, capture_output=True, text=True, check=True)
        return out.stdout.strip()

    ynn = "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
    verified = tuple(int(x) for x in version("jaxlib").split(".")[:2]) in \
        replug_jax._YNN_VERIFIED
    assert flags() == (ynn if verified else "")
    assert flags(XLA_FLAGS="--xla_cpu_enable_fast_math=false") == (
        "--xla_cpu_enable_fast_math=false" + (f" {ynn}" if verified else ""))
    mine = "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT"
    assert flags(XLA_FLAGS=mine) == mine
    assert flags(REPLUG_XLA_CPU_DEFAULTS="0") == ""


def test_retriever_loading_enters_each_models_module_once():
    """Following a retriever from the pipeline to its weights: one call enters the models
    package (loading.load_retriever), loading calls weights once (load_model), weights asks the
    registry once, and the architecture module is used only through its small interface."""
    import sys

    from replug_jax.retrieval.encoder import Retriever

    packaged_or_skip("minilm")
    calls = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "")
        if callee.startswith("replug_jax.models") and caller.startswith("replug_jax.") \
                and caller != callee:
            calls.append((caller.rsplit(".", 1)[-1], callee.rsplit(".", 1)[-1],
                          frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        Retriever.load("minilm")
    finally:
        sys.setprofile(None)
    models = ("loading", "weights", "registry", "bert", "layers", "params", "__init__")
    entries = [c for c in calls if c[0] not in models and c[1] in ("loading", "weights",
                                                                     "registry", "__init__")]
    assert entries == [("encoder", "loading", "load_retriever")], entries
    assert [c[2] for c in calls if c[:2] == ("loading", "weights")] == ["load_model"]
    assert [c[2] for c in calls if c[:2] == ("weights", "registry")] == ["architecture"]
    used = {c[2] for c in calls if c[:2] == ("weights", "bert")}
    assert used <= {"config_from_hf", "hf_tensors", "hf_name_map", "hf_ignored", "build"}, used
    assert not [c for c in calls if c[1] == "__init__" and c[0] != "__init__"], calls


def test_decoder_compiles_one_layer_whatever_its_depth():
    """The blocks are stacked and scanned: the lowered forward holds one layer's matmuls
    whether the model has 2 layers or 6, and the deeper model still computes 6 layers (its
    logits differ from the 2-layer prefix of the same weights)."""
    from flax import nnx

    from replug_jax.models.decoder import CausalLM, DecoderConfig, functional

    def lowered(num_layers):
        cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                            num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8,
                            max_position=32)
        apply, state = functional(CausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
        tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
        positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
        text = apply.lower(state, tokens, positions).as_text()
        return text.count("dot_general"), apply(state, tokens, positions)[0]

    dots_2, logits_2 = lowered(2)
    dots_6, logits_6 = lowered(6)
    assert dots_2 == dots_6 >= 5  # q, k, v, o, MLP (fused or not), attention, the head
    assert np.abs(np.asarray(logits_6) - np.asarray(logits_2)).max() > 1e-3
