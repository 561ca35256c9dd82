"""A chat's token ids, tokenizing only what earlier conversations did not already hold.

Every turn sends the whole conversation, and the rails send it again with a question after the message: through
the chat template that is the same text as the conversation before, plus a tail. Tokenizing all of it each time
took ~0.13 s per 32K tokens and ~0.4 s per 128K on a GPU server's host (twice a turn for an input rail without a
probe: `docs/moderation.md`, "Latency on the GPU"). A fast tokenizer cuts its input at every added special token
(ChatML's ``<|im_start|>``, DeepSeek's ``<｜User｜>``) before anything else and tokenizes the pieces apart, so the
ids of a text up to the end of a special token do not depend on what follows, nor those up to its start where the
next text has a special token at the same place (a rail's question after the user's message, in place of the
answer's header). ``ChatEncoder`` keeps the last few texts with their ids and these cuts; a new text reuses the ids
of the longest prefix up to a cut that it shares with one of them and tokenizes the rest.

Contract: ``ChatEncoder(tokenizer).encode(text)`` equals ``tokenizer(text, add_special_tokens=False)["input_ids"]``
(what ``apply_chat_template(..., tokenize=True)`` gives). It checks that on its first use with a made-up
conversation, and where it does not hold (a slow tokenizer, an added token that strips the spaces around it, a
normalizer across pieces) it tokenizes every text whole, as before.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
from typing import Sequence

from ..errors import PromptError

log = logging.getLogger("flashguard")


class ChatEncoder:
    KEPT = 4   # texts kept (the input rail's, the generation's, the output rail's)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._kept: collections.OrderedDict = collections.OrderedDict()   # text -> (ids, cut chars, cut tokens)
        self._lock, self._check_lock = threading.Lock(), threading.Lock()
        self._cut_ids = frozenset(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                                  if t.special and not t.lstrip and not t.rstrip)
        self._marks = tuple(t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                            if i in self._cut_ids)
        self._works: bool | None = None if self._cut_ids and getattr(tokenizer, "is_fast", False) else False

    def encode(self, text: str) -> list[int]:
        if self._works is None:
            with self._check_lock:   # (once, before any thread relies on it)
                if self._works is None:
                    self._works = self._check()
        return self._incremental(text) if self._works else self._whole(text)

    def _incremental(self, text: str) -> list[int]:
        with self._lock:
            best, base = 0, None   # (cuts of the base kept up to and with the shared one, its entry)
            for old, entry in self._kept.items():   # the longest shared prefix that ends at a cut
                n = bisect.bisect_right(entry[1], _common_prefix(old, text))
                # a cut where a special token starts holds only if one starts there in this text too
                while n and entry[3][n - 1] and not text.startswith(self._marks, entry[1][n - 1]):
                    n -= 1
                if n and entry[1][n - 1] > (base[1][best - 1] if base else 0):
                    best, base = n, entry
        chars, tokens = (base[1][best - 1], base[2][best - 1]) if base else (0, 0)
        tail, tail_chars, tail_tokens, tail_starts = self._pieces(text[chars:])
        if tail_chars and tail_chars[0] == 0:   # (the cut the tail starts at is the base's own last one)
            tail_chars, tail_tokens, tail_starts = tail_chars[1:], tail_tokens[1:], tail_starts[1:]
        ids = (list(base[0][:tokens]) if base else []) + tail
        cut_chars = (base[1][:best] if base else []) + [chars + c for c in tail_chars]
        cut_tokens = (base[2][:best] if base else []) + [tokens + t for t in tail_tokens]
        starts = (base[3][:best] if base else []) + tail_starts
        with self._lock:
            self._kept[text] = (tuple(ids), cut_chars, cut_tokens, starts)
            self._kept.move_to_end(text)
            while len(self._kept) > self.KEPT:
                self._kept.popitem(last=False)
        return ids

    def _whole(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _pieces(self, text: str) -> tuple[list[int], list[int], list[int], list[bool]]:
        """Ids of ``text`` and its cuts: where each special token starts and where it ends, in characters, with the
        ids before that place, and whether the cut is a start (valid only where the next text has one there too)."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        chars, tokens, starts = [], [], []
        for i, (tid, (start, end)) in enumerate(zip(ids, offsets)):
            if tid in self._cut_ids:
                if not chars or chars[-1] < start:
                    chars.append(start)
                    tokens.append(i)
                    starts.append(True)
                chars.append(end)
                tokens.append(i + 1)
                starts.append(False)
        return ids, chars, tokens, starts

    def _check(self) -> bool:
        """On a made-up conversation grown turn by turn, and branching off at a special token's start (another
        special token there) and past one's end: each text's ids as ``encode`` makes them against whole tokenizing.
        Nothing is kept from it."""
        one, two = (self._marks * 2)[:2]
        pieces = ["Hello there, how are you?", " Fine.\n\nAnd you ", "x = [1, 2]  # a list\n", "  ünïcödé 😀 end."]
        texts, text = [], ""
        for piece in pieces:
            text += one + piece
            texts.append(text)
        texts += [texts[1] + " tail", texts[0] + one, texts[1] + two + " other", texts[2] + two + pieces[0],
                  texts[1] + two + " other" + one + pieces[3]]
        try:
            ok = all(self._incremental(t) == self._whole(t) for t in texts)
        except Exception as exc:   # noqa: BLE001 - a tokenizer without offsets: whole texts, as before
            log.info("flashguard: incremental chat encoding unavailable (%s: %s)", type(exc).__name__, exc)
            ok = False
        with self._lock:
            self._kept.clear()
        if not ok:
            log.info("flashguard: this tokenizer's pieces depend on what follows them; chats are tokenized whole")
        return ok


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (string slices compare at C speed)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:   # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class MessageEncoder:
    """A chat (a list of {role, content}) as the token ids of its chat template with the generation prompt: the
    messages checked (a ``PromptError`` names the bad one), the config's ``system_prompt`` put first where the chat
    has none, the last ``KEPT`` conversations' ids kept (a turn encodes the same conversation for the input rail and
    again for the generation: at 128K tokens each encoding took ~0.5 s of the time to the first token), the rest
    through ``ChatEncoder``. The local Engine and the remote one (flashguard/remote/) render conversations with it:
    the same ids, whichever runs the model. Callers get their own list."""

    KEPT = 4

    def __init__(self, tokenizer, system_prompt: str | None = None):
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        self.chat_encoder = ChatEncoder(tokenizer)
        self._kept: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def encode(self, messages: Sequence[dict]) -> list[int]:
        if not messages:
            raise PromptError("the message list is empty; send at least one user message")
        msgs = []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if role not in ("system", "user", "assistant", "tool"):
                raise PromptError(f"messages[{i}].role must be system, user, assistant or tool; got {role!r}")
            if not isinstance(content, str):
                raise PromptError(f"messages[{i}].content must be a string")
            msgs.append({"role": role, "content": content})
        if self.system_prompt and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        key = tuple((m["role"], m["content"]) for m in msgs)
        with self._lock:
            ids = self._kept.get(key)
            if ids is not None:
                self._kept.move_to_end(key)
                return list(ids)
        ids = tuple(self.chat_encoder.encode(
            self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)))
        with self._lock:
            self._kept[key] = ids
            while len(self._kept) > self.KEPT:
                self._kept.popitem(last=False)
        return list(ids)


def as_message(message) -> dict:
    """``{role, content}`` of a chat message as NeMo and LangChain hand it over: a dict (``role``, or LangChain's
    ``type``) or a message object (``role`` / ``content`` attributes), their role names mapped to the chat
    template's (bot -> assistant, human -> user, developer -> system). The provider and the input rail's action
    read a request's messages with it."""
    if isinstance(message, dict):
        return {"role": _role(message.get("role") or message.get("type")), "content": message.get("content")}
    role = getattr(message, "role", None)
    return {"role": _role(getattr(role, "value", role)), "content": getattr(message, "content", None)}


def _role(role):
    return {"bot": "assistant", "human": "user", "developer": "system"}.get(role, role)
