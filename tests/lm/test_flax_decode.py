"""The compiled coordinated decoding of an in-process LM (replug_jax/lm/flax_decode.py):
K copies of one branch give the plain LM's greedy tokens whatever their weights, and a
stop string ends the text and the tokens together."""

import numpy as np

from replug_jax.lm.flax_decode import EnsembleGeneration
from tests._models import tiny_lm


def test_copies_of_one_branch_decode_as_the_plain_lm_and_stop_cuts_tokens_too():
    lm = tiny_lm(seed=3)
    prompt = "The capital of France is"
    one = lm.generate_ensemble([[prompt]], np.zeros((1, 1)), max_new_tokens=8)
    three = lm.generate_ensemble([[prompt] * 3], np.log(np.array([[0.7, 0.2, 0.1]])),
                                 max_new_tokens=8)
    assert isinstance(one, EnsembleGeneration)
    assert three.token_ids == one.token_ids and three.texts == one.texts
    np.testing.assert_allclose(three.mixture_logprobs[0], one.mixture_logprobs[0], atol=1e-5)
    np.testing.assert_allclose(three.branch_logprobs[0], np.repeat(one.branch_logprobs[0], 3,
                                                                   0), atol=1e-5)
    # greedy: each chosen token is the argmax of the LM's own next-token distribution
    ids = lm.bos + lm.encode(prompt)
    for t, tok in enumerate(one.token_ids[0]):
        lp_V = lm.next_token_logprobs_ids([ids + one.token_ids[0][:t]])[0]
        assert tok == int(np.argmax(lp_V))
        np.testing.assert_allclose(one.mixture_logprobs[0][t], lp_V[tok], atol=1e-4)
    # a stop string inside the text: the text ends before it and so do the tokens
    text = one.texts[0]
    stop = text[len(text) // 2:][:2]
    cut = lm.generate_ensemble([[prompt]], np.zeros((1, 1)), max_new_tokens=8, stop=[stop])
    assert cut.stopped_by == ["stop"] and cut.texts[0] == text[:text.find(stop)]
    # the tokens kept are those that begin before the stop string (the last may hold its start)
    kept = cut.token_ids[0]
    assert lm.tokenizer.decode(kept).startswith(cut.texts[0])
    assert len(lm.tokenizer.decode(kept[:-1])) < len(cut.texts[0])
    assert len(cut.mixture_logprobs[0]) == len(cut.token_ids[0]) < len(one.token_ids[0])
