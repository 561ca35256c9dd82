"""Reasoning models (DeepSeek-R1 distills): the ``<think>...</think>`` block they write before the answer.

The provider splits every generation into *reasoning* and *answer* as it streams (``ThinkSplitter``) and hands
them to NeMo Guardrails 0.24 the way its own LLM calls expect: ``LLMResponse(content=answer, reasoning=...)`` and
``LLMResponseChunk(delta_content=..., delta_reasoning=...)``. NeMo then keeps the reasoning out of the bot message
(its ``bot_thinking`` context variable and ``GenerationResponse.reasoning_content``), so the output rails, the
server and the chat see the answer. NeMo 0.24 has no config key that hides or keeps reasoning traces (the older
``reasoning_config.remove_reasoning_traces`` is gone); ``LLMRails.generate(messages=...)`` without options puts
the trace back in front of the content as ``<think>...</think>\\n``, which ``split_answer`` takes off again.

The R1 distills' chat template already opens the block in the generation prompt (``<｜Assistant｜><think>\\n``),
so the model's output starts inside it and only ``</think>`` appears: ``prompt_opens_think`` tells the splitter.
"""

from __future__ import annotations

import contextvars
import re
from typing import Callable, Optional, Sequence

OPEN, CLOSE = "<think>", "</think>"
DEFAULT_REASONING_TOKENS = 2048

# The chat's listener for reasoning text as it streams (``flashguard chat`` shows it dimmed); None: nobody listens.
reasoning_sink: contextvars.ContextVar[Optional[Callable[[str], None]]] = contextvars.ContextVar(
    "flashguard_reasoning_sink", default=None)


def writes_reasoning(tokenizer) -> bool:
    """True for a model whose chat template writes ``<think>`` blocks (DeepSeek-R1 distills, QwQ, ...);
    ``tokenizer``: a tokenizer or an engine (either has ``chat_template``)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and (OPEN in template or CLOSE in template)


def reasoning_budget(config, tokenizer) -> int:
    """Tokens a call may spend on reasoning on top of ``max_tokens`` (``reasoning_tokens``, auto: 2048 for a
    model that writes ``<think>``, else 0)."""
    if config.reasoning_tokens is not None:
        return config.reasoning_tokens
    return DEFAULT_REASONING_TOKENS if writes_reasoning(tokenizer) else 0


def prompt_opens_think(tokenizer, ids: Sequence[int]) -> bool:
    """True when the prompt's last tokens open a ``<think>`` block (the R1 template's generation prompt)."""
    return opens_think(tokenizer.decode(list(ids[-8:]), skip_special_tokens=False))


def opens_think(tail: str) -> bool:
    """True when ``tail``, a prompt's last tokens as text (special tokens kept), opens a ``<think>`` block."""
    return tail.rstrip().endswith(OPEN)


class ThinkSplitter:
    """Splits streamed text into ``(reasoning, answer)`` pieces.

    ``inside``: the prompt already opened the block. Otherwise a block counts only at the start of the output
    (after whitespace); text that starts with anything else is all answer. A tag split across two pieces is
    held back until it is whole. After ``</think>`` the answer's leading whitespace is dropped. ``finish()``
    returns what is held back: an unclosed block (the reasoning ran out of tokens) is all reasoning.
    """

    def __init__(self, inside: bool = False):
        self.state = "reasoning" if inside else "start"
        self.buf = ""
        self.reasoning_started = False

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, answer = [], []
        while self.buf:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.state = head[len(OPEN):], "reasoning"
                elif OPEN.startswith(head):   # empty, or a tag not yet whole
                    break
                else:
                    self.state = "answer"
            elif self.state == "reasoning":
                if not self.reasoning_started:
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        break
                    self.reasoning_started = True
                end = self.buf.find(CLOSE)
                if end >= 0:
                    reasoning.append(self.buf[:end])
                    self.buf, self.state = self.buf[end + len(CLOSE):], "after"
                    continue
                keep = _partial_tag(self.buf, CLOSE)
                reasoning.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            elif self.state == "after":
                self.buf = self.buf.lstrip()
                if self.buf:
                    self.state = "answer"
            else:
                answer.append(self.buf)
                self.buf = ""
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest if self.state in ("start", "answer") else ""

    @property
    def answering(self) -> bool:
        """True once the answer has begun (the block closed, or there was none)."""
        return self.state in ("after", "answer")


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_answer(content: str) -> tuple[Optional[str], str]:
    """``(reasoning or None, answer)`` of a whole text that may start with a ``<think>...</think>`` block (what
    ``LLMRails.generate(messages=...)`` returns for a reasoning model)."""
    m = re.match(r"\s*<think>(.*?)</think>\s*", content, re.DOTALL)
    if not m:
        return None, content
    return m.group(1).strip(), content[m.end():]
