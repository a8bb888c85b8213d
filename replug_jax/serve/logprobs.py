"""Log-prob blocks of ``replug serve``'s answers: per-token log-probs and top alternatives of
prompt and generated tokens, in the legacy completions shape (``tokens``, ``token_logprobs``,
``text_offset``, ``top_logprobs`` as ``{text: log-prob}``) and the per-token ``content[]`` one.

Texts are not tokens: several tokens can decode to the same text (the byte tokens of a
multi-byte character all decode to U+FFFD), so the legacy shape merges alternatives of equal
text by adding their probabilities, and the ``content[]`` shape keys every alternative by its
own token with its own bytes. The end-of-text token is ``""`` in the legacy shape, which is what
clients read as the end; other special tokens keep their text.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from replug_jax.lm.flax_scorer import FlaxLM


def content_logprobs(lm: "FlaxLM", block: dict) -> dict:
    """A log-prob block of :func:`_logprob_blocks` in the per-token ``content[]`` shape of
    chat completions: each token and each top alternative keyed by its own token (texts of
    different tokens may be equal) with the token's own bytes (a token holding part of a
    multi-byte character has bytes that are not UTF-8 on their own)."""
    def entry(token_id: int, logprob: float) -> dict:
        raw = token_bytes(lm, token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(raw)}

    tops = block["_top_ids"] or [None] * len(block["_ids"])
    return {"content": [
        {**entry(t, lp), "top_logprobs": [entry(x, v) for x, v in (top or [])]}
        for t, lp, top in zip(block["_ids"], block["token_logprobs"], tops)]}


def public(block: dict) -> dict:
    """A log-prob block without the fields only the server reads (token ids)."""
    return {k: v for k, v in block.items() if not k.startswith("_")}


def token_bytes(lm: "FlaxLM", token_id: int, in_text: bool = False) -> bytes:
    """The bytes a token stands for: byte-level BPE symbols mapped back to bytes,
    SentencePiece ``<0xNN>`` byte tokens and ``▁`` spaces, special tokens as their text;
    a generated end-of-text token is empty, while one ``in_text`` (an echoed prompt: a chat
    template's ``<|im_end|>`` is SmolLM2-Instruct's end-of-text token) is its text."""
    if token_id == lm.eos_id and not in_text:
        return b""
    piece = lm.tokenizer.convert_ids_to_tokens(int(token_id))
    byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
    if byte:
        return bytes([int(byte.group(1), 16)])
    table = _byte_decoder()
    if int(token_id) not in set(lm.tokenizer.all_special_ids) and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return piece.replace("\u2581", " ").encode("utf-8")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
            + list(range(ord("\xae"), ord("\xff") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def top_text(lm: "FlaxLM", token_id: int) -> str:
    """A top alternative's text in the legacy ``{text: log-prob}`` shape: the end-of-text
    token is ``""`` (what clients read as the end), special tokens keep their text."""
    return "" if token_id == lm.eos_id else lm.tokenizer.decode([int(token_id)])


def merged_top(lm: "FlaxLM", ids, logprobs) -> dict[str, float]:
    """``{text: log-prob}`` of the top alternatives; tokens with the same text (byte tokens
    of a multi-byte character, which all decode to U+FFFD) add their probabilities instead of
    overwriting each other."""
    out: dict[str, float] = {}
    for x, v in zip(ids, logprobs):
        text = top_text(lm, int(x))
        out[text] = float(np.logaddexp(out[text], v)) if text in out else float(v)
    return out


def tokens_with_offsets(lm: "FlaxLM", text: str) -> tuple[list[int], list[str], list[int]]:
    enc = lm.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = [s for s, _ in enc["offset_mapping"]]
    ends = [e for _, e in enc["offset_mapping"]]
    # Token strings are the exact slices of the text, so offsets and strings agree.
    strings = [text[s:(offsets[i + 1] if i + 1 < len(ids) else ends[i])]
               for i, s in enumerate(offsets)]
    return ids, strings, offsets


_Item = tuple[list[int], list[str], list[int], int, "int | None"]


def logprob_blocks(lm: "FlaxLM", items: list[_Item]) -> list[dict]:
    """OpenAI-style logprobs for many ``(ids, strings, offsets, start, n_top)`` at once: token
    ``ids[start:]`` given everything before it, scored in one batched call."""
    seqs = [lm.bos + ids for ids, *_ in items]
    cuts = [max(len(lm.bos) + start, 1) for _, _, _, start, _ in items]
    need = [i for i, (seq, cut) in enumerate(zip(seqs, cuts)) if len(seq) > cut]
    full = dict(zip(need, lm.score_token_ids([seqs[i][:cuts[i]] for i in need],
                                             [seqs[i][cuts[i]:] for i in need])))
    with_top = [i for i, item in enumerate(items) if item[4]]
    n_max = max([items[i][4] for i in with_top], default=0)
    tops = dict(zip(with_top, lm.positions_top_logprobs([seqs[i] for i in with_top], n_max)))
    blocks = []
    for i, (ids, strings, offsets, start, n_top) in enumerate(items):
        shift = len(lm.bos)
        token_lp: list[float | None] = []
        top: list[dict[str, float] | None] = []
        top_ids: list[list[tuple[int, float]] | None] = []
        scored = full.get(i, np.zeros(0, np.float32))
        offset = 0
        for t in range(start, len(ids)):
            pos = shift + t
            if pos == 0:  # first token without a BOS: nothing predicts it
                token_lp.append(None)
                top.append(None)
                top_ids.append(None)
                continue
            token_lp.append(float(scored[offset]))
            offset += 1
            if n_top:
                lp_top, id_top = tops[i]
                pairs = [(int(x), float(v)) for x, v in zip(id_top[pos - 1][:n_top],
                                                             lp_top[pos - 1][:n_top])]
                top.append(merged_top(lm, [x for x, _ in pairs], [v for _, v in pairs]))
                top_ids.append(pairs)
            else:
                top.append(None)
                top_ids.append(None)
        blocks.append({"tokens": strings[start:], "token_logprobs": token_lp,
                       "text_offset": offsets[start:], "top_logprobs": top if n_top else None,
                       # an extension of the legacy shape: each token's own bytes, which say
                       # where a token holding part of a multi-byte character belongs
                       "token_bytes": [list(token_bytes(lm, int(x), in_text=True))
                                       for x in ids[start:]],
                       "_ids": [int(x) for x in ids[start:]],
                       "_top_ids": top_ids if n_top else None})
    return blocks
