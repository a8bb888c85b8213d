"""The HTTP backend against `replug serve` on 127.0.0.1, and its failure handling."""

import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from replug_jax.lm.api_scorer import CONFORMANCE_TEXT, APIError, APIScorer
from replug_jax.lm.flax_scorer import FlaxLM
from replug_jax.replug import Replug
from tests._models import packaged_or_skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    """The packaged SmolLM2 behind our FastAPI server, in a thread on 127.0.0.1."""
    import uvicorn

    from replug_jax.lm.server import create_app

    packaged_or_skip("smollm2")
    lm = FlaxLM.load("smollm2", max_context=512)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(lm, "smollm2"), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    yield lm, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.models
def test_api_scores_equal_in_process(served):
    lm, url = served
    api = APIScorer(url, model="smollm2", tokenizer="smollm2", max_context=512)
    prompts = ["The capital of Germany is", "Water boils at a temperature of"]
    conts = [" Berlin, a city on the Spree.", " 100 degrees Celsius at sea level."]
    ours = lm.score_continuations(prompts, conts)
    theirs = api.score_continuations(prompts, conts)
    for a, b in zip(ours, theirs):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert api.conformance_check()["mean_logprob"] > -2.5
    prompt, rest = CONFORMANCE_TEXT.split(", five")
    api.conformance_check(reference=lm.score_continuations([prompt], [", five" + rest])[0]
                          .logprobs)
    assert api.cost.snapshot()["lm_calls"] >= 2
    api.close()


@pytest.mark.models
def test_api_prompt_logprobs_and_top_logprobs(served):
    lm, url = served
    api = APIScorer(url, scoring="prompt_logprobs")
    [a] = lm.score_continuations(["The capital of France is"], [" Paris."])
    [b] = api.score_continuations(["The capital of France is"], [" Paris."])
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    [top] = api.top_logprobs(["The capital of Germany is"], 5)
    exact = lm.next_token_logprobs(["The capital of Germany is"])[0]
    best = int(np.argmax(exact))
    assert top[lm.tokenizer.decode([best])] == pytest.approx(float(exact[best]), abs=1e-4)


@pytest.mark.models
def test_api_pipeline_marks_top_n_ensemble_as_approximate(served):
    lm, url = served
    from replug_jax.retrieval.corpus import Passage
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.retrieval.index import Index

    retriever = Retriever.load("minilm")
    docs = ["Berlin is the capital of Germany.", "Paris is the capital of France."]
    index = Index.build(retriever.encode_passages(docs), [Passage(i, d) for i, d in
                                                          enumerate(docs)])
    api = APIScorer(url, tokenizer="smollm2", max_context=512)
    pipe = Replug(api, retriever, index, k=2, top_n=5)
    [gen] = pipe.generate(["The capital of Germany is"], max_new_tokens=2)
    assert "approximate" in gen.approximation and gen.text.strip().startswith("Berlin")
    [exact] = Replug(lm, retriever, index, k=2).generate(["The capital of Germany is"],
                                                         max_new_tokens=2)
    assert exact.approximation is None and exact.text.strip().startswith("Berlin")
    [scored] = pipe.score(["The capital of Germany is"], [" Berlin."])
    [scored_local] = Replug(lm, retriever, index, k=2).score(["The capital of Germany is"],
                                                            [" Berlin."])
    np.testing.assert_allclose(scored.token_logprobs, scored_local.token_logprobs, atol=1e-4)


def _ok_body(prompt="ab"):
    return {"choices": [{"text": prompt, "logprobs": {
        "tokens": ["a", "b"], "token_logprobs": [None, -0.5], "text_offset": [0, 1]}}]}


def test_retries_500_then_succeeds():
    calls = []

    def handler(request):
        calls.append(json.loads(request.content))
        if len(calls) == 1:
            return httpx.Response(500, text="overloaded")
        return httpx.Response(200, json=_ok_body())

    api = APIScorer("http://mock", transport=httpx.MockTransport(handler), backoff=0.01)
    [s] = api.score_continuations(["a"], ["b"])
    assert len(calls) == 2 and s.tokens == ["b"] and s.logprobs[0] == pytest.approx(-0.5)
    assert calls[0]["echo"] is True and calls[0]["max_tokens"] == 0


def test_429_exhausts_retries_with_clear_error():
    api = APIScorer("http://mock", transport=httpx.MockTransport(
        lambda r: httpx.Response(429)), backoff=0.001, max_retries=2)
    with pytest.raises(APIError, match="failed after 3 attempts.*HTTP 429"):
        api.score_continuations(["a"], ["b"])


def test_malformed_json_and_logprobs():
    api = APIScorer("http://mock", transport=httpx.MockTransport(
        lambda r: httpx.Response(200, text="{not json")))
    with pytest.raises(APIError, match="malformed JSON"):
        api.score_continuations(["a"], ["b"])
    bad = _ok_body()
    bad["choices"][0]["logprobs"]["token_logprobs"] = [None, "x"]
    api = APIScorer("http://mock", transport=httpx.MockTransport(
        lambda r: httpx.Response(200, json=bad)))
    with pytest.raises(APIError, match="malformed log-probs"):
        api.score_continuations(["a"], ["b"])
    api = APIScorer("http://mock", transport=httpx.MockTransport(
        lambda r: httpx.Response(200, json={"choices": [{"text": "", "logprobs": None}]})))
    with pytest.raises(APIError, match="does not support echo"):
        api.score_continuations(["a"], ["b"])
    api = APIScorer("http://mock", transport=httpx.MockTransport(
        lambda r: httpx.Response(400, text="bad request")))
    with pytest.raises(APIError, match="HTTP 400"):
        api.score_continuations(["a"], ["b"])


def test_timeout_is_a_clear_error_not_a_hang():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections, never answers
    port = listener.getsockname()[1]
    api = APIScorer(f"http://127.0.0.1:{port}", timeout=0.3, max_retries=1, backoff=0.01)
    t0 = time.time()
    with pytest.raises(APIError, match="timed out after 0.3s"):
        api.score_continuations(["a"], ["b"])
    assert time.time() - t0 < 5
    listener.close()


def test_api_key_is_sent_and_never_shown(monkeypatch):
    monkeypatch.setenv("REPLUG_API_KEY", "sk-secret-123")
    seen = {}

    def handler(request):
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(503, text="down")

    api = APIScorer("http://mock", transport=httpx.MockTransport(handler), max_retries=0)
    with pytest.raises(APIError) as err:
        api.score_continuations(["a"], ["b"])
    assert seen["auth"] == "Bearer sk-secret-123"
    assert "sk-secret" not in str(err.value) and "sk-secret" not in repr(api)


def test_text_only_backend_refuses_replug():
    from replug_jax.lm.scorer import CapabilityError, CostMeter

    class TextOnly:
        name = "text-only"
        capabilities = frozenset({"generate_text"})
        cost = CostMeter()
        max_context = None

    pipe = Replug(TextOnly(), mode="none")
    with pytest.raises(CapabilityError, match="score_continuations"):
        pipe.score(["a"], ["b"])
    with pytest.raises(CapabilityError, match="neither next-token"):
        pipe.generate(["a"], 2)
