"""The engine as the rails see it: one interface that the in-process ``Engine`` (engine.py) and the ``RemoteEngine``
(remote/engine.py, ``backend: openai``) both implement. The rails (``flashguard.rails``) use an engine through these
members only, so a rail written against one runs on the other.

Contract:
- Text and ids, by the model's own tokenizer and chat template (the same ones the generation uses):
  ``encode_messages(messages)``: the ids of a chat with its generation prompt, exactly as the generation runs it;
  ``tokenize(text)``: a text's ids, no special tokens added; ``detokenize(ids)``: their text, special tokens kept;
  ``token_offsets(text)``: the ``(start, end)`` characters of each of ``tokenize(text)``'s ids (NotImplementedError
  or ValueError from a tokenizer without offsets); ``render_chat(messages, add_generation_prompt)``: the chat
  template's text; ``chat_template``: the template itself.
- The model: ``context_length`` (every prompt is shorter), ``layer_count`` (decoder layers: a read's ``hidden`` has
  one row more), ``source`` (``loader.ModelSource``: the weights' file and identity), ``weights_kind`` (``float`` or
  ``int4`` in process; ``server`` remotely), ``adapter`` (``lora_path``'s ``lora.Adapter``: its ``digest``; None
  without one), ``guard`` (the rails' guard adapter: ``folder``, ``meta``, ``invocation``; None without one).
- ``returns_states``: whether ``read`` returns hidden states (``hidden``, ``layers`` / ``mean_from``, the probes'
  features). A remote engine's does not: the rails decide there by the next token's log-probabilities.
- ``read(ids, task, ...)``: the one call that runs the model for a verdict (``reading.Reading``: the next token's
  log-probabilities, the states asked for, the tokens reused); ``keep_exact(token_ids)``: those tokens' logits are
  exact whatever the lm_head (the rails name their answer tokens once).
- ``exclusive()``: a context in which no other call moves the engine's session; a rail holds it across the reads of
  one verdict. Re-entrant. The in-process engine's lock; a remote engine holds nothing (each request is its own).
- ``recent_turns()``: the replies this engine generated lately, oldest first (``decode_loop.Turn``: the prompt's
  ids, the reply's ids, its text): the output rail judges a reply on its own turn's ids.
- ``stats``: the engine's counters (``stats.EngineStats``); a rail records a fallback there.

The text methods and the turn memory are written once, here, over the tokenizer each implementation holds
(``tokenizer``) and its ``turns`` list (newest last, ``TURNS_KEPT`` at most); ``ChatText.of(tokenizer)`` gives the
same text methods to code that holds a bare tokenizer (the guard's training shares its prompts with the rails).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ContextManager, Sequence

if TYPE_CHECKING:
    from .decode_loop import Turn
    from .loader import ModelSource
    from .reading import Reading
    from .stats import EngineStats


class ChatText:
    """Text and ids by a transformers tokenizer (``self.tokenizer``): the interface's text methods."""

    tokenizer: Any

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def of(cls, tokenizer_or_text) -> "ChatText":
        """``tokenizer_or_text`` itself where it has these methods (an engine), else a ChatText over the tokenizer."""
        return tokenizer_or_text if isinstance(tokenizer_or_text, ChatText) else cls(tokenizer_or_text)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def token_offsets(self, text: str) -> list[tuple[int, int]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [tuple(span) for span in enc["offset_mapping"]]

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    @property
    def chat_template(self) -> str:
        return getattr(self.tokenizer, "chat_template", None) or ""


class EngineInterface(ChatText, abc.ABC):
    """What the rails use of an engine (the module docstring is the contract)."""

    returns_states: bool
    TURNS_KEPT = 64
    context_length: int
    source: "ModelSource"
    stats: "EngineStats"
    guard: Any
    adapter: Any
    turns: "list[Turn]"

    @abc.abstractmethod
    def encode_messages(self, messages: Sequence[dict]) -> list[int]:
        """The chat's ids with its generation prompt, as the generation runs them."""

    @abc.abstractmethod
    def read(self, ids: Sequence[int], task: str = "moderation", *, hidden: bool = False, layers=(),
             mean_from: int | None = None, keep_states: bool = False, keep: int | None = None,
             adapter_from: int | None = None, then: Sequence[int] | None = None) -> "Reading":
        """The next token after ``ids`` and what a verdict reads (each implementation says how)."""

    @abc.abstractmethod
    def keep_exact(self, token_ids: Sequence[int]) -> None:
        """Compute these tokens' logits exactly."""

    @abc.abstractmethod
    def exclusive(self) -> ContextManager:
        """A re-entrant context in which no other call moves the engine's session."""

    @property
    @abc.abstractmethod
    def layer_count(self) -> int:
        """The model's decoder layers."""

    @property
    @abc.abstractmethod
    def weights_kind(self) -> str:
        """``float`` or ``int4`` (in process), ``server`` (remote)."""

    def recent_turns(self) -> "tuple[Turn, ...]":
        """The replies generated lately, oldest first (a copy: another thread may add one meanwhile)."""
        return tuple(self.turns)

    def _remember(self, turn: "Turn") -> None:
        self.turns.append(turn)
        del self.turns[:-self.TURNS_KEPT]


def layers_of(model_config) -> int:
    """Decoder layers of a transformers config (a multimodal one's text model's)."""
    n = getattr(model_config, "num_hidden_layers", None)
    return int(n or model_config.get_text_config().num_hidden_layers)
