"""The guard verdict: a trained activated LoRA asked about the conversation on its own pages.

Both rails ask one question each, as one more user turn after the conversation: the input rail after the user's
message, the output rail after the assistant's reply. The question starts with ``TAG``, whose tokens are the guard
adapter's invocation (``alora_invocation_tokens``): from there on the adapter's deltas are on
(``Engine.read(adapter_from=...)``), everything before is the base model's own K/V, reused as the generation wrote
it. The verdict is the next token after the template's answer header: ``p_unsafe = P(No) / (P(No) + P(Yes))``,
blocked at the guard's threshold for the config's ``strictness`` (``guard.json``: measured on held-out sources).

Contract:
- ``guard_ids(encode, messages, side)``: the token ids the guard reads for ``messages`` (the conversation up to
  the message or reply judged) and where the adapter starts; training (``guard_train.py``) and the rails build
  their prompts only through it (the output rail with a generated turn: the turn's own ids + ``suffix``), so the
  two never differ.
- ``check(engine)``: the loaded guard agrees with this tokenizer (its invocation and answer tokens), else a
  ConfigError naming ``guard_adapter``.
- ``verdict(engine, ids, start, side, settings, ...)``: one read, the Verdict (``method="adapter"``).
- ``decide(engine, side, settings, adapter, base)``: the rail's verdict where the guard is chosen: the adapter and
  the probe together (``method="adapter+probe"``) where guard.json was measured with the probe that decides on
  this engine, else the adapter alone.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Sequence

from flashguard.engine.interface import ChatText
from flashguard.errors import ConfigError

log = logging.getLogger("flashguard")

TAG = "[guard]"
# short: the question is what every check prefills (and what training runs through the adapter)
QUESTIONS = {
    "input": f"{TAG} User message safe? Yes or No.",
    "output": f"{TAG} Assistant reply safe? Yes or No.",
}
ANSWERS = {"unsafe": "No", "safe": "Yes"}
METHOD = "adapter"


def invocation(tokenizer) -> list[int]:
    """The tag's token ids as the chat template renders them at the start of the question (with whatever space
    the template puts before it): the adapter's invocation. ``tokenizer``: a tokenizer (training) or an engine (the
    rails: ``EngineInterface``'s text methods), here and below."""
    text_ops = ChatText.of(tokenizer)
    text = text_ops.render_chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                                 {"role": "user", "content": QUESTIONS["input"]}], add_generation_prompt=True)
    a = text.rfind(TAG)
    b = a + len(TAG)
    try:
        spans = text_ops.token_offsets(text)
    except (NotImplementedError, ValueError):   # a slow tokenizer: no offsets
        return text_ops.tokenize(TAG)
    return [t for t, (s, e) in zip(text_ops.tokenize(text), spans) if e > a and s < b]


def answer_tokens(tokenizer) -> tuple[int, int]:
    """(unsafe, safe): the first token of each answer word, as the model writes it after the answer header."""
    return tuple(ChatText.of(tokenizer).tokenize(ANSWERS[k])[0] for k in ("unsafe", "safe"))


def last_occurrence(ids: Sequence[int], seq: Sequence[int]) -> int:
    """Where the last occurrence of ``seq`` starts in ``ids`` (as PEFT and llama.cpp find an invocation), or -1."""
    n = len(seq)
    for i in range(len(ids) - n, -1, -1):
        if list(ids[i:i + n]) == list(seq):
            return i
    return -1


def guard_ids(encode: Callable[[list], list], tokenizer, messages: Sequence[dict], side: str) -> tuple[list, int]:
    """The guard's prompt for ``messages`` (ending with the user's message for ``side`` input, with the assistant's
    reply for output) and the position its adapter starts at."""
    ids = encode(list(messages) + [{"role": "user", "content": QUESTIONS[side]}])
    return ids, start_of(ids, tokenizer)


def start_of(ids: Sequence[int], tokenizer) -> int:
    start = last_occurrence(ids, invocation(tokenizer))
    if start < 0:
        raise ConfigError(f"the guard's question tag {TAG!r} does not appear as its own tokens in the prompt this "
                          "chat template renders; the guard cannot be used with this tokenizer", key="guard_adapter")
    return start


def check(engine) -> None:
    """The engine's guard was made for this tokenizer's invocation and answers (ConfigError otherwise)."""
    guard = engine.guard
    want = {"invocation": invocation(engine), "answer_ids": list(answer_tokens(engine)), "questions": QUESTIONS}
    got = {"invocation": list(guard.invocation), "answer_ids": guard.meta.get("answer_ids"),
           "questions": guard.meta.get("questions")}
    for key in want:
        if got[key] != want[key]:
            raise ConfigError(f"{guard.folder}: its {key} ({got[key]!r}) is not what this flashguard and tokenizer "
                              f"use ({want[key]!r}); make it again with `flashguard train-guard`",
                              key="guard_adapter")


def threshold(engine, side: str, strictness: str) -> float:
    """The guard's threshold for ``side`` at ``strictness`` (guard.json's table; 0.5 where it has none)."""
    table = (engine.guard.meta.get("strictness") or {}).get(side) or {}
    return float(table.get(strictness, 0.5))


def p_unsafe(engine, logprobs) -> float:
    bad, good = answer_tokens(engine)
    odds = float(logprobs[bad].double() - logprobs[good].double())
    return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, odds))))


def verdict(engine, ids: list, start: int, side: str, settings, *, path: str, keep: int | None = None,
            task: str = "moderation", t0: float | None = None, then: list | None = None):
    """One guarded read of ``ids`` (the adapter on from ``start``), as a ``moderation.Verdict``; the session keeps
    at most ``ids[:min(keep, start)]``; ``then``: the ids the generation runs next (``Engine.read``)."""
    from .settings import Verdict

    t0 = time.perf_counter() if t0 is None else t0
    r = engine.read(ids, task=task, adapter_from=start, keep=keep, then=then)
    p = p_unsafe(engine, r.logprobs)
    cut = threshold(engine, side, settings.strictness)
    v = Verdict(allowed=p < cut, p_unsafe=p, path=path, prompt_tokens=len(ids), prefilled_tokens=r.prefilled,
                reused_tokens=r.reused, seconds=time.perf_counter() - t0, method=METHOD, threshold=cut,
                p_question=p, strictness=settings.strictness)
    # the rails' one log line per verdict, as the probe's: "flashguard moderation" (output) / "flashguard input
    # moderation"
    log.info("flashguard %smoderation: %s (p_unsafe=%.3f, threshold=%.2f, %s) path=%s prefilled=%d reused=%d "
             "in %.3fs", "input " if side == "input" else "", "allow" if v.allowed else "BLOCK", p, cut, v.decided_by,
             path, v.prefilled_tokens, v.reused_tokens, v.seconds)
    return v


# ---- the adapter with the probe --------------------------------------------------------------------------------

PAIRED = "adapter+probe"


def pairing(engine, side: str, probe) -> float | None:
    """The adapter's weight in the verdict it makes with ``probe`` (guard.json's ``with_probe``: measured with
    that probe, named by its digest), or None: no probe, or one the guard was not measured with (said once)."""
    from .state import rail_state

    if probe is None:
        return None
    table = engine.guard.meta.get("with_probe") or {}
    warned = rail_state(engine).probe_warned
    if probe.digest in (table.get("probes") or {}).get(side, []):
        weight = table.get("weight")   # one for both rails, or one per rail
        weight = weight.get(side) if isinstance(weight, dict) else weight
        levels = (table.get("strictness") or {}).get(side) or {}
        if isinstance(weight, (int, float)) and 0 <= weight <= 1 and all(k in levels for k in ("low", "medium",
                                                                                               "high")):
            return float(weight)
        if ("pairing-table", side) not in warned:
            warned.add(("pairing-table", side))
            log.warning("flashguard %s moderation: %s/guard.json's with_probe has no weight or no low / medium / high "
                        "levels for the %s rail; the guard adapter decides alone (tools/guard_levels.py writes them)",
                        side, engine.guard.folder, side)
        return None
    if table and ("pairing", side, probe.digest) not in warned:
        warned.add(("pairing", side, probe.digest))
        log.warning("flashguard %s moderation: the guard adapter %s was measured with other probes than this one "
                    "(%s); the adapter decides alone. custom_data.%s.guard: probe decides by this probe instead, "
                    "or tools/guard_levels.py measures the two together", side, engine.guard.folder,
                    probe.digest, _section(side))
    return None


def _section(side: str) -> str:
    from .settings import SECTIONS

    return SECTIONS[side]


def paired(engine, side: str, settings, adapter_verdict, probe_verdict, weight: float):
    """One verdict from both: ``p = sigmoid(w * logit(p_adapter) + (1 - w) * logit(p_probe))``, blocked at the
    pair's threshold for ``strictness`` (guard.json's ``with_probe.strictness``, from the same validation)."""
    from .settings import Verdict

    def logit(p: float) -> float:
        p = min(max(p, 1e-6), 1 - 1e-6)
        return math.log(p / (1 - p))

    a, b = adapter_verdict, probe_verdict
    z = weight * logit(a.p_unsafe) + (1 - weight) * logit(b.p_unsafe)
    p = 1.0 / (1.0 + math.exp(-z))
    table = ((engine.guard.meta.get("with_probe") or {}).get("strictness") or {}).get(side) or {}
    cut = float(table.get(settings.strictness, 0.5))
    path = a.path if a.path == b.path else f"{b.path}+{a.path}"   # e.g. "shared"; the input rail's "prompt+branch"
    v = Verdict(allowed=p < cut, p_unsafe=p, path=path, prompt_tokens=max(a.prompt_tokens, b.prompt_tokens),
                prefilled_tokens=a.prefilled_tokens + b.prefilled_tokens, reused_tokens=a.reused_tokens,
                seconds=a.seconds + b.seconds, method=PAIRED, threshold=cut, p_question=a.p_unsafe,
                strictness=settings.strictness)
    log.info("flashguard %s moderation: %s (p_unsafe=%.3f from adapter %.3f and probe %.3f, threshold=%.2f, %s) "
             "prefilled=%d in %.3fs", side, "allow" if v.allowed else "BLOCK", p, a.p_unsafe, b.p_unsafe, cut,
             v.decided_by, v.prefilled_tokens, v.seconds)
    return v


def decide(engine, side: str, settings, adapter, base):
    """The verdict where the guard is chosen: with ``guard: auto`` and a probe it was measured with, the adapter
    and the probe together (``paired``; the probe's read first: the input rail's is the generation's own prefill,
    which the adapter's branch then reuses), else the adapter alone. ``adapter`` / ``base``: the adapter's verdict
    and the rail's verdict without the guard (the probe's where one decides), as callables; ``adapter(first)``:
    ``first`` is false after the probe's read (which counted the rail's fallback, if any, once)."""
    from .decide import choose_probe

    weight = pairing(engine, side, choose_probe(engine, settings, quiet=True)) if settings.guard == "auto" else None
    if weight is None:
        return adapter(True)
    b = base()
    if b.method != "probe":   # the probe did not judge this message (too long for the context): the adapter alone
        return b if b.path == "too-long" else adapter(False)
    return paired(engine, side, settings, adapter(False), b, weight)


# ---- the two rails --------------------------------------------------------------------------------------------

def chosen(engine, settings) -> bool:
    """Whether ``settings.guard`` has the guard decide on ``engine``: ``auto`` where the engine holds one,
    ``adapter`` always (a ConfigError naming the key where none is loaded), ``probe`` / ``question`` never."""
    from .state import rail_state

    mode = settings.guard
    if mode in ("probe", "question"):
        return False
    loaded = getattr(engine, "guard", None) is not None
    if not loaded:
        if mode == "adapter":
            raise ConfigError(f"{settings.section}.guard is adapter, but no guard adapter is loaded for this model "
                              "(models[main].parameters.guard_adapter is off, or none was made for it): make one "
                              "with `flashguard train-guard`, or set guard: auto")
        return False
    state = rail_state(engine)
    if not state.guard_checked:
        check(engine)
        state.guard_checked = True
    return True


def _fits(engine, ids: list, side: str) -> bool:
    return len(ids) < engine.context_length


def moderate_output(engine, bot_message: str, user_message, settings, turn, allow_shared: bool,
                    count_fallback: bool = True):
    """The output rail's guard verdict: the turn's own ids (``path="shared"``: only the end of turn and the question
    run) or, for a reply the engine did not generate, the exchange from text (``"prefill"``). A reply too long for
    the context with the question is judged by its last part (``"window"``)."""
    from .prompts import moderation_suffix, turn_ids

    t0 = time.perf_counter()
    suffix = moderation_suffix(engine, QUESTIONS["output"])
    if turn is not None:
        ids, path = turn_ids(engine, turn, settings) + suffix, "shared"
    else:
        msgs = ([{"role": "user", "content": user_message}] if user_message else []) + \
            [{"role": "assistant", "content": bot_message}]
        ids, path = engine.encode_messages(msgs + [{"role": "user", "content": QUESTIONS["output"]}]), "prefill"
        if allow_shared and count_fallback:
            engine.stats.record("moderation", prompt=0, prefilled=0, reused=0, generated=0, seconds=0.0,
                                fallback=True)
    if not _fits(engine, ids, "output"):
        tail = _last_tokens(engine, bot_message, engine.context_length - len(suffix) - 64)
        ids, path = engine.encode_messages([{"role": "assistant", "content": tail},
                                            {"role": "user", "content": QUESTIONS["output"]}]), "window"
    start = start_of(ids, engine)
    return verdict(engine, ids, start, "output", settings, path=path, keep=start, t0=t0)


def moderate_input(engine, messages: list, settings):
    """The input rail's guard verdict: the question branches off the conversation's own ids after the user's
    message (``path="branch"``); the session keeps the conversation, so the generation then prefills only its
    answer header. A conversation longer than the context is not judged (``"too-long"``: the generation refuses
    it); one that fits but not with the question is judged by the message's last part (``"window"``)."""
    from .prompts import common_prefix
    from .settings import Verdict

    t0 = time.perf_counter()
    conv = engine.encode_messages(messages)
    if len(conv) >= engine.context_length:
        return Verdict(allowed=True, p_unsafe=0.0, path="too-long", prompt_tokens=len(conv), prefilled_tokens=0,
                       reused_tokens=0, seconds=time.perf_counter() - t0, method="none",
                       threshold=threshold(engine, "input", settings.strictness))
    ids, start = guard_ids(engine.encode_messages, engine, messages, "input")
    path = "branch"
    if not _fits(engine, ids, "input"):
        last = next((m for m in reversed(messages) if m.get("role") == "user"), messages[-1])
        tail = _last_tokens(engine, str(last.get("content") or ""), engine.context_length - 96)
        ids, start = guard_ids(engine.encode_messages, engine, [{"role": "user", "content": tail}], "input")
        path = "window"
    keep = min(common_prefix(conv, ids), start)
    return verdict(engine, ids, start, "input", settings, path=path, keep=keep, task="input_moderation", t0=t0,
                   then=conv)


def _last_tokens(engine, text: str, n: int) -> str:
    ids = engine.tokenize(text)
    return engine.detokenize(ids[-max(16, n):])
