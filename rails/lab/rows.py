"""``python -m flashguard.rails.lab.rows FOLDER OUT``: the guard's training and validation rows, the pinned public
sources' (``guard_data.rows``, read from FOLDER laid out as ``<owner>/<name>/<path>``, or ``download``: the user
cache) and the rows made from them by rule (``made_rows.made_rows``), written to OUT as gzip'd JSON lines
(third-party text: keep OUT outside the repository). Prints the counts by rule, rail and label."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

from . import guard_data
from .made_rows import made_rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__)
        return 2
    folder, out = argv
    rows = guard_data.rows(None if folder == "download" else Path(folder), log=lambda *_: None)
    new = made_rows(rows)
    guard_data.save(rows + new, Path(out))
    counts = collections.Counter((r.get("made", "source"), r["side"], "blocked" if r["block"] else "allowed")
                                 for r in rows + new)
    for k, v in sorted(counts.items()):
        print(f"  {' / '.join(k)}: {v}")
    print(f"{len(rows) + len(new)} rows ({len(new)} made by rule) written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
