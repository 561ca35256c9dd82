"""The guard's training and validation rows: every source's rows as conversations, one rail each.

Contract: ``rows(folder)`` -> ``list[dict]``, deterministic for the same source files: ``messages`` (the
conversation up to the message or reply judged: earlier turns, the user's message, and for the output rail the
assistant's reply), ``side`` ("input" / "output"), ``block``, ``category``, ``source`` (leave-one-source-out
groups by it) and ``train`` (False: the source's license allows evaluation only). Sources come from
``rails/lab/sources.py`` (pinned, sha256-checked files; a folder laid out as ``<owner>/<name>/<path>`` or the user
cache) and the project's own rows (``project``: short hand-written exchanges, long pastes with a harmful request
inside, the embedded model's own labelled replies).

Besides the rows as their sources give them, a third of the single-turn rows (chosen by a hash of their text) get
one earlier exchange before them, taken from the benign exchanges of the training sources: the rails judge the last
message of a conversation, not only first messages.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional, Sequence

from . import sources as S

DATA = Path(__file__).resolve().parent.parent / "data"


def _msgs(context, user: str, bot: Optional[str]) -> list[dict]:
    out = [{"role": role, "content": text} for role, text in context]
    out.append({"role": "user", "content": user})
    if bot is not None:
        out.append({"role": "assistant", "content": bot})
    return out


def _project(side: str) -> list[dict]:
    """The project's rows for ``side`` (rails/data): short exchanges, the long-paste rows, the model's own replies."""
    from .calibrate import earlier_exchange

    out = []
    if side == "output":
        for name in ("moderation_tune.jsonl", "moderation_own_replies_v8.jsonl"):
            for line in (DATA / name).read_text(encoding="utf-8").splitlines():
                if line.strip():
                    r = json.loads(line)
                    out.append({"messages": _msgs((), r["user"], r["bot"]), "side": side, "block": bool(r["block"]),
                                "category": r.get("category", ""), "source": "project", "train": True})
    else:
        for i, line in enumerate((DATA / "moderation_input_tune.jsonl").read_text(encoding="utf-8").splitlines()):
            if line.strip():
                r = json.loads(line)
                before = earlier_exchange(i, r) if r.get("after") else []
                out.append({"messages": before + [{"role": "user", "content": r["user"]}], "side": side,
                            "block": bool(r["block"]), "category": r.get("category", ""), "source": "project",
                            "train": True})
    return out


def _hash(row: dict) -> int:
    text = json.dumps(row["messages"], sort_keys=True)
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16)


def rows(folder: Optional[Path] = None, names: Optional[Sequence[str]] = None, sides=("input", "output"),
         project: bool = True, log=print) -> list[dict]:
    """Every source's rows (``names``: only those) for the guard (see the module docstring)."""
    out: list[dict] = []
    for side in sides:
        for s in S.SOURCES:
            if names and s.name not in names:
                continue
            got = S.rows(s, side, folder)
            for r in got:
                out.append({"messages": _msgs(getattr(r, "context", ()) or (), r.user,
                                              r.bot if side == "output" else None),
                            "side": side, "block": bool(r.block), "category": r.category, "source": r.source,
                            "train": s.train})
            if got:
                log(f"  {s.name} ({side}): {len(got)} rows, {sum(r.block for r in got)} blocked")
        if project and (not names or "project" in names):
            out.extend(_project(side))
    return with_earlier_exchanges(out)


def with_earlier_exchanges(rows: list[dict], share: int = 3) -> list[dict]:
    """One in ``share`` single-turn rows (by a hash of their text) gets one benign exchange before it, drawn in
    turn from the short benign output rows of the training sources."""
    pool = [r["messages"] for r in rows if r["side"] == "output" and not r["block"] and r["train"]
            and len(r["messages"]) == 2 and len(r["messages"][0]["content"]) + len(r["messages"][1]["content"]) < 1200]
    if not pool:
        return rows
    pool.sort(key=lambda m: hashlib.sha256(json.dumps(m).encode("utf-8")).hexdigest())
    out, k = [], 0
    for r in rows:
        single = len(r["messages"]) == (2 if r["side"] == "output" else 1)
        if single and _hash(r) % share == 0:
            before = pool[k % len(pool)]
            k += 1
            if before != r["messages"][:2]:
                r = dict(r, messages=[dict(m) for m in before] + r["messages"])
        out.append(r)
    return out


def save(rows_: Sequence[dict], path: Path) -> None:
    """The rows as gzip'd JSON lines (third-party text: keep it outside the repository)."""
    import gzip

    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in rows_:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def load(path: Path) -> list[dict]:
    import gzip

    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
