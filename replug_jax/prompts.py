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
    return demonstrations_text(demonstrations) + PLAIN_QA.format(question=question)


def chat_turn(question: str, tokenizer) -> tuple[str, str]:
    """``(head, rest)`` of the LM's chat template around a user turn holding ``question``:
    the document of a REPLUG branch goes between them, inside the user's turn (the paper's
    ``d ∘ x`` with x the user's text), ``head + d + separator + rest`` — not in front of the
    template, where a chat model ignores it. Raises ``ValueError`` without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this LM has no chat template")
    mark = "\u2063REPLUG-USER-TEXT\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}],
                                         add_generation_prompt=True, tokenize=False)
    if text.count(mark) != 1:
        raise ValueError("the chat template does not place the user's text once")
    head, tail = text.split(mark)
    return head, question + tail


CHAT_LAYOUTS = ("inside", "before")


def qa_branch_input(question: str, tokenizer, chat_layout: str = "inside"
                    ) -> tuple[str, str | None]:
    """``(context, prefix)`` of a question for :meth:`Replug.generate` (``prefixes``): with a
    chat template and ``chat_layout="inside"`` each branch is ``head + d + separator +
    question + tail`` (:func:`chat_turn`); else (no template, or ``"before"``) the prompt of
    :func:`qa_prompt` with nothing before the document (prefix None)."""
    if chat_layout not in CHAT_LAYOUTS:
        raise ValueError(f"chat_layout must be one of {CHAT_LAYOUTS}, got {chat_layout!r}")
    if getattr(tokenizer, "chat_template", None) and chat_layout == "inside":
        head, context = chat_turn(question, tokenizer)
        return context, head
    return qa_prompt(question, tokenizer), None


def answer_continuation(answer: str, layout: str) -> str:
    """The gold answer as the LM writes it after the prompt of ``layout`` (a QA_LAYOUTS
    name): after the plain ``Answer:`` the model writes ``" " + answer``; after a chat
    template's assistant header it writes ``answer`` at once (the template renders no space,
    and the model's own answers start without one), so scoring ``" " + answer`` there scores a
    token sequence it never emits."""
    answer = str(answer).strip()
    return answer if layout.startswith("chat_") else " " + answer


def demonstrations_text(demonstrations: Sequence[tuple[str, str]]) -> str:
    """The few-shot block that :func:`qa_prompt` puts before the question."""
    return "".join(PLAIN_QA.format(question=q) + f" {a}\n\n" for q, a in demonstrations)


# Where a QA branch puts the few-shot demonstrations (``QAEvaluator(layout=)``):
# "document_first" is the paper's d ∘ demonstrations ∘ question (§3.2: the document is
# prepended to the whole input); "demonstrations_first" is demonstrations ∘ d ∘ question, whose
# demonstrations are a prefix shared by every branch and question (their keys and values are
# computed once; see lm.kv_reuse), at the price of a different prompt.
# "chat_inside" / "chat_before" (zero-shot, an LM with a chat template): the document inside
# the user's turn before the question (chat_turn), or in front of the whole chat prompt.
QA_LAYOUTS = ("document_first", "demonstrations_first", "chat_inside", "chat_before")


def document_budget(lm, context: str, separator: str, reserve: int = 0) -> int:
    """Tokens left for a document in ``doc ∘ separator ∘ context`` when ``reserve`` tokens of
    output must also fit the LM context (two tokens of margin: a BOS token and the joint)."""
    if lm.max_context is None:
        return 1 << 30
    used = lm.count_tokens(context) + lm.count_tokens(separator) + reserve + 2
    if used > lm.max_context:
        raise ValueError(f"the input alone ({used} tokens with the reserve for the output) "
                         f"exceeds the LM context of {lm.max_context}")
    return lm.max_context - used


def document_prompt(lm, doc: str, context: str, *, separator: str = "\n\n", reserve: int = 0,
                    budget: int | None = None, prefix: str = "") -> tuple[str, int]:
    """One REPLUG branch input ``d ∘ x`` (paper §3.2): ``prefix + doc + separator + context``
    (``prefix`` is empty but in the demonstrations-first QA layout), with the document cut
    from its end so that the prompt and ``reserve`` continuation tokens fit
    ``lm.max_context``. Returns ``(prompt, cuts)``: how many times the document was shortened.

    Inference (:class:`~replug_jax.replug.Replug`) and LSR supervision
    (:func:`~replug_jax.train.supervision.lm_scores`) both build branches here, so the LM scores
    that train the retriever are the ones REPLUG then mixes. Token counts of separately
    tokenised pieces can differ from the joint tokenisation at the boundaries, so the joint
    count is checked and the document shortened until it fits (one token of margin for BOS).
    """
    if budget is None:
        budget = document_budget(lm, prefix + context, separator, reserve)
    if budget <= 0:  # no room at all: the branch is the context alone after the separator
        return prefix + separator + context, 0
    text = lm.truncate(doc, budget) if lm.max_context is not None else doc
    cuts = int(text != doc)
    if lm.max_context is None:
        return prefix + text + separator + context, cuts
    while True:
        prompt = prefix + text + separator + context
        over = lm.count_tokens(prompt) + reserve + 1 - lm.max_context
        if over <= 0 or not text:
            return prompt, cuts
        # Strictly decreasing, so this ends even when a cut cannot land inside a character
        # that the tokenizer splits into several byte tokens.
        budget = max(min(lm.count_tokens(text) - over, budget - 1), 0)
        text = lm.truncate(text, budget)
        cuts += 1
