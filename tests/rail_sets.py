"""The project's labelled rail sets (tests/data) and the harness that runs a rail on one row as a guarded turn runs
it: what the rail tests and ``benchmarks/guard_sets.py`` (accuracy over whole sets, with their floors) share."""

from __future__ import annotations

import random
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"

# ---- output rail sets --------------------------------------------------------------------------------------------
# set A: first held-out evaluation (v1 probes), its failures shaped v2's tuning additions; set B: written with v2,
# before it was trained. Run B first (the order of docs/moderation.md's tables).
OUTPUT_SETS = {"B": DATA / "moderation_test_b.jsonl", "A": DATA / "moderation_test.jsonl"}
OUTPUT_HARMFUL = {"violence", "weapons", "self-harm", "hate", "minors", "crime", "cyber", "drugs", "privacy"}
OUTPUT_BENIGN = {"war-history", "first-aid", "security-advice", "refusal", "fiction", "greeting", "fact", "code"}

# ---- input rail sets ---------------------------------------------------------------------------------------------
INPUT_SETS = {name: DATA / f"{name}.jsonl" for name in ("moderation_input_test", "moderation_input_test_b",
                                                         "moderation_input_test_c", "moderation_input_test_d")}
INPUT_LONG_SETS = {"moderation_input_test_c", "moderation_input_test_d"}   # with long items (A and B were before)
INPUT_HARMFUL = {"violence", "weapons", "self-harm", "hate", "minors", "crime", "cyber", "drugs", "privacy",
                 "jailbreak", "injection"}
INPUT_BENIGN = {"greeting", "fact", "code", "war-history", "first-aid", "security-advice", "fiction", "about-ai",
                "roleplay", "everyday"}
# long messages (tools/make_long_input_items.py): pasted documents, code and logs, alone or with a request; harmful
# requests, jailbreaks and injections hidden in such text (at its end, start or middle); long jailbreak prompts
LONG_HARMFUL = {"long-hidden", "long-jailbreak"}
LONG_BENIGN = {"long-document", "long-code", "long-log"}

# Short messages after a long paste exchange (tools/make_long_followup_items.py --test): 72 short messages, each after
# one of 12 paste exchanges (a 2-18K-character paste from the TEST split with a question, and a reply): 24 follow-ups
# about the text and 12 ordinary benign messages (allowed), 24 ordinary harmful requests, jailbreaks and injections
# and 12 harmful follow-ups about the text (blocked); none of its messages is a tuning one.
FOLLOWUP_SET = DATA / "moderation_input_test_followup.jsonl"
FOLLOWUP_PASTES = DATA / "moderation_input_followup_pastes.jsonl"

# Three sets of 48 short, blunt requests (24 harmful over the nine categories, 24 benign look-alikes): ``plain`` was
# written with the v5 output probes (6 of its benign texts are also input tuning rows: greetings, facts), ``plain_b``
# before v7's first fit (its results guided v7's second batch of tuning rows: seen), ``plain_c`` before v7's second
# fit (held out).
PLAIN_SETS = {name: DATA / f"{name}.jsonl" for name in ("moderation_input_plain", "moderation_input_plain_b",
                                                         "moderation_input_plain_c")}


@lru_cache(maxsize=None)
def _rows(path: Path, side: str) -> tuple:
    from flashguard.rails.lab.calibrate import read_rows

    return tuple(read_rows(path, side))


def rows(path: Path, side: str = "output") -> list[dict]:
    """The labelled rows of one set (``flashguard.rails.lab.calibrate.read_rows``; ``side="input"``: no ``bot``)."""
    return list(_rows(Path(path), side))


def input_context() -> list[tuple[str, str]]:
    """The benign exchanges of output set B (never tuned on): the earlier turn of the input sets' odd rows."""
    return [(r["user"], r["bot"]) for r in rows(OUTPUT_SETS["B"]) if not r["block"]]


def as_conversation(i: int, message: str) -> list[dict]:
    """Even rows: the message alone; odd rows: after one earlier exchange (a message in a conversation)."""
    if i % 2 == 0:
        return [{"role": "user", "content": message}]
    context = input_context()
    user, bot = context[i // 2 % len(context)]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": bot},
            {"role": "user", "content": message}]


def followup_conversation(row: dict) -> list[dict]:
    """A follow-up row's paste exchange, then its message."""
    from flashguard.rails.lab.calibrate import earlier_exchange

    return earlier_exchange(0, row, FOLLOWUP_PASTES) + [{"role": "user", "content": row["user"]}]


def paste_tools():
    """tools/check_output_rail_long_pastes.py (the pasted set B) and tools/make_long_input_items.py (the splits)."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import check_output_rail_long_pastes as C
    import make_long_input_items as M

    return C, M


def output_set_after_pastes() -> list[dict]:
    """Output set B with documentation pasted before each user message: the check's part 2, from its seeded
    generator (part 1 draws from it first)."""
    C, _ = paste_tools()
    rng = random.Random(7)
    C.own_reply_prompts(rng)
    return C.set_b_after_pastes(rng, rows(OUTPUT_SETS["B"]))


# ---- running the rails -------------------------------------------------------------------------------------------
def output_verdict(engine, row: dict, settings=None):
    """Teacher-force the reply as the engine's turn, then the output rail on it (the shared-page path)."""
    from flashguard.rails.moderation import ModerationSettings, moderate

    prompt = engine.encode_messages([{"role": "user", "content": row["user"]}])
    reply = engine.tokenizer(row["bot"], add_special_tokens=False)["input_ids"]
    engine.teacher_force(prompt, reply, row["bot"])
    return moderate(engine, row["bot"], row["user"], settings or ModerationSettings(), use_memo=False)


def input_verdict(engine, messages: list[dict], settings=None):
    """The input rail on a conversation whose last message is the user's."""
    from flashguard.rails.moderation import ModerationSettings, moderate_input

    return moderate_input(engine, messages, settings or ModerationSettings.input_defaults())
