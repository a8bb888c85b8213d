"""``replug serve`` (a Flax LM behind an OpenAI-compatible API) and ``replug api check``
(what a served LM can do)."""

from __future__ import annotations

import dataclasses
import os

from replug_jax.cli.common import (
    add_api_args,
    add_flax_lm_args,
    command,
    emit,
    load_flax_lm,
    port_number,
    positive_int,
)
from replug_jax.models import DEFAULT_LM


def serve_settings(args):
    """Limits and the API key of ``replug serve``, checked before the model loads."""
    from replug_jax.serve.app import API_KEY_ENV, ServeLimits, check_exposure

    limits = ServeLimits(**{f.name: getattr(args, f.name)
                            for f in dataclasses.fields(ServeLimits)})
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    check_exposure(args.host, api_key, args.insecure)
    return limits, api_key


def cmd_serve(args) -> int:
    import jax

    from replug_jax.serve.app import serve

    limits, api_key = serve_settings(args)
    lm = load_flax_lm(args)
    if jax.process_count() > 1:
        raise ValueError("replug serve runs in one process (its --mesh spans that host's "
                         "devices); serve a multi-host LM with vLLM and point --api-base at it")
    serve(lm, args.host, args.port, args.model_name, limits=limits, api_key=api_key,
          insecure=args.insecure)
    return 0


def cmd_api_check(args) -> int:
    from replug_jax.lm.api_scorer import APIScorer

    api = APIScorer(args.api_base, model=args.api_model, timeout=args.api_timeout,
                    endpoint=args.api_endpoint, scoring="auto", max_retries=args.api_retries,
                    concurrency=args.api_concurrency, batch_size=args.api_batch_size)
    caps = api.probe(top_n=args.top_n)
    rows = caps.table()
    width = max(len(r[0]) for r in rows)
    text = [f"server: {caps.base_url}"]
    text += [f"  {what:<{width}}  {answer:<20} {detail}" for what, answer, detail in rows]
    if not caps.scoring:
        text.append(f"note: {caps.refusal('scoring')}")
    emit(args, caps.to_json(), "\n".join(text))
    return 0


def check(args) -> None:
    """What one argument's type cannot check."""
    from replug_jax.imports import require

    require("fastapi", "serve", "replug serve")
    require("uvicorn", "serve", "replug serve")
    serve_settings(args)


def add_parsers(sub) -> None:
    from replug_jax.serve.app import API_KEY_ENV, ServeLimits

    srv = command(sub, "serve", cmd_serve, json=False, check=check,
                  help="serve a Flax LM over an OpenAI-compatible API",
                  description="Serve --lm at /v1/completions (echo, logprobs, prompt_logprobs), "
                              "/v1/chat/completions, /v1/models and /health. Logs go to the "
                              "terminal.")
    srv.add_argument("--lm", default=DEFAULT_LM, help=f"LM source (default: {DEFAULT_LM})")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=port_number, default=8000, help="port (default 8000)")
    srv.add_argument("--model-name", default=None, help="model id reported by the API")
    add_flax_lm_args(srv)
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1 routes (default: "
                     f"${API_KEY_ENV}; never logged)")
    srv.add_argument("--insecure", action="store_true",
                     help="allow a non-loopback --host without an API key")
    for f in dataclasses.fields(ServeLimits):
        srv.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default),
                         default=f.default, help=f"{f.metadata['help']} (default {f.default})")

    api = sub.add_parser("api", help="check what an OpenAI-compatible LM server can do")
    asub = api.add_subparsers(dest="api_command", required=True)
    chk = command(asub, "check", cmd_api_check,
                  help="probe a server: echo / prompt_logprobs scoring, "
                       "top-n log-probs (largest n), conformance of its scores",
                  description="Probe an OpenAI-compatible server the way score, ask, "
                              "generate and train-lsr do before any work, and print what it can "
                              "do: scoring supplied text (echo or vLLM's prompt_logprobs, checked "
                              "on a counting sequence), top-n log-probs of generated tokens (the "
                              "largest n it honours; REPLUG's ensemble is then approximate), and "
                              "whether it reports a prompt cache.")
    chk.add_argument("--api-base", required=True, help="server URL, e.g. http://127.0.0.1:8081")
    add_api_args(chk, timeout=30.0, retries=2)
    chk.add_argument("--top-n", type=positive_int, default=20,
                     help="the largest n of top log-probs to try (OpenAI allows 20)")
