"""Parsing served log-probs (lm/api_protocol.py): echo spans over any byte tokenisation,
text offsets in characters only, malformed fields refused in one line."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


_TEXT = st.text(alphabet=st.sampled_from(list("ab ,東é🙂")), min_size=1, max_size=10)


@settings(max_examples=200, deadline=None)
@given(text=_TEXT, data=st.data())
def test_echo_spans_over_random_byte_tokenisations(text, data):
    """content[] tokens with their bytes, cut anywhere (inside characters too): a token is
    continuation iff its bytes end after the prompt's, whatever the cut."""
    from replug_jax.lm.api_protocol import parse_logprobs

    raw = text.encode("utf-8")
    cuts = sorted(data.draw(st.sets(st.integers(1, len(raw) - 1), max_size=6))) \
        if len(raw) > 1 else []
    pieces = [raw[a:b] for a, b in zip([0] + cuts, cuts + [len(raw)])]
    block = parse_logprobs({"content": [
        {"token": p.decode("utf-8", errors="replace"), "bytes": list(p), "logprob": -1.0}
        for p in pieces]})
    assert "".join(block.tokens) == text  # joined before decoding: no U+FFFD
    cut = data.draw(st.integers(0, len(text)))
    prompt_bytes = len(text[:cut].encode("utf-8"))
    ends = np.cumsum([len(p) for p in pieces])
    got = [i for i, (_, end) in enumerate(block.spans(text)) if end > cut]
    assert got == [i for i, e in enumerate(ends) if e > prompt_bytes]


@settings(max_examples=200, deadline=None)
@given(text=_TEXT, data=st.data())
def test_echo_offsets_in_characters_pass_and_in_bytes_or_zero_are_refused(text, data):
    from replug_jax.lm.api_protocol import APIResponseError, parse_logprobs

    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=6))) \
        if len(text) > 1 else []
    tokens = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    chars = [0, *np.cumsum([len(t) for t in tokens])[:-1].tolist()]
    nbytes = [0, *np.cumsum([len(t.encode()) for t in tokens])[:-1].tolist()]

    def block(offsets):
        return parse_logprobs({"tokens": tokens, "token_logprobs": [None] + [-1.0] * (
            len(tokens) - 1), "text_offset": offsets})

    assert [s for s, _ in block(chars).spans(text)] == chars
    for wrong in (nbytes, [0] * len(tokens)):
        if wrong != chars:
            with pytest.raises(APIResponseError, match="text_offset does not match") as err:
                block(wrong).spans(text)
            assert "\n" not in str(err.value)
    with pytest.raises(APIResponseError, match="tokens are not the text"):
        block(chars).spans(text + "x")


def test_echo_with_byte_offsets_is_refused_through_the_scorer():
    """A server counting text_offset in bytes once shifted prompt tokens into the
    continuation (-13.5 instead of -0.5); now the scorer refuses in one line."""
    import httpx

    from replug_jax.lm.api_protocol import APIResponseError
    from replug_jax.lm.api_scorer import APIScorer

    tokens = ["日本", "語", " is", " hard"]
    byte_offsets = [0, 6, 9, 12]

    def reply(request):
        return httpx.Response(200, json={"choices": [{"text": "", "logprobs": {
            "tokens": tokens, "token_logprobs": [None, -13.5, -0.2, -0.5],
            "text_offset": byte_offsets, "top_logprobs": None}}]})

    api = APIScorer("http://x", transport=httpx.MockTransport(reply))
    with pytest.raises(APIResponseError, match="text_offset does not match"):
        api.score_continuations(["日本語 is"], [" hard"])
    good = [0, 2, 3, 6]

    def reply_good(request):
        return httpx.Response(200, json={"choices": [{"text": "", "logprobs": {
            "tokens": tokens, "token_logprobs": [None, -13.5, -0.2, -0.5],
            "text_offset": good, "top_logprobs": None}}]})

    api = APIScorer("http://x", transport=httpx.MockTransport(reply_good))
    [s] = api.score_continuations(["日本語 is"], [" hard"])
    assert s.logprobs.tolist() == [-0.5]


@pytest.mark.parametrize("block, message", [
    ({"tokens": ["a", "b"], "token_logprobs": [None, -1.0], "text_offset": [0, None]},
     "text_offset is"),
    ({"tokens": ["a", None], "token_logprobs": [None, -1.0]}, "tokens\\[1\\] is None"),
    ({"content": [{"token": "a", "logprob": -1.0, "top_logprobs": ["x"]}]}, "not an object"),
    ({"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": "x"}, "top log-probs"),
])
def test_malformed_api_fields_are_one_line(block, message):
    from replug_jax.lm.api_protocol import APIResponseError, parse_logprobs

    with pytest.raises(APIResponseError, match=message) as err:
        parse_logprobs(block)
    assert "\n" not in str(err.value)


def test_malformed_prompt_logprobs_token_is_one_line():
    from replug_jax.lm.api_protocol import APIResponseError, parse_prompt_logprobs

    with pytest.raises(APIResponseError, match="decoded_token is None"):
        parse_prompt_logprobs([None, {"5": {"logprob": -1.0, "decoded_token": None}}])

