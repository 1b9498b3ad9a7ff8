"""Logprobs as OpenAI's endpoints report them: the token names (text, "bytes:\\x..", "token_id:N") and the
/v1/completions, /v1/chat/completions and vLLM prompt_logprobs objects built from the engine's (logprob, top) entries.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..tokenizer import REPLACEMENT_CHAR, Tokenizer


class TokenText:
    """Token id -> its text, its exact bytes and the name logprobs give it, memoized: logprobs name every token
    they list.

    A byte-level BPE token that is part of a UTF-8 character decodes to U+FFFD, and so do all such tokens: named by
    their text, different tokens would share one key of `top_logprobs`. Such a token is named by its bytes instead,
    in OpenAI's spelling ("bytes:\\xe6\\x88"), and with `as_ids` every token is named "token_id:N" (vLLM's
    return_tokens_as_token_ids).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._byte_level = byte_level(tokenizer)
        self._added = {int(i): t.content for i, t in tokenizer.backend.get_added_tokens_decoder().items()}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def bytes(self, token: int) -> bytes:
        """The token's bytes: what it adds to the UTF-8 text (added tokens: their content)."""
        raw = self._bytes.get(token)
        if raw is None:
            raw = self._bytes[token] = self._raw(token)
        return raw

    def _raw(self, token: int) -> bytes:
        piece = self.tokenizer.backend.id_to_token(token)
        if token in self._added or piece is None:
            return self(token).encode("utf-8")
        if self._byte_level:
            try:
                return bytes(BYTE_OF_CHAR[c] for c in piece)
            except KeyError:  # not a byte-level piece after all
                return self(token).encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return self(token).encode("utf-8")

    def name(self, token: int, as_ids: bool = False) -> str:
        """The token's name in logprobs: its text, "bytes:\\x.." when its bytes are not whole UTF-8 characters,
        "token_id:N" with `as_ids`."""
        if as_ids:
            return f"token_id:{token}"
        text = self(token)
        if REPLACEMENT_CHAR in text:
            raw = self.bytes(token)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text


def byte_level(tokenizer: Tokenizer) -> bool:
    """True when the tokenizer's pieces spell bytes through GPT-2's byte-to-character table (its decoder is
    ByteLevel, as in Qwen's)."""
    try:
        decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return False
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)


def byte_table() -> dict[str, int]:
    """GPT-2's byte-level table, inverted: the character a byte-level BPE piece uses for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_OF_CHAR = byte_table()
Entry = tuple[float, dict[int, float]]


def top_names(text_of: TokenText, token: int, top: dict[int, float], as_ids: bool) -> tuple[str, dict[int, str]]:
    """The chosen token's name and a distinct name for every top token: the chosen one keeps its name, and a top
    token whose name is taken by another id is called "token_id:N" (so no entry of a top_logprobs dict is lost)."""
    chosen = text_of.name(token, as_ids)
    names, owner = {}, {chosen: token}
    for t in top:
        name = text_of.name(t, as_ids)
        if owner.setdefault(name, t) != t:
            name = f"token_id:{t}"
        names[t] = name
    return chosen, names


def completion_logprobs(text_of: TokenText, tokens: Sequence[int], entries: Sequence[Entry | None],
                        offset: int = 0, as_ids: bool = False) -> dict[str, Any]:
    """/v1/completions' logprobs object; an entry of None (the echoed prompt's first token) has no logprob.
    Each top_logprobs dict holds the top-k and the chosen token (as vLLM does), keyed by distinct names."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        out["text_offset"].append(offset)
        offset += len(text_of(token))
        if entry is None:
            out["tokens"].append(text_of.name(token, as_ids))
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        logprob, top = entry
        chosen, names = top_names(text_of, token, top, as_ids)
        out["tokens"].append(chosen)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append({**{names[t]: lp for t, lp in top.items()}, chosen: logprob})
    return out


def chat_logprobs(text_of: TokenText, tokens: Sequence[int], entries: Sequence[Entry],
                  as_ids: bool = False) -> dict[str, Any]:
    """/v1/chat/completions' logprobs object: {"content": [{token, logprob, bytes, top_logprobs}, ...]}; `bytes`
    are the token's own bytes (a piece of a character has no text of its own)."""

    def item(token: int, logprob: float, name: str) -> dict[str, Any]:
        return {"token": name, "logprob": logprob, "bytes": list(text_of.bytes(token))}

    content = []
    for token, (logprob, top) in zip(tokens, entries):
        chosen, names = top_names(text_of, token, top, as_ids)
        content.append({**item(token, logprob, chosen),
                        "top_logprobs": [item(t, lp, names[t]) for t, lp in top.items()]})
    return {"content": content}


def trimmed(entries: Sequence[Entry | None], n: int) -> list[Entry | None]:
    """Prompt logprob entries with their n best top logprobs (the engine records the most any field asked for)."""
    return [None if e is None else (e[0], dict(list(e[1].items())[:n])) for e in entries]


def prompt_logprobs(text_of: TokenText, tokens: Sequence[int], entries: Sequence[Entry | None],
                    k: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) {token id: {logprob, rank, decoded_token}}
    holding the token itself and the k most likely. `rank` is 1-based among the vocabulary; a prompt token
    outside the recorded top has rank null (the engine does not rank the whole vocabulary)."""
    out: list[dict[str, Any] | None] = []
    for token, entry in zip(tokens, entries):
        if entry is None:
            out.append(None)
            continue
        logprob, top = entry
        ranked = list(top)
        item = {str(t): {"logprob": lp, "rank": r, "decoded_token": text_of(t)}
                for r, (t, lp) in enumerate(list(top.items())[:k], 1)}
        item.setdefault(str(token), {"logprob": logprob, "rank": ranked.index(token) + 1 if token in top else None,
                                     "decoded_token": text_of(token)})
        out.append(item)
    return out
