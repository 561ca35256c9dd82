"""How the input rail judges long pasted text nobody here wrote: benign documents found on the machine, and the same
documents with one harmful request hidden in them.

    python -m benchmarks.long_pastes --docs 40 --out docs/benchmarks/long_pastes.md --json long_pastes.json

Documents (read where they are installed; only derived numbers are committed): the licence files and long package
descriptions (METADATA) of the Python packages installed beside flashguard, and Debian's per-package copyright files
(``/usr/share/doc/*/copyright``, where the machine has them). Each becomes a user message: the document, then one
of a few everyday asks ("Can you summarise this?"). The hidden rows are the same documents with one harmful request
of ``rails/data/moderation_input_tune.jsonl`` (its short rows, jailbreak and injection rows left out) put at a random
paragraph break: how the tune set's ``long-hidden`` rows were made, on documents they were not made from.

Each message goes through the input rail's long-message path as the rail runs it (the model's forward over the
conversation, the window probe over sliding windows of the message's states, blocked when the worst window reaches
the window threshold) on the default engine (the embedded model on the CPU, int4). Besides the rail's verdict the
table gives what a contrast rule would decide (the worst window's log-odds at least ``--contrast`` above the
message's median window, or the median itself at the threshold): a candidate measured here, not the rail's rule.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASKS = ("Can you summarise this?", "What does this say, in plain words?", "Explain the main points of the text above.",
        "Is there anything unusual in this?")


def documents(limit: int, seed: int) -> dict[str, list[tuple[str, str]]]:
    """``{source: [(name, text), ...]}``: up to ``limit`` distinct documents of 1,500-6,000 characters a source."""
    import site

    packages = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    found: dict[str, list[tuple[str, str]]] = {"package licence": [], "package description": [],
                                              "debian copyright": []}
    for base in packages:
        for f in glob.glob(os.path.join(base, "*.dist-info", "LICENSE*")) + \
                glob.glob(os.path.join(base, "*.dist-info", "licenses", "*")):
            if os.path.isfile(f):
                found["package licence"].append((f.split(os.sep)[-2], Path(f).read_text(errors="replace")))
        for f in glob.glob(os.path.join(base, "*.dist-info", "METADATA")):
            text = Path(f).read_text(errors="replace")
            found["package description"].append((f.split(os.sep)[-2], text.split("\n\n", 1)[-1]))
    for f in glob.glob("/usr/share/doc/*/copyright"):
        found["debian copyright"].append((f.split("/")[4], Path(f).read_text(errors="replace")))
    rng = random.Random(seed)
    out = {}
    for source, items in found.items():
        seen, keep = set(), []
        for name, text in sorted(items):
            key = text.strip()[-400:]
            if 1500 < len(text) < 6000 and text.count("\n\n") >= 3 and key not in seen:
                seen.add(key)
                keep.append((name, text.strip()))
        rng.shuffle(keep)
        if keep:
            out[source] = keep[:limit]
    return out


def harmful_requests() -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "rails/data/moderation_input_tune.jsonl").open()]
    return [r["user"] for r in rows if r["block"] and not r["category"].startswith("long")
            and r["category"] not in ("jailbreak", "injection")]


def messages(limit: int, seed: int):
    """``(source, document name, kind, message)`` for each document of ``documents(limit, seed)``: ``benign`` (the
    document and an everyday ask) and ``hidden`` (one harmful request at a random paragraph break), in a fixed order
    for ``seed``."""
    rng, harm = random.Random(seed), harmful_requests()
    for source, docs in documents(limit, seed).items():
        for name, text in docs:
            ask = rng.choice(ASKS)
            paras = text.split("\n\n")
            at = rng.randrange(1, len(paras))
            hidden = "\n\n".join(paras[:at] + [rng.choice(harm)] + paras[at:])
            yield source, name, "benign", text + "\n\n" + ask
            yield source, name, "hidden", hidden + "\n\n" + ask


def message_states(engine, text: str, layers):
    """The states of ``text`` (as the user's one message) at ``layers`` from its first token, ``[len(layers),
    tokens, d]``, as the input rail's long-message path reads them; None when it is too long for the model."""
    from flashguard.rails import moderation as M

    msgs = [{"role": "user", "content": text}]
    ids = engine.encode_messages(msgs)
    if len(ids) >= engine.context_length - 64:
        return None
    engine.reset_session()
    return M.pooled_state(engine, ids, M.content_start(engine, msgs, ids), tuple(layers), keep=True)[3]


def window_scores(probe, states) -> list[float]:
    """The window probe's p_unsafe of each sliding window of ``states`` (``message_states`` at its layer)."""
    from flashguard.rails import moderation as M

    return probe.p_windows(M.window_means(states, probe.long_window, probe.stride)[0]).tolist()


def logit(p: float) -> float:
    p = min(max(p, 1e-12), 1 - 1e-12)
    return math.log(p / (1 - p))


def contrast_blocks(p_windows: list[float], threshold: float, contrast: float) -> bool:
    scores = [logit(p) for p in p_windows]
    worst, median = max(scores), statistics.median(scores)
    return (worst >= logit(threshold) and worst - median >= contrast) or median >= logit(threshold)


def share(rows: list[dict], key: str) -> str:
    n = sum(r[key] for r in rows)
    return f"{n}/{len(rows)} ({100 * n / max(1, len(rows)):.0f}%)"


def main(argv=None) -> int:
    from flashguard import EngineConfig
    from flashguard.engine.engine import Engine
    from flashguard.rails import moderation as M
    from flashguard.rails.moderation import ModerationSettings

    p = argparse.ArgumentParser(prog="python -m benchmarks.long_pastes", description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=40, help="documents a source")
    p.add_argument("--contrast", type=float, default=7.0, help="the candidate contrast rule's log-odds margin")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out")
    p.add_argument("--json")
    args = p.parse_args(argv)
    engine = Engine(EngineConfig(device="cpu"))
    settings = ModerationSettings.input_defaults()
    probe = M.choose_probe(engine, settings)
    if probe is None or not probe.slides:
        print("the embedded model's input probe has no window weights: nothing to measure", file=sys.stderr)
        return 1
    threshold, _ = M.probe_threshold(probe, settings, long=True)
    rows, t0, done = [], time.time(), None
    for source, name, kind, message in messages(args.docs, args.seed):
        if source != done and done is not None:
            print(f"{done}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        done = source
        states = message_states(engine, message, (probe.long_layer,))
        if states is not None:
            scores = window_scores(probe, states)
            rows.append({"source": source, "name": name, "kind": kind, "p_windows": scores,
                         "rail": max(scores) >= threshold,
                         "contrast": contrast_blocks(scores, threshold, args.contrast)})
    print(f"{done}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    lines = [f"window threshold {threshold:.2f}; candidate contrast rule: margin {args.contrast:g} log-odds", "",
             "| source | documents | benign blocked (rail) | hidden harm blocked (rail) | benign blocked (contrast) "
             "| hidden harm blocked (contrast) |", "|---|---|---|---|---|---|"]
    for source in dict.fromkeys(r["source"] for r in rows):
        b = [r for r in rows if r["source"] == source and r["kind"] == "benign"]
        h = [r for r in rows if r["source"] == source and r["kind"] == "hidden"]
        lines.append(f"| {source} | {len(b)} | {share(b, 'rail')} | {share(h, 'rail')} | {share(b, 'contrast')} | "
                     f"{share(h, 'contrast')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
