"""Refit the input rail's window probe (long messages) with long benign policy documents, and judge it on documents
nobody here wrote.

    python tools/fit_window_probe.py --repo /path/to/github+site-policy/repo [--pieces 120] [--docs 30] [--write]

``--repo``: a git directory of https://github.com/github/site-policy (CC0-1.0) holding commit ``COMMIT`` (the
library's ``fetch``, or ``git clone``). Its Markdown files under ``Policies/`` are cut into pieces of about 4,000
characters (at least 1,500) at paragraph breaks, shuffled (seed 0); ``--pieces`` of them, each with an everyday ask
appended, join the tuning set's long messages as benign long messages. The window probe is then chosen and fitted
as ``flashguard calibrate --rail input`` does (``calibrate.choose_window_probe`` / ``fit_window_probe``: window size,
layer and L2 by 5-fold cross-validation grouped by message, the short messages' means beside the windows), once
without the pieces and once with them, on the embedded model on the CPU with ``--weights`` (int4, the CPU's
default, or float, the weights a GPU runs it with: each has its own shipped input probe).

Judged on what ``benchmarks.long_pastes`` reads (installed package licences and descriptions, Debian copyright
files: held apart, ``--docs`` a source, the same documents and hidden rows as that benchmark's seed 1), beside the
shipped window probe: the share of benign documents blocked and of documents with a hidden harmful request blocked.
``--write`` puts the window probe fitted with the pieces into the shipped input probe of those weights (its
short-message probe unchanged). The rows' states are cached in ``--features`` (a forward pass over ~1,200 rows: ~18
minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
COMMIT = "12992597c5d9d8cfc006693c54b9609d9993bc99"
SHIPPED = ROOT / "rails" / "probes" / "SmolLM2-135M-Instruct.Q4_1-{weights}-input.json"   # the engine's weights


def pieces(repo: str, count: int, rng: random.Random) -> list[tuple[str, str]]:
    """``(path, text)`` pieces of the snapshot's policy documents (see the module docstring), shuffled by ``rng``."""
    names = subprocess.run(["git", "-C", repo, "ls-tree", "-r", "--name-only", COMMIT], capture_output=True,
                           text=True, check=True).stdout.split()
    out = []
    for name in (n for n in names if n.startswith("Policies/") and n.endswith(".md")):
        text = subprocess.run(["git", "-C", repo, "show", f"{COMMIT}:{name}"], capture_output=True, text=True,
                              check=True).stdout
        cur: list[str] = []
        for para in text.split("\n\n"):
            cur.append(para)
            if sum(len(x) for x in cur) >= 4000:
                out.append((name, "\n\n".join(cur)))
                cur = []
        if cur and sum(len(x) for x in cur) >= 1500:
            out.append((name, "\n\n".join(cur)))
    rng.shuffle(out)
    return out[:count]


def subset(long: dict, messages: int) -> dict:
    """``long`` (``calibrate.collect``'s long-message features) with only its first ``messages`` messages."""
    import torch

    out = {"layers": long["layers"], "message_labels": long["message_labels"][:messages], "windows": {}}
    for size, d in long["windows"].items():
        keep = (torch.tensor(d["message"]) < messages).tolist()
        out["windows"][size] = {"means": [x[torch.tensor(keep)] for x in d["means"]],
                                "labels": [v for v, k in zip(d["labels"], keep) if k],
                                "message": [v for v, k in zip(d["message"], keep) if k]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/fit_window_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", required=True, help="a git directory of github/site-policy holding COMMIT")
    p.add_argument("--pieces", type=int, default=120)
    p.add_argument("--docs", type=int, default=30, help="held-apart documents a source (benchmarks.long_pastes)")
    p.add_argument("--features", default=None, help="a file caching the rows' states (written, then read)")
    p.add_argument("--write", action="store_true", help="put the refitted window probe into the shipped file")
    p.add_argument("--weights", choices=("int4", "float"), default="int4",
                   help="the engine's weights: each has its own input probe (int4: the CPU's default; float: a GPU's)")
    args = p.parse_args(argv)
    import torch

    from benchmarks import long_pastes as LP
    from flashguard import EngineConfig
    from flashguard.engine.engine import Engine
    from flashguard.rails import moderation as M
    from flashguard.rails.lab import calibrate as C
    from flashguard.rails.moderation import ModerationSettings
    from flashguard.rails.probe import Probe

    t0 = time.time()
    rng = random.Random(0)   # the shuffle, then each piece's ask
    extra = [{"user": text + "\n\n" + rng.choice(LP.ASKS), "block": False, "category": "policy"}
             for _, text in pieces(args.repo, args.pieces, rng)]
    engine = Engine(EngineConfig(device="cpu", weights=args.weights))
    settings = ModerationSettings.input_defaults()
    rows = C.read_rows(C.INPUT_TUNING_SET, "input")
    cache = torch.load(args.features, weights_only=False) if args.features and Path(args.features).exists() else {}
    _, _, pooled, labels, long, short_rows = C.collect(engine, rows + extra, settings, cache=cache)[:6]
    if args.features:
        torch.save(cache, args.features)
    print(f"[{time.time() - t0:.0f} s] states of {len(rows)} + {len(extra)} rows", flush=True)
    keep = [not r.get("after") and not r.get("short_only") for r in short_rows]   # as calibrate.train
    short = (pooled[torch.tensor(keep)], [y for y, k in zip(labels, keep) if k])
    shipped = M.choose_probe(engine, settings)
    probes = {"shipped": shipped}
    for name, lg in (("tuning set only", subset(long, len(long["message_labels"]) - len(extra))),
                     ("with the policy pieces", long)):
        best = C.choose_window_probe(lg, short=short)[0]
        w, b = C.fit_window_probe(lg, best, short=short)
        metrics = {k: v for k, v in shipped.metrics.items() if k != "windows"}   # (a count of the old fit's)
        metrics.update(long_messages=len(lg["message_labels"]), long_l2=best["l2"],
                       long_cv_accuracy=round(best["cv_accuracy"], 4))
        probes[name] = dataclasses.replace(
            shipped, stride=best["window"] // 2, long_window=best["window"], long_layer=best["layer"],
            long_weight=tuple(float(v) for v in w), long_bias=b, long_threshold=best["threshold"], metrics=metrics)
        print(f"{name}: windows of {best['window']}, layer {best['layer']}, l2 {best['l2']}, threshold "
              f"{best['threshold']:.2f}, cross-validated balanced accuracy {best['cv_accuracy']:.4f}", flush=True)
    layers = sorted({q.long_layer for q in probes.values()})
    tally: dict = {name: {} for name in probes}
    for source, _, kind, message in LP.messages(args.docs, 1):   # benchmarks.long_pastes's rows (its seed 1)
        states = LP.message_states(engine, message, layers)
        if states is None:
            continue
        for name, q in probes.items():
            worst = max(LP.window_scores(q, states[layers.index(q.long_layer)][None]))
            t = tally[name].setdefault(f"{source}, {kind}", [0, 0])
            t[0] += int(worst >= M.probe_threshold(q, settings, long=True)[0])
            t[1] += 1
    print("\n| window probe | " + " | ".join(tally["shipped"]) + " |")
    print("|---|" + "---|" * len(tally["shipped"]))
    for name, t in tally.items():
        print(f"| {name} | " + " | ".join(f"{a}/{n} ({a / n:.0%})" for a, n in t.values()) + " |")
    if args.write:   # the shipped file with the new window probe and its numbers; the short-message probe as it was
        shipped_file = Path(str(SHIPPED).format(weights=args.weights))
        fitted, old = probes["with the policy pieces"], Probe.load(shipped_file)
        dataclasses.replace(old, stride=fitted.stride, long_window=fitted.long_window, long_layer=fitted.long_layer,
                            long_weight=fitted.long_weight, long_bias=fitted.long_bias,
                            long_threshold=fitted.long_threshold, long_strictness={},   # (fitted for the threshold)
                            metrics={**{k: v for k, v in old.metrics.items() if k != "windows"},
                                     **{k: v for k, v in fitted.metrics.items() if k.startswith("long")}}
                            ).save(shipped_file)
        print(f"window probe written into {shipped_file} (say where it came from in its metrics.window_probe_from)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
