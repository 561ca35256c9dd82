"""Long-paste rows for the output rail's tuning set (issue 14; docs/moderation.md, "Replies after long pastes").

    python tools/make_long_output_items.py            # appends copy 1 to rails/data/moderation_tune.jsonl
    python tools/make_long_output_items.py --copy 2   # appends copy 2 (other pastes; tried, not kept: docs)
    python tools/make_long_output_items.py --dry-run  # prints what it would append

The output probe reads the state at the end of the moderation suffix, after the whole turn. Trained on short
exchanges only, it blocked 46 of 48 benign replies of output test set B when 1.5K-3K characters of documentation were
pasted before the user's question (tools/check_output_rail_long_pastes.py). This script writes, for every short row
of the output tuning set, one more row with the same reply and label and the same user message with a long pasted
text before it (or, for a third of them, after it): pydoc topics, package READMEs, standard-library source and
generated logs, **all from the tuning split of tools/make_long_input_items.py** (TUNE_DOC_KEYS, TUNE_README,
TUNE5_README, TUNE_CODE, TUNE5_CODE and the nginx / auth / python log kinds). The check and the held-out sets use
other sources (TEST_DOC_KEYS, the ci log kind) and the check's own lead-in, which no row here uses. Each new row
carries ``paste`` (the kind of text) so that the input rail's ``earlier_exchange`` keeps using the short rows only,
and ``flashguard calibrate`` keeps a row and its long copy in the same cross-validation fold (grouped by reply).
The text depends on Python 3.11.7's pydoc topics and the packages installed in the virtual environment, as
make_long_input_items.py's does.
"""

from __future__ import annotations

import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import make_long_input_items as M  # noqa: E402

TUNE_PATH = os.path.join(ROOT, "rails", "data", "moderation_tune.jsonl")
LENGTHS = [800, 1500, 2500, 3500, 5000]
# lead-ins before a paste that comes first (the check's "Here is something I was reading:" is not among them)
LEADS = ["", "", "Context:\n\n", "I was going through this earlier:\n\n", "Pasting this from my notes.\n\n",
         "Background (you can skip it):\n\n", "This is from a page I had open.\n\n", "copied from work, ignore\n\n",
         "Some text for reference:\n\n"]
JOINS = ["\n\n", "\n\n", "\n\n", "\n\nAnyway, my question: ", "\n\nSeparate question: ", "\n\n---\n\n"]
# a paste after the question
AFTERS = ["\n\nFor context, this is what I had open:\n\n", "\n\n(The text I was reading, in case it matters:)\n\n",
          "\n\nAlso pasting this:\n\n", "\n\n"]


def paste_text(kind: str, rng: random.Random, n: int) -> str:
    if kind == "document":
        return M.doc_text(M.TUNE_DOC_KEYS, rng, n)
    if kind == "readme":
        return M.readme_text(M.TUNE_README + M.TUNE5_README, rng, n)
    if kind == "code":
        return M.code_text(M.TUNE_CODE + M.TUNE5_CODE, rng, n)
    return M.log_text(rng.randrange(10 ** 9), n, rng.choice(["nginx", "auth", "python"]))


def long_rows(rows: list[dict], seed: int = 14) -> list[dict]:
    rng = random.Random(seed)
    kinds = ["document"] * 7 + ["readme"] * 5 + ["code"] * 4 + ["log"] * 4
    out = []
    for r in rows:
        kind, n = rng.choice(kinds), rng.choice(LENGTHS)
        text = paste_text(kind, rng, n)
        if rng.random() < 2 / 3:
            lead = rng.choice(LEADS)
            fence = kind == "code" and rng.random() < 0.5
            body = f"```\n{text}\n```" if fence else text
            user = lead + body + rng.choice(JOINS) + r["user"]
        else:
            user = r["user"] + rng.choice(AFTERS) + text
        out.append({"user": user, "bot": r["bot"], "block": r["block"], "category": r["category"], "paste": kind})
    return out


def main(argv) -> int:
    """``--copy N``: the N-th long copy of every short row (seed 13 + N; default 1). Copy 1 is rows 291-580 of the
    tuning set, copy 2 rows 581-870 (other pastes, lengths and placements of the same exchanges)."""
    copy = int(argv[argv.index("--copy") + 1]) if "--copy" in argv else 1
    lines = [line for line in open(TUNE_PATH, encoding="utf-8") if line.strip()]
    rows = [json.loads(line) for line in lines]
    short = [r for r in rows if "paste" not in r]
    if len(rows) != copy * len(short):
        raise SystemExit(f"{TUNE_PATH} has {len(rows) - len(short)} long-paste rows; copy {copy} needs "
                         f"{(copy - 1) * len(short)}")
    new = long_rows(short, seed=13 + copy)
    print(f"{len(new)} rows, {sum(r['block'] for r in new)} block, {sum(len(r['user']) for r in new)} characters of "
          f"user text; kinds {sorted((k, sum(r['paste'] == k for r in new)) for k in {r['paste'] for r in new})}")
    if "--dry-run" in argv:
        for r in new[:3]:
            print(json.dumps(r, ensure_ascii=False)[:600])
        return 0
    with open(TUNE_PATH, "a", encoding="utf-8") as f:
        for r in new:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
