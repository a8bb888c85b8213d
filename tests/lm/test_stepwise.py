"""Coordinated decoding one call per branch per token (replug_jax/lm/stepwise.py), as with a
served LM: each token is the argmax of the hand-computed mixture Σ_k λ_k p_k (§3.2), and
with top-n log-probs alone the approximation is named and bounded."""

import types

import numpy as np
import pytest

from replug_jax.lm.scorer import NEXT_TOKEN, TOP_LOGPROBS
from replug_jax.lm.stepwise import generate_stepwise

VOCAB = ["a", "b", "c", "."]


class ToyLM:
    """Next-token distributions that depend on the branch and on how much was generated."""

    eos_token = None
    name = "toy"
    tokenizer = types.SimpleNamespace(decode=lambda ids: "".join(VOCAB[i] for i in ids))

    def __init__(self, capabilities):
        self.capabilities = frozenset(capabilities)
        self.calls = 0

    def table(self, prompt: str) -> np.ndarray:
        branch, done = prompt[0], len(prompt) - 1  # prompts are "0", "1": one letter
        p = {"0": [[0.6, 0.3, 0.05, 0.05], [0.1, 0.5, 0.3, 0.1], [0.0, 0.0, 0.1, 0.9]],
             "1": [[0.1, 0.8, 0.05, 0.05], [0.2, 0.1, 0.6, 0.1], [0.0, 0.0, 0.1, 0.9]]}
        return np.log(np.asarray(p[branch][min(done, 2)], np.float64) + 1e-30)

    def next_token_logprobs(self, prompts):
        self.calls += 1
        return np.stack([self.table(p) for p in prompts]).astype(np.float32)

    def top_logprobs(self, prompts, n, generated=""):
        out = []
        for p in prompts:
            lp = self.table(p + generated)
            keep = np.argsort(-lp)[:n]
            out.append({VOCAB[i]: float(lp[i]) for i in keep})
        return out


def _group(weights):
    return types.SimpleNamespace(prompts=["0", "1"], log_weights=np.log(np.asarray(weights)))


def test_exact_stepwise_decoding_follows_the_mixture():
    lm = ToyLM({NEXT_TOKEN})
    (out,), note = generate_stepwise(lm, [_group([0.5, 0.5])], 2, 5, 0.0, 1.0, ["."], 0)
    text, toks, mix, branch, stopped = out
    # step 1: 0.5·[.6,.3,..] + 0.5·[.1,.8,..] -> b (0.55); step 2: [.15,.3,.45,.1] -> c;
    # step 3: '.' (0.9) is the stop string: cut, not returned
    assert (text, toks, stopped, note) == ("bc", ["b", "c"], "stop", None)
    np.testing.assert_allclose(np.exp(mix), [0.55, 0.45], rtol=1e-5)
    np.testing.assert_allclose(np.exp(branch), [[0.3, 0.3], [0.8, 0.6]], rtol=1e-5)
    assert lm.calls == 3  # the K branches of a step in one call
    # the weights decide: branch 0 alone at 0.9
    (out,), _ = generate_stepwise(lm, [_group([0.9, 0.1])], 2, 1, 0.0, 1.0, [], 0)
    assert out[0] == "a" and out[4] == "length"


def test_top_n_alone_is_an_approximation_that_says_its_bound():
    (out,), note = generate_stepwise(ToyLM({TOP_LOGPROBS}), [_group([0.5, 0.5])], 2, 2, 0.0,
                                     1.0, [], 0)
    # step 1: top-2 of branch 0 {a, b}, of branch 1 {b, a}: the same choice as exact
    assert out[0] == "bc"
    assert note.startswith("approximate ensemble: only the top-2 log-probs")
    bound = float(note.split("at most ")[1].split(" nats")[0])
    assert 0 < bound < np.log(2)


def test_an_lm_with_neither_capability_is_refused():
    from replug_jax.lm.scorer import CapabilityError

    with pytest.raises(CapabilityError):
        generate_stepwise(ToyLM(()), [_group([0.5, 0.5])], 2, 2, 0.0, 1.0, [], 0)
