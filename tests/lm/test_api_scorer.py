"""The HTTP backend against `replug serve` on 127.0.0.1, and its failure handling."""

import json
import re
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from replug_jax.lm.api_scorer import CONFORMANCE_TEXT, APIError, APIScorer
from replug_jax.replug import Replug
from tests.helpers import free_port


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
    from replug_jax.retrieval import Index

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


# -- recorded responses of real servers (tests/fixtures/api, captured by hand) ------------------

FIXTURES = __import__("pathlib").Path(__file__).parents[1] / "fixtures" / "api"


def _recorded(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _replay(name: str):
    """A transport answering like the recorded server: by the kind of request."""
    rec = _recorded(name)

    def handler(request):
        body = json.loads(request.content)
        if request.url.path.endswith("/chat/completions"):
            kind = "chat_top_n"
        elif body.get("echo"):
            kind = "echo"
        elif "prompt_logprobs" in body:
            kind = "prompt_logprobs"
        else:
            kind = "top_n"
        return httpx.Response(rec[kind]["status"], json=rec[kind]["response"])

    return httpx.MockTransport(handler)


def test_both_logprob_shapes_parse_the_same_top_tokens():
    """llama.cpp's /v1/completions answers in the per-token content[] shape, replug serve in
    the legacy one; both give " Berlin" first with nearly the same log-prob (Q4_1 weights in
    llama.cpp, float32 dequantised in ours), and both chat answers parse as content[]."""
    from replug_jax.lm.api_scorer import parse_logprobs

    tops = {}
    for name in ("llama_cpp_server", "replug_serve"):
        rec = _recorded(name)
        block = parse_logprobs(rec["top_n"]["response"]["choices"][0]["logprobs"])
        assert block.tokens == [" Berlin"] and len(block.top[0]) == 5
        tops[name] = block.top[0]
        chat = parse_logprobs(rec["chat_top_n"]["response"]["choices"][0]["logprobs"])
        assert "".join(chat.tokens) == "The capital" and len(chat.top[0]) == 3
        assert max(chat.top[0], key=chat.top[0].get) == chat.tokens[0]
    assert abs(tops["llama_cpp_server"][" Berlin"] - tops["replug_serve"][" Berlin"]) < 0.1
    assert max(tops["llama_cpp_server"], key=tops["llama_cpp_server"].get) == " Berlin"


def test_probe_of_recorded_servers_picks_the_path_or_refuses_in_one_line():
    from replug_jax.lm.api_scorer import APICapabilityError

    llama = APIScorer.connect("http://llama", transport=_replay("llama_cpp_server"))
    caps = llama.server
    assert (caps.echo, caps.prompt_logprobs, caps.top_n, caps.scoring) == (False, False, 5, None)
    assert caps.logprob_shape == "content" and caps.cached_prompt_tokens
    with pytest.raises(APICapabilityError, match="gives no prompt log-probs.*approximate "
                       "ensemble from top-5") as err:
        llama.score_continuations(["a"], ["b"])
    assert "\n" not in str(err.value)
    with pytest.raises(Exception, match="gives no prompt log-probs"):
        Replug(llama, mode="none").score(["a"], ["b"])
    ours = APIScorer.connect("http://ours", transport=_replay("replug_serve"))
    assert ours.server.scoring == "echo" and ours.server.conformance["passed"]
    assert ours.server.logprob_shape == "legacy"
    [top] = llama.top_logprobs(["The capital of Germany is"], 20)
    assert max(top, key=top.get) == " Berlin"  # n capped at what the server honoured


@pytest.mark.parametrize("block, message", [
    ({"content": "x"}, "content is"),
    ({"content": [{"token": "a", "logprob": "NaN"}]}, "content\\[0\\].logprob"),
    ({"content": [{"token": "a", "logprob": float("inf")}]}, "not a finite"),
    ({"content": [{"token": "a", "logprob": 0.5}]}, "not a finite"),
    ({"content": [{"logprob": -1.0}]}, "has no text"),
    ({"content": [{"token": "a", "logprob": -1.0, "top_logprobs": "x"}]}, "top log-probs"),
    ({"content": [{"token": "a", "logprob": -1.0,
                   "top_logprobs": [{"token": "a", "logprob": None}]}]}, "top_logprobs"),
    ({"tokens": ["a", "b"], "token_logprobs": [None]}, "2 tokens, 1 log-probs"),
    ({"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [[1, 2]]}, "top log-probs"),
    ({"text": "no log-probs here"}, "neither logprobs.content"),
    (None, "no log-probs"),
])
def test_malformed_logprobs_are_one_clear_error(block, message):
    from replug_jax.lm.api_scorer import APIResponseError, parse_logprobs

    with pytest.raises(APIResponseError, match=message) as err:
        parse_logprobs(block)
    assert "\n" not in str(err.value)


def test_same_text_alternatives_add_and_multibyte_tokens_read_from_bytes():
    from replug_jax.lm.api_scorer import parse_logprobs

    block = parse_logprobs({"content": [{"token": "\ufffd", "bytes": [0xE6, 0x9D, 0xB1],
                                         "logprob": -0.5, "top_logprobs": [
        {"token": "x", "logprob": np.log(0.2)}, {"token": "x", "logprob": np.log(0.3)}]}]})
    assert block.tokens == ["東"] and block.top[0]["x"] == pytest.approx(np.log(0.5))


# -- every failure is one line and exit 2 in the CLI -------------------------------------------

class _Misbehaving:
    """A real HTTP server whose first path segment picks a failure."""

    def __init__(self):
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                mode = self.path.strip("/").split("/")[0]
                self.rfile.read(int(self.headers.get("content-length", 0)))
                if mode == "slow":
                    time.sleep(2)
                status, body = {
                    "s401": (401, b'{"error": {"message": "invalid key sk-secret-123"}}'),
                    "s403": (403, b'{"error": {"message": "forbidden"}}'),
                    "s404": (404, b'{"error": {"message": "model not found"}}'),
                    "s429": (429, b'{"error": {"message": "slow down"}}'),
                    "s500": (500, b"Internal Server Error\n<html>\n</html>"),
                    "badjson": (200, b"{not json"),
                    "nologprobs": (200, b'{"choices": [{"text": "x", "logprobs": null}]}'),
                }.get(mode, (200, b"{}"))
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client gave up (timeouts)
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def misbehaving():
    srv = _Misbehaving()
    yield srv.url
    srv.server.shutdown()


@pytest.mark.parametrize("where, message", [
    ("s401", "HTTP 401: the API key is missing or wrong"),
    ("s403", "HTTP 403"),
    ("s404", "HTTP 404 \\(wrong --api-base"),
    ("s429", "failed after 2 attempts .*HTTP 429"),
    ("s500", "failed after 2 attempts .*HTTP 500"),
    ("badjson", "malformed JSON"),
    ("slow", "timed out after 0.5s"),
    ("refused", "connection refused"),
    ("dns", "unknown host"),
])
def test_every_api_failure_is_one_line_and_exit_2(misbehaving, where, message, capsys,
                                                  monkeypatch, tmp_path):
    from replug_jax import cli

    monkeypatch.setenv("REPLUG_API_KEY", "sk-secret-123")
    url = {"refused": f"http://127.0.0.1:{free_port()}",
           "dns": "http://no-such-host.invalid"}.get(where, f"{misbehaving}/{where}")
    lines = tmp_path / "lines.jsonl"
    lines.write_text(json.dumps({"context": "a", "continuation": " b"}) + "\n")
    for argv in (["api", "check", "--api-base", url, "--api-retries", "1", "--api-timeout",
                  "0.5"],
                 ["score", "--input", str(lines), "--mode", "none", "--api-base", url,
                  "--api-retries", "1", "--api-timeout", "0.5"]):
        rc = cli.main(argv)
        err = capsys.readouterr().err.strip()
        assert rc == 2, (argv, err)
        assert err.startswith("replug: error:") and "\n" not in err, err
        assert "sk-secret" not in err and "Traceback" not in err
        assert re.search(message, err), err


def test_a_server_without_log_probs_is_refused_in_one_line(misbehaving, capsys, tmp_path):
    from replug_jax import cli

    lines = tmp_path / "lines.jsonl"
    lines.write_text(json.dumps({"context": "a", "continuation": " b"}) + "\n")
    assert cli.main(["api", "check", "--api-base", f"{misbehaving}/nologprobs"]) == 0
    assert "top-n of generated tokens  no" in capsys.readouterr().out
    rc = cli.main(["score", "--input", str(lines), "--mode", "none", "--api-base",
                   f"{misbehaving}/nologprobs"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "gives no prompt log-probs" in err and \
        "REPLUG cannot run" in err


@pytest.mark.models
def test_openai_package_is_a_client_of_replug_serve(served):
    """The `openai` package against our server: legacy-shape echo scoring on /v1/completions
    and content[]-shape top log-probs on /v1/chat/completions, equal to the in-process LM."""
    openai = pytest.importorskip("openai")
    from replug_jax.serve.app import chat_prompt

    lm, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    text = "The capital of Germany is Berlin."
    r = client.completions.create(model="smollm2", prompt=text, max_tokens=0, echo=True,
                                  logprobs=0, temperature=0)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == text and lp.token_logprobs[0] is None
    [ours] = lm.score_continuations([lp.tokens[0]], [text[len(lp.tokens[0]):]])
    np.testing.assert_allclose(lp.token_logprobs[1:], ours.logprobs, atol=1e-4)
    messages = [{"role": "user", "content": "What is the capital of Germany?"}]
    chat = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=4)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 4
    assert chat.choices[0].message.content == "".join(c.token for c in content)
    exact = lm.next_token_logprobs([chat_prompt(lm, messages)])[0]
    best = int(np.argmax(exact))
    assert content[0].token == lm.tokenizer.decode([best])
    assert content[0].logprob == pytest.approx(float(exact[best]), abs=1e-4)
    assert bytes(content[0].bytes).decode() == content[0].token


@pytest.mark.models
def test_many_prompts_per_scoring_request_where_the_server_takes_lists(served):
    """The probe finds that `replug serve` scores a list of prompts in one request (the same
    log-probs as alone); then 6 pairs go as 2 requests of up to 4 prompts, with the scores of
    one prompt per request. A server that answers a list with one choice is found out."""
    lm, url = served
    api = APIScorer.connect(url, model="smollm2", tokenizer="smollm2", max_context=512,
                            batch_size=4)
    assert api.server.prompt_lists and ("prompt lists per request", "yes") in [
        row[:2] for row in api.server.table()]
    prompts = ["The capital of Germany is", "Water boils at", "One, two,", "The sky is",
               "Paris is in", "A cat is an"]
    conts = [" Berlin.", " 100 degrees.", " three.", " blue.", " France.", " animal."]
    before = api.cost.snapshot()["lm_calls"]
    batched = api.score_continuations(prompts, conts)
    assert api.cost.snapshot()["lm_calls"] - before == 2
    single = APIScorer(url, model="smollm2", scoring="echo").score_continuations(prompts, conts)
    for a, b in zip(batched, single):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    recorded = APIScorer.connect("http://ours", transport=_replay("replug_serve"))
    assert not recorded.server.prompt_lists  # one choice for a list: probed, not assumed


@pytest.mark.models
def test_lsr_supervised_through_batched_api_requests_trains_as_in_process(served, tmp_path):
    """LSR steps whose LM scores come from `replug serve` in requests of 4 prompts reach the
    parameters of the same LM scoring in-process (the served scores equal within 1e-4)."""

    from tests.helpers import BASE, make_trainer, metrics_of, params_of

    lm, url = served
    cfg = BASE.updated({"total_steps": 3, "lm.prefetch": False})
    local = make_trainer(tmp_path, "local", cfg, lm=lm)
    local.run()
    api = APIScorer.connect(url, model="smollm2", tokenizer="smollm2", max_context=512,
                            batch_size=4)
    before = api.cost.snapshot()["lm_calls"]
    remote = make_trainer(tmp_path, "remote", cfg, lm=api)
    remote.run()
    pairs = sum(r["lm_new_pairs"] for r in metrics_of(remote))
    assert pairs > 4 and api.cost.snapshot()["lm_calls"] - before <= -(-pairs // 4) + 3
    for a, b in zip(params_of(local), params_of(remote)):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.models
def test_a_continuation_starting_inside_a_multi_byte_character_is_scored_whole(served):
    """A continuation whose first character is split over byte tokens (or shares a token
    with the prompt's last space) keeps every one of its tokens: the server states each
    token's bytes, on both scoring paths, and random mixed-script texts cut anywhere score
    as the in-process LM scores them."""
    lm, url = served
    rng = np.random.default_rng(0)
    alphabet = list("abc xyz.,") + list("東京日本の首都はです") + ["é", "ß", "🙂", "€"]
    pairs = [("日本の首都は", "東京です"), ("Tokyo in Japanese is ", "東京")]
    for _ in range(12):
        text = "".join(rng.choice(alphabet, rng.integers(4, 16)))
        cut = int(rng.integers(1, len(text)))
        pairs.append((text[:cut], text[cut:]))
    mine = lm.score_continuations([p for p, _ in pairs], [c for _, c in pairs])
    assert len(mine[0].logprobs) == 7  # 東京です: the first byte token is the continuation's
    for path in ("echo", "prompt_logprobs"):
        api = APIScorer(url, scoring=path)
        theirs = api.score_continuations([p for p, _ in pairs], [c for _, c in pairs])
        for (p, c), a, b in zip(pairs, mine, theirs):
            assert len(a.logprobs) == len(b.logprobs), (path, p, c)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-4, err_msg=f"{p!r}|{c!r}")
        api.close()


def test_without_token_bytes_a_multi_byte_boundary_is_refused_in_one_line():
    """A legacy answer without token bytes cannot say whether the token ending at the prompt
    holds the first bytes of the continuation's first character: refused, not miscounted."""
    from replug_jax.lm.api_protocol import APICapabilityError

    api = APIScorer("http://127.0.0.1:9", scoring="echo")
    choice = {"logprobs": {"tokens": ["日本", "は", "", "東", "京"],
                           "token_logprobs": [None, -1.0, -2.0, -0.5, -0.3],
                           "text_offset": [0, 2, 3, 3, 4]}}
    with pytest.raises(APICapabilityError, match="begins with a multi-byte character"):
        api._parse_score(("日本は", "東京"), choice, "echo")
    ascii_start = {"logprobs": {"tokens": ["日本", "は", " ok"],
                                "token_logprobs": [None, -1.0, -2.0],
                                "text_offset": [0, 2, 3]}}
    assert api._parse_score(("日本は", " ok"), ascii_start, "echo").logprobs.tolist() == [-2.0]


@pytest.mark.models
def test_eval_of_a_served_lm_with_its_tokenizer_equals_in_process(served, tmp_path):
    """`--api-tokenizer` reaches `eval`: a text file is cut into windows with it, and a served
    chat LM gets its chat layout; both equal the same LM in process."""
    from replug_jax.cli import main

    _, url = served
    texts = tmp_path / "t.jsonl"
    texts.write_text(json.dumps({"text": "The river Amber flows north through Lindholm, "
                                 "then east to the sea at Oskar. " * 6}) + "\n")
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "What is the capital of France?",
                              "answer": "Paris"}) + "\n")
    common = ["--modes", "none", "--no-generate", "--window-tokens", "16",
              "--context-tokens", "16", "--skip-first", "8"]
    for name, data in (("text", texts), ("qa", qa)):
        assert main(["eval", str(data), "--output", str(tmp_path / f"{name}_local"),
                     "--lm", "smollm2", "--max-context", "512", *common]) == 0
        assert main(["eval", str(data), "--output", str(tmp_path / f"{name}_api"),
                     "--api-base", url, "--api-model", "smollm2", "--api-tokenizer", "smollm2",
                     "--max-context", "512", *common]) == 0
        local, api = (json.loads((tmp_path / f"{name}_{w}" / "results.json").read_text())
                      for w in ("local", "api"))
        metric = "bits_per_byte" if name == "text" else "mean_answer_loglik"
        assert api["rows"]["none"][metric] == pytest.approx(local["rows"]["none"][metric],
                                                            rel=1e-4)
        assert api["settings"]["qa_layout"] == local["settings"]["qa_layout"]
    assert local["settings"]["qa_layout"] == "chat_inside"
