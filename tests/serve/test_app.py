"""`replug serve` under load and hostile input: batching, the queue, limits, the API key,
and fuzzed request bodies."""

import concurrent.futures as cf
import json
import logging
import threading
import time

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replug_jax.serve.limits import ServeLimits
from tests._models import packaged_or_skip
from tests.helpers import free_port

KEY = "sk-test-4f1d9c2b7a"
PROMPTS = ["The capital of Germany is", "Water boils at", "The largest planet is",
           "Python is a programming", "The opposite of hot is", "Two plus two equals",
           "The sun rises in the", "Bees make"]


@pytest.fixture(scope="module")
def lm():
    from replug_jax.lm.flax_scorer import FlaxLM

    packaged_or_skip("smollm2")
    return FlaxLM.load("smollm2", max_context=256)


class Server:
    def __init__(self, lm, limits: ServeLimits, api_key: str | None = None):
        import uvicorn

        from replug_jax.serve.app import create_app

        self.app = create_app(lm, "smollm2", limits=limits, api_key=api_key)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="info"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def post(self, body, key: str | None = None, **kw):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.url}/v1/completions", json=body, headers=headers,
                          timeout=120, **kw)


def _score(prompt):
    return {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}


def _greedy(prompt):
    return {"prompt": prompt, "max_tokens": 6, "temperature": 0}


@pytest.mark.models
def test_concurrent_requests_are_batched_and_equal_sequential_ones(lm):
    limits = ServeLimits(max_batch=8, batch_window_s=0.2)
    with Server(lm, limits) as srv:
        bodies = [_score(p) for p in PROMPTS] + [_greedy(p) for p in PROMPTS]
        sequential = [srv.post(b).json() for b in bodies]
        before = httpx.get(f"{srv.url}/health").json()
        with cf.ThreadPoolExecutor(16) as pool:
            concurrent = list(pool.map(lambda b: srv.post(b).json(), bodies))
        after = httpx.get(f"{srv.url}/health").json()
    assert before["largest_batch"] == 1 and after["largest_batch"] > 1
    assert after["batches"] - before["batches"] < len(bodies)  # shared forward passes
    for seq, con in zip(sequential, concurrent):
        a, b = seq["choices"][0], con["choices"][0]
        assert a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"]
        if a["logprobs"]:
            lp_a = [x for x in a["logprobs"]["token_logprobs"] if x is not None]
            lp_b = [x for x in b["logprobs"]["token_logprobs"] if x is not None]
            np.testing.assert_allclose(lp_a, lp_b, atol=1e-4)
        assert seq["usage"] == con["usage"]


@pytest.mark.models
def test_a_full_queue_answers_429_and_the_clients_retry_succeeds(lm):
    from replug_jax.lm.api_scorer import APIScorer

    limits = ServeLimits(queue_size=1, max_batch=1, batch_window_s=0.0)
    with Server(lm, limits) as srv:
        slow = {"prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0.7, "seed": 1}
        with cf.ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(lambda _: srv.post(slow), range(6)))
        codes = sorted(r.status_code for r in responses)
        assert 429 in codes and 200 in codes, codes
        busy = next(r for r in responses if r.status_code == 429)
        assert busy.headers["retry-after"] == "1"
        assert "queue_size" in busy.json()["error"]["message"]
        api = APIScorer(srv.url, model="smollm2", tokenizer="smollm2", max_context=256,
                        max_retries=6)
        with cf.ThreadPoolExecutor(3) as pool:  # two of these meet a full queue, then retry
            scores = list(pool.map(lambda p: api.score_continuations([p], [" ok"])[0],
                                   PROMPTS[:3]))
        assert all(np.isfinite(s.logprobs).all() for s in scores)
        assert httpx.get(f"{srv.url}/health").json()["rejected_full"] >= 1


@pytest.mark.models
@pytest.mark.parametrize("body, limit", [
    ({"prompt": ["a"] * 5, "max_tokens": 0}, "max_prompts"),
    ({"prompt": "a", "max_tokens": 9}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0, "logprobs": 4}, "max_logprobs"),
    ({"prompt": "a", "max_tokens": 0, "prompt_logprobs": 4}, "max_prompt_logprobs"),
    ({"prompt": "a" * 3000, "max_tokens": 0}, "max_body_bytes"),
])
def test_every_limit_is_a_400_that_names_it(lm, body, limit):
    limits = ServeLimits(max_prompts=4, max_tokens=8, max_logprobs=3, max_prompt_logprobs=3,
                         max_body_bytes=2048)
    with Server(lm, limits) as srv:
        r = srv.post(body)
        assert r.status_code == 400 and limit in r.json()["error"]["message"], r.text
        assert srv.post({"prompt": "a", "max_tokens": 0}).status_code == 200


@pytest.mark.models
def test_api_key_401_without_200_with_and_never_logged(lm, caplog, capfd):
    with caplog.at_level(logging.DEBUG):
        with Server(lm, ServeLimits(), api_key=KEY) as srv:
            assert srv.post({"prompt": "a", "max_tokens": 0}).status_code == 401
            wrong = srv.post({"prompt": "a", "max_tokens": 0}, key="sk-wrong")
            assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
            assert httpx.get(f"{srv.url}/v1/models").status_code == 401
            ok = srv.post({"prompt": "a", "max_tokens": 0, "logprobs": 0}, key=KEY)
            assert ok.status_code == 200
            assert httpx.get(f"{srv.url}/v1/models",
                             headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
            assert httpx.get(f"{srv.url}/health").status_code == 200  # open for probes
    out, err = capfd.readouterr()
    assert KEY not in caplog.text + out + err


def test_non_loopback_without_a_key_is_refused():
    from replug_jax.cli import main

    assert main(["serve", "--host", "0.0.0.0"]) == 2
    from replug_jax.serve.app import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40)
                     | st.floats(allow_nan=True) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
_fields = {"prompt": st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3),
                               _json),
           "max_tokens": st.one_of(st.integers(-3, 3), _json),
           "echo": st.one_of(st.booleans(), _json),
           "logprobs": st.one_of(st.none(), st.integers(-2, 3), _json),
           "prompt_logprobs": st.one_of(st.none(), st.integers(-2, 3)),
           "temperature": st.one_of(st.floats(-1, 2) | st.just(float("nan")), _json),
           "top_p": st.one_of(st.floats(-1, 2) | st.just(float("nan")), _json),
           "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3),
                                                                      max_size=2)),
           "seed": st.one_of(st.none(), st.integers(-5, 2**40))}
_bodies = st.one_of(st.fixed_dictionaries({}, optional=_fields), _json)


@pytest.fixture(scope="module")
def fuzz_server(lm):
    with Server(lm, ServeLimits(max_tokens=3, max_prompts=3, max_logprobs=3,
                                max_prompt_logprobs=3, batch_window_s=0.0)) as srv:
        yield srv


@pytest.mark.models
@pytest.mark.parametrize("body", [{"temperature": float("nan")}, {"prompt": "a", "top_p": "x"},
                                  [1, 2], "text", {"prompt": None}])
def test_known_hostile_bodies_are_4xx(fuzz_server, body):
    """Found by the fuzzer: a NaN in an invalid body made the default 422 handler fail (500)."""
    r = httpx.post(f"{fuzz_server.url}/v1/completions", content=json.dumps(body).encode(),
                   headers={"content-type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500 and "error" in r.json(), r.text


@pytest.mark.models
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_bodies)
def test_fuzzed_bodies_never_give_a_500_or_kill_the_server(fuzz_server, body):
    try:
        payload = json.dumps(body, allow_nan=True).encode()
    except (TypeError, ValueError):
        return
    r = httpx.post(f"{fuzz_server.url}/v1/completions", content=payload,
                   headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    assert httpx.get(f"{fuzz_server.url}/health").json()["status"] == "ok"


@pytest.mark.models
def test_unseeded_samples_differ_and_an_explicit_seed_zero_repeats(lm):
    """`seed` absent: every sampled request gets its own stream (not seed 0 for all); an
    explicit seed 0 is a seed, and repeats."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0}
    with Server(lm, ServeLimits(max_batch=1)) as srv:
        unseeded = {srv.post(body).json()["choices"][0]["text"] for _ in range(4)}
        seeded = {srv.post({**body, "seed": 0}).json()["choices"][0]["text"] for _ in range(2)}
    assert len(unseeded) > 1
    assert len(seeded) == 1


@pytest.mark.models
def test_an_empty_prompt_without_a_bos_token_is_refused_everywhere(lm):
    """SmolLM2 has no BOS token: an empty prompt would be conditioned on the padding token
    (`<|im_end|>`), which nobody sent."""
    assert not lm.bos
    with pytest.raises(ValueError, match="empty prompt"):
        lm.next_token_logprobs([""])
    with pytest.raises(ValueError, match="empty prompt"):
        lm.generate_ensemble([[""]], np.zeros((1, 1), np.float32), max_new_tokens=2)
    with Server(lm, ServeLimits()) as srv:
        r = srv.post({"prompt": "", "max_tokens": 4})
        assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
        r = srv.post({"prompt": ["fine", ""], "max_tokens": 0, "echo": True, "logprobs": 1})
        assert r.status_code == 400


@pytest.mark.models
def test_prompt_logprobs_n_returns_the_token_and_its_top_n_and_n_above_1_is_refused(lm):
    """vLLM's shape: per prompt token, the token itself first, then its top-N alternatives
    with their ranks; fields that would change the answer and are not implemented (n, best_of,
    penalties, logit_bias, suffix) are refused instead of ignored."""
    with Server(lm, ServeLimits()) as srv:
        body = {"prompt": "The capital of Germany is Berlin", "max_tokens": 0}
        plp = srv.post({**body, "prompt_logprobs": 3}).json()["choices"][0]["prompt_logprobs"]
        echo = srv.post({**body, "echo": True, "logprobs": 0}).json()["choices"][0]["logprobs"]
        for n, field in [(2, "n"), (3, "best_of"), (0.5, "presence_penalty"),
                         (0.5, "frequency_penalty"), ({"5": 10}, "logit_bias"),
                         ("!", "suffix")]:
            r = srv.post({**body, field: n})
            assert r.status_code == 400, (field, r.text)
    assert plp[0] is None and len(plp) == len(echo["tokens"])
    for entry, lp, tok in zip(plp[1:], echo["token_logprobs"][1:], echo["tokens"][1:]):
        own = next(iter(entry.values()))  # the prompt's token, first
        assert own["logprob"] == pytest.approx(lp, abs=1e-4) and own["decoded_token"] == tok
        ranked = sorted((v for v in entry.values() if v["rank"] is not None),
                        key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked][:3] == [1, 2, 3] and 3 <= len(entry) <= 4
        assert ranked[0]["logprob"] >= ranked[1]["logprob"] >= ranked[2]["logprob"]
        assert ranked[0]["logprob"] >= own["logprob"] - 1e-5


# -- top log-probs keyed by token, bytes, max_tokens 0 ----------------------------------------

@pytest.fixture(scope="module")
def tiny_server():
    import httpx

    from tests._models import tiny_lm
    from replug_jax.serve.app import ServeLimits

    lm = tiny_lm(3)
    with Server(lm, ServeLimits(batch_window_s=0.01)) as server:
        yield lm, server, httpx


def test_served_top_logprobs_merge_tokens_of_equal_text(tiny_server):
    """Top-20 after a Japanese prompt: every one of the 20 alternatives counts (equal texts
    add their probabilities; before, the last overwrote the others), and only the end of text
    is the empty string."""
    lm, server, _ = tiny_server
    prompt = "日本語の文章を書きます。東京"
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 20}
    block = server.post(body).json()["choices"][0]["logprobs"]
    seq = lm.bos + lm.encode(prompt)
    lp, ids = lm.position_top_logprobs(seq, 20)
    for pos, top in enumerate(block["top_logprobs"][1:], start=len(lm.bos)):
        want = np.logaddexp.reduce(lp[pos])
        got = np.logaddexp.reduce(list(top.values()))
        np.testing.assert_allclose(got, want, atol=1e-4)
        texts = [lm.tokenizer.decode([int(x)]) for x in ids[pos]]
        assert len(top) == len(set("" if x == lm.eos_id else t for x, t in zip(ids[pos], texts)))
        assert ("" in top) == (lm.eos_id in ids[pos])


def test_merged_top_adds_probabilities_of_equal_texts():
    from tests._models import tiny_lm
    from replug_jax.serve.logprobs import merged_top

    lm = tiny_lm(0)
    byte_tokens = [115, 179]  # two byte tokens of multi-byte characters: both decode to U+FFFD
    assert {lm.tokenizer.decode([t]) for t in byte_tokens} == {"\ufffd"}
    top = merged_top(lm, byte_tokens + [lm.eos_id, 1], [-1.0, -2.0, -3.0, -4.0])
    assert top["\ufffd"] == pytest.approx(np.logaddexp(-1.0, -2.0))
    assert top[""] == -3.0 and top["<|im_start|>"] == -4.0


def test_chat_content_bytes_are_the_tokens_own_and_max_tokens_zero_is_zero(tiny_server):
    lm, server, httpx = tiny_server
    body = {"messages": [{"role": "user", "content": "日本語 🙂"}], "max_tokens": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 0 and r["choices"][0]["message"]["content"] == ""
    body = {"messages": [{"role": "user", "content": "日本語 🙂"}], "max_tokens": 12,
            "logprobs": True, "top_logprobs": 5, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    content = r["choices"][0]["logprobs"]["content"]
    joined = b"".join(bytes(e["bytes"]) for e in content)
    assert joined.decode("utf-8", errors="replace") == r["choices"][0]["message"]["content"]
    for e in content:
        assert all(len(a["bytes"]) or a["token"] == "" for a in e["top_logprobs"])
        assert len(e["top_logprobs"]) == 5  # keyed by token: none lost to equal texts



def test_a_limit_out_of_range_is_refused_naming_its_flag():
    """`replug serve`'s limits are checked where they are declared (no server needed)."""
    assert ServeLimits(batch_window_s=0.0).batch_window_s == 0.0
    with pytest.raises(ValueError, match="--max-tokens must be positive, got 0"):
        ServeLimits(max_tokens=0)
    with pytest.raises(ValueError, match="--batch-window-s must be >= 0, got -1"):
        ServeLimits(batch_window_s=-1)
