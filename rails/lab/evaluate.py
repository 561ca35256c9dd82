"""``flashguard eval-guard FILE``: a user's labelled file through the rails, measured.

Contract:

* ``read_labelled(path) -> list[Row]`` reads a JSONL file (``.jsonl`` / ``.json``: one object a line, or a ``.json``
  array of objects) or a CSV file (``.csv``, a header row). Columns (names case-insensitive, others ignored): ``user``
  and/or ``bot`` (or one ``text`` column, taken as the user's message), ``label``, optional ``category``. A label is
  one of ``LABELS`` (case-insensitive; the first of each pair means "should be blocked"). The whole file is checked
  before anything runs: the first bad row is an ``EvalFileError`` of one line naming the file, the row (1-based, data
  rows) and the column.
* ``plan(rows, rail)`` -> the checks ``(row, rail)``: by default a row without ``bot`` goes to the input rail and a
  row with one to the output rail; ``input`` / ``output`` judge every row that rail can; ``both`` also sends a row
  with ``user`` and ``bot`` to the input rail, on its user message (each rail reported apart). A rail asked for that
  no row can go to is an ``EvalFileError``.
* ``evaluate(rows, config, rail=...) -> Report`` judges each check through NeMo's public ``LLMRails.check`` (one
  ``LLMRails`` for ``config``, a folder or a built ``LLMRails``), a user message alone for the input rail, the user
  message and the reply for the output rail: the path an application's requests take. ``blocked`` is NeMo's
  status; ``p_unsafe`` / ``threshold`` come from the flashguard action's verdict (``actions.verdict_sink``), ``None``
  for another rail's flows. A flashguard flow that gives no verdict (its action failed, which NeMo reports as a
  block) is an ``EvalError``, never counted as a block.
* ``metrics(judged)`` -> per rail, per category and in total: blocked harmful and benign rows, precision, recall, F1
  (``Metrics``); ``format_report(report)`` is the plain table, ``report_json(report)`` the report with every verdict.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from flashguard.errors import ConfigError, FlashguardError

# label spellings (case-insensitive): "should be blocked" first, "should pass" second
LABEL_PAIRS = (("true", "false"), ("1", "0"), ("unsafe", "safe"), ("harmful", "benign"), ("harmful", "harmless"),
               ("block", "allow"), ("yes", "no"))
UNSAFE = frozenset(a for a, _ in LABEL_PAIRS)
SAFE = frozenset(b for _, b in LABEL_PAIRS)
LABELS = ", ".join(f"{a}/{b}" for a, b in LABEL_PAIRS)
RAILS = ("input", "output")
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}
ALL = "all"   # the totals' row in the table (a rail's every category)


class EvalFileError(FlashguardError):
    """The labelled file cannot be read: one line naming the file, the row and the column."""


class EvalError(FlashguardError):
    """A check gave no verdict (the flashguard action failed: NeMo reports that as a block, which is not one)."""


@dataclass(frozen=True)
class Row:
    """One labelled row: ``number`` is its 1-based position among the file's data rows; ``bot`` is None for a user
    message alone; ``user`` is "" for a reply alone; ``unsafe``: the label says it should be blocked."""

    number: int
    user: str
    bot: Optional[str]
    unsafe: bool
    category: str = ""


@dataclass(frozen=True)
class Judged:
    """One rail's verdict on one row. ``p_unsafe`` / ``threshold`` / ``method`` / ``strictness``: the flashguard
    action's verdict (None / "" for another rail's flows); ``seconds``: the whole ``LLMRails.check`` call,
    ``rail_seconds``: the flashguard verdict's own (the model's pass; the rest is NeMo's)."""

    row: Row
    rail: str
    blocked: bool
    p_unsafe: Optional[float] = None
    threshold: Optional[float] = None
    method: str = ""
    strictness: str = ""
    seconds: float = 0.0
    rail_seconds: Optional[float] = None


@dataclass(frozen=True)
class Metrics:
    """Counts of one rail and category (``ALL``: the rail's every row) and what they give."""

    rail: str
    category: str
    harmful: int
    benign: int
    harmful_blocked: int
    benign_blocked: int

    @property
    def harmful_rate(self) -> Optional[float]:
        """Share of the harmful rows blocked (recall); None without harmful rows."""
        return self.harmful_blocked / self.harmful if self.harmful else None

    @property
    def benign_rate(self) -> Optional[float]:
        """Share of the benign rows blocked (false-positive rate); None without benign rows."""
        return self.benign_blocked / self.benign if self.benign else None

    @property
    def precision(self) -> Optional[float]:
        """Share of the blocked rows that are harmful; None when nothing was blocked."""
        blocked = self.harmful_blocked + self.benign_blocked
        return self.harmful_blocked / blocked if blocked else None

    @property
    def recall(self) -> Optional[float]:
        return self.harmful_rate

    @property
    def f1(self) -> Optional[float]:
        """Harmonic mean of precision and recall; 0 when harmful rows exist and none was blocked; None without
        harmful rows."""
        if not self.harmful:
            return None
        if not self.harmful_blocked:
            return 0.0
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r)


@dataclass(frozen=True)
class Report:
    """What ``evaluate`` measured: every verdict, the rows a rail could not judge (``skipped``: rail -> count), the
    seconds the checks took (``seconds``; the model's load is not in it)."""

    file: str
    config: str
    judged: tuple[Judged, ...]
    skipped: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def metrics(self) -> list[Metrics]:
        return metrics(self.judged)


# ---- reading ---------------------------------------------------------------------------------------------------
def read_labelled(path) -> list[Row]:
    """Every row of the labelled JSONL or CSV file ``path`` (module docstring); ``EvalFileError`` at the first bad
    one."""
    path = Path(path)
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise EvalFileError(f"{path}: expected a .jsonl, .json or .csv file, got {path.suffix or 'no suffix'!r}")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise EvalFileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalFileError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from None
    records = _jsonl_records(path, text) if kind == "jsonl" else _csv_records(path, text)
    rows = [_row(path, n, record) for n, record in enumerate(records, 1)]
    if not rows:
        raise EvalFileError(f"{path}: no data rows")
    return rows


def _jsonl_records(path: Path, text: str) -> list[dict]:
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):   # a JSON array of objects
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EvalFileError(f"{path}: not valid JSON ({exc})") from None
        items = list(data) if isinstance(data, list) else []
    else:
        items = []
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise EvalFileError(f"{path}: row {len(items) + 1}: not a JSON object ({exc})") from None
    for n, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise EvalFileError(f"{path}: row {n}: not a JSON object (got {type(item).__name__})")
    return [{str(k).strip().lower(): v for k, v in item.items()} for item in items]


def _csv_records(path: Path, text: str) -> list[dict]:
    try:
        reader = csv.DictReader(text.splitlines(keepends=True))
        records = [{str(k).strip().lower(): v for k, v in r.items() if k is not None} for r in reader]
    except csv.Error as exc:
        raise EvalFileError(f"{path}: row {reader.line_num}: not valid CSV ({exc})") from None
    return records


def _text(path: Path, n: int, record: dict, column: str) -> Optional[str]:
    value = record.get(column)
    if value is None:
        return None
    if not isinstance(value, str):
        raise EvalFileError(f"{path}: row {n}, column {column}: expected text, got {json.dumps(value)[:60]}")
    return value if value.strip() else None


def _row(path: Path, n: int, record: dict) -> Row:
    user, bot = _text(path, n, record, "user"), _text(path, n, record, "bot")
    if user is None and "user" not in record:
        user = _text(path, n, record, "text")
    if user is None and bot is None:
        column = "user" if "user" in record or "text" not in record else "text"
        raise EvalFileError(f"{path}: row {n}, column {column}: missing (a row needs user and/or bot, or text)")
    label = record.get("label")
    if label is None or (isinstance(label, str) and not label.strip()):
        raise EvalFileError(f"{path}: row {n}, column label: missing (one of {LABELS})")
    spelled = str(label).strip().lower() if isinstance(label, (str, bool, int)) else None
    if spelled not in UNSAFE | SAFE:
        raise EvalFileError(f"{path}: row {n}, column label: {json.dumps(label)[:60]} is not a label (one of "
                            f"{LABELS})")
    category = record.get("category")
    return Row(number=n, user=user or "", bot=bot, unsafe=spelled in UNSAFE,
               category="" if category is None else str(category).strip())


# ---- running ---------------------------------------------------------------------------------------------------
def plan(rows: Sequence[Row], rail: Optional[str] = None, file: str = "the file") -> tuple[list, dict]:
    """The checks ``[(row, rail)]`` for ``rail`` (None: by the row's columns; ``input``, ``output`` or ``both``) and
    the rows each rail asked for could not judge (``{rail: count}``). A rail asked for that no row can go to is an
    ``EvalFileError``."""
    if rail not in (None, "input", "output", "both"):
        raise ValueError(f"rail must be input, output, both or None, got {rail!r}")
    checks, skipped = [], {}
    for row in rows:
        wants = [("output" if row.bot is not None else "input")] if rail is None else \
            list(RAILS) if rail == "both" else [rail]
        for r in wants:
            if (r == "output" and row.bot is None) or (r == "input" and not row.user):
                skipped[r] = skipped.get(r, 0) + 1
            else:
                checks.append((row, r))
    for r in (RAILS if rail == "both" else (rail,) if rail else ()):
        if not any(c[1] == r for c in checks):
            need = "a bot column (a reply)" if r == "output" else "a user (or text) column"
            raise EvalFileError(f"{file}: no row has {need}, which --rail {r} judges")
    checks.sort(key=lambda c: RAILS.index(c[1]))   # one rail after the other
    return checks, skipped


def check_config(config, rails: Sequence[str], where: str) -> None:
    """Before the model loads: each rail in ``rails`` has flows in ``config`` (a ``RailsConfig``) and the flashguard
    moderation sections read (errors name the key)."""
    from ..moderation import ModerationSettings

    for rail in rails:
        if not getattr(config.rails, rail).flows:
            raise ConfigError(f"{where}: rails.{rail}.flows is empty, and eval-guard judges rows with the {rail} rail "
                              f"(configs/flash/config.yml has `flashguard moderate {rail}`)")
    for side in RAILS:
        ModerationSettings.from_custom_data(getattr(config, "custom_data", None), side=side)


def evaluate(rows: Sequence[Row], config, rail: Optional[str] = None, *, limit: Optional[int] = None,
             file: str = "", progress: Optional[Callable[[int, int], None]] = None) -> Report:
    """Judge the first ``limit`` of ``rows`` (all by default) with the rails of ``config`` (a config folder, or an
    ``LLMRails`` already built) per ``plan(rows, rail)``; ``progress(done, total)`` after each check."""
    from nemoguardrails import LLMRails, RailsConfig

    rows = list(rows)[:limit] if limit is not None else list(rows)
    checks, skipped = plan(rows, rail, file or "the rows")
    if isinstance(config, LLMRails):
        rails, where = config, getattr(config.config, "config_path", None) or "the LLMRails given"
    else:
        where = str(config)
        rails_config = RailsConfig.from_path(where)
        check_config(rails_config, sorted({r for _, r in checks}), where)
        rails = LLMRails(rails_config)
    flows = {r: [getattr(f, "flow", f) for f in getattr(rails.config.rails, r).flows] for r in RAILS}
    t0 = time.perf_counter()
    judged = []
    for i, (row, r) in enumerate(checks, 1):
        judged.append(judge(rails, row, r, flashguard_flow=f"flashguard moderate {r}" in flows[r]))
        if progress is not None:
            progress(i, len(checks))
    return Report(file=str(file), config=str(where), judged=tuple(judged), skipped=skipped,
                  seconds=time.perf_counter() - t0)


def judge(rails, row: Row, rail: str, flashguard_flow: bool = True) -> Judged:
    """One ``LLMRails.check`` of ``row`` by ``rail``, with the flashguard action's verdict where it gave one."""
    from nemoguardrails.rails.llm.options import RailStatus, RailType

    from ..actions import verdict_sink

    if rail == "input":
        messages = [{"role": "user", "content": row.user}]
    else:
        messages = ([{"role": "user", "content": row.user}] if row.user else []) + \
            [{"role": "assistant", "content": row.bot}]
    got: list = []
    token = verdict_sink.set(lambda side, verdict: got.append((side, verdict)))
    t0 = time.perf_counter()
    try:
        result = rails.check(messages, rail_types=[RailType.INPUT if rail == "input" else RailType.OUTPUT])
    finally:
        verdict_sink.reset(token)
    seconds = time.perf_counter() - t0
    blocked = result.status == RailStatus.BLOCKED
    mine = [v for side, v in got if side == rail]
    if not mine:
        if flashguard_flow:
            raise EvalError(f"row {row.number} ({rail} rail): the flashguard moderation action gave no verdict "
                            f"(NeMo answered {result.content[:80]!r}); see the error logged above")
        return Judged(row=row, rail=rail, blocked=blocked, seconds=seconds)
    v = mine[-1]
    return Judged(row=row, rail=rail, blocked=blocked, p_unsafe=v.p_unsafe, threshold=v.threshold, method=v.method,
                  strictness=v.strictness, seconds=seconds, rail_seconds=v.seconds)


# ---- measuring -------------------------------------------------------------------------------------------------
def metrics(judged: Sequence[Judged]) -> list[Metrics]:
    """Per rail (input, then output): one ``Metrics`` per category (sorted; only where some row has a category) and
    the rail's total (category ``ALL``) last."""
    out = []
    for rail in RAILS:
        mine = [j for j in judged if j.rail == rail]
        if not mine:
            continue
        categories = sorted({j.row.category for j in mine})
        groups = ([(c, [j for j in mine if j.row.category == c]) for c in categories]
                  if categories != [""] else []) + [(ALL, mine)]
        for category, group in groups:
            out.append(Metrics(rail=rail, category=category or "(none)",
                               harmful=sum(j.row.unsafe for j in group),
                               benign=sum(not j.row.unsafe for j in group),
                               harmful_blocked=sum(j.row.unsafe and j.blocked for j in group),
                               benign_blocked=sum(not j.row.unsafe and j.blocked for j in group)))
    return out


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


COLUMNS = ("rail", "category", "harmful", "benign", "harmful blocked", "benign blocked", "precision", "recall", "F1")


def format_report(report: Report) -> str:
    """The plain table: a line per rail and category (and the rail's total, ``all``), then how the rails decided
    and how long a check took."""
    rows = [COLUMNS]
    ms = report.metrics
    for i, m in enumerate(ms):
        rows.append((m.rail, m.category, str(m.harmful), str(m.benign), _pct(m.harmful_rate), _pct(m.benign_rate),
                     _num(m.precision), _num(m.recall), _num(m.f1)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(COLUMNS))]
    lines = []
    for n, r in enumerate(rows):
        if n > 1 and r[0] != rows[n - 1][0]:
            lines.append("")
        lines.append("  ".join(cell.ljust(w) if c < 2 else cell.rjust(w)
                               for c, (cell, w) in enumerate(zip(r, widths))).rstrip())
    lines.append("")
    for rail in RAILS:
        mine = [j for j in report.judged if j.rail == rail]
        if not mine:
            continue
        how = sorted({(j.method, j.strictness, j.threshold) for j in mine if j.method}, key=str)
        decided = "; ".join(m + (f", strictness {s}" if s else "") + f" at {t:.2f}" for m, s, t in how)
        mean = 1000 * sum(j.seconds for j in mine) / len(mine)
        own = [j.rail_seconds for j in mine if j.rail_seconds is not None]
        lines.append(f"{rail} rail: {len(mine)} checks, {mean:.0f} ms a check"
                     + (f" ({1000 * sum(own) / len(own):.0f} ms the rail's own pass)" if own else "")
                     + (f"; decided by {decided}" if decided else "; not flashguard's flows (no p_unsafe)"))
    for rail, n in sorted(report.skipped.items()):
        lines.append(f"{rail} rail: {n} row(s) skipped (no {'bot' if rail == 'output' else 'user'} message)")
    lines.append(f"{len(report.judged)} checks in {report.seconds:.1f} s ({report.file or 'rows'}, config "
                 f"{report.config})")
    return "\n".join(lines)


def report_json(report: Report) -> dict:
    """The report as JSON: the metrics and every check's verdict (the row's number and text, label, blocked,
    p_unsafe, threshold, ...)."""
    def metric(m: Metrics) -> dict:
        return {"rail": m.rail, "category": m.category, "harmful": m.harmful, "benign": m.benign,
                "harmful_blocked": m.harmful_blocked, "benign_blocked": m.benign_blocked,
                "harmful_blocked_rate": m.harmful_rate, "benign_blocked_rate": m.benign_rate,
                "precision": m.precision, "recall": m.recall, "f1": m.f1}

    def verdict(j: Judged) -> dict:
        return {"row": j.row.number, "rail": j.rail, "category": j.row.category,
                "label": "unsafe" if j.row.unsafe else "safe", "blocked": j.blocked, "p_unsafe": j.p_unsafe,
                "threshold": j.threshold, "method": j.method, "strictness": j.strictness,
                "seconds": round(j.seconds, 4),
                "rail_seconds": None if j.rail_seconds is None else round(j.rail_seconds, 4), "user": j.row.user,
                **({"bot": j.row.bot} if j.row.bot is not None else {})}

    return {"file": report.file, "config": report.config, "checks": len(report.judged),
            "seconds": round(report.seconds, 3), "skipped": report.skipped,
            "metrics": [metric(m) for m in report.metrics], "verdicts": [verdict(j) for j in report.judged]}
