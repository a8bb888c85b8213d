"""Prompt formats for questions: plain few-shot text, or the LM's own chat template."""

from __future__ import annotations

from typing import Sequence

PLAIN_QA = "Question: {question}\nAnswer:"


def qa_prompt(question: str, tokenizer=None, *, demonstrations: Sequence[tuple[str, str]] = (),
              chat: bool | None = None) -> str:
    """A question prompt. With ``chat`` (default: when the tokenizer has a chat template) the
    question becomes a user turn of the LM's chat template; otherwise plain
    ``Question: …\\nAnswer:`` lines preceded by the few-shot ``demonstrations``.
    REPLUG prepends each retrieved document to this text (§3.2)."""
    template = getattr(tokenizer, "chat_template", None)
    use_chat = bool(template) if chat is None else chat
    if use_chat and not demonstrations:
        return tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
    shots = "".join(PLAIN_QA.format(question=q) + f" {a}\n\n" for q, a in demonstrations)
    return shots + PLAIN_QA.format(question=question)
