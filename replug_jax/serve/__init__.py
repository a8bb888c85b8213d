"""``replug serve``: an in-process Flax LM behind an OpenAI-compatible HTTP API (``app``), the
requests it accepts and its limits (``limits``), and the log-prob blocks it answers with
(``logprobs``). Needs the ``serve`` extra (FastAPI, uvicorn, pydantic)."""
