"""The rails on plain requests and on another author's replies: checks kept apart from the tuning data.

    python tools/check_plain_requests.py [float|int4] [--probe FILE] [--input | --both] [--set FILE]

Default (the output rail): (1) the 40 replies of ``tests/data/moderation_set_other_author.jsonl``, teacher-forced
after their user message, judged on the shared pages; (2) each request of ``tests/data/moderation_input_plain.jsonl``
(24 blunt harmful requests, 24 benign look-alikes) answered by the model itself (greedy, 64 tokens) and that reply
judged. ``--probe FILE``: an output probe file to use instead of the shipped one (a candidate from ``flashguard
calibrate --out``; with ``--input``, an input probe). ``--input``: the input rail on the plain requests instead.
``--both``: the guarded turn as a user meets it: the input rail on the request; if it allows it, the model's reply
(greedy, 64 tokens) and the output rail on that reply (``--probe``: an output probe). Prints each harmful request
whose reply got past both rails (with the reply: read it, a refusal written by the model is harmless), each benign
one that a rail blocked, and the counts. ``--set FILE``: another set of plain requests
(``tests/data/moderation_input_plain_c.jsonl``: 48 more, written before the v7 input probes' last fit; ``_plain_b``:
written before their first, seen by the second). Prints the misses and the counts.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv) -> int:
    from flashguard import EngineConfig, get_engine
    from flashguard.engine import SamplingParams
    from flashguard.rails import probe as probe_mod
    from flashguard.rails.lab.calibrate import read_rows
    from flashguard.rails.moderation import ModerationSettings, moderate, moderate_input
    from flashguard.rails.state import rail_state

    parser = argparse.ArgumentParser(prog="check_plain_requests.py", description=__doc__.split("\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("weights", nargs="?", choices=("float", "int4"), default="float")
    parser.add_argument("--probe", type=Path,
                        help="a candidate probe file (the output rail's; with --input, the input rail's)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--input", action="store_true", help="the input rail on the plain requests")
    mode.add_argument("--both", action="store_true", help="the guarded turn: input rail, reply, output rail")
    parser.add_argument("--set", type=Path, default=ROOT / "tests/data/moderation_input_plain.jsonl",
                        help="a JSONL set of plain requests (user, block, category)")
    args = parser.parse_args(argv)
    if not args.set.is_file():
        parser.error(f"--set {args.set}: no such file")
    if args.probe is not None and not args.probe.is_file():
        parser.error(f"--probe {args.probe}: no such file")
    weights, rail, cand, plain_set = args.weights, "input" if args.input else "output", args.probe, args.set
    plain = read_rows(plain_set, "input")   # before the model loads (an error names the file and line)
    if cand is not None:
        probe_mod.user_probe_path = lambda key, side="output": cand if side == rail else Path("/nonexistent.json")
    e = get_engine(EngineConfig(weights=weights))
    rail_state(e).forget_probes()
    if cand is not None:   # a wrong-rail or wrong-model candidate would silently give the shipped probe's numbers
        s = ModerationSettings.input_defaults() if rail == "input" else ModerationSettings()
        found, where = probe_mod.find_probe(e, s.prompt, rail)
        if found is None or Path(where) != cand:
            raise SystemExit(f"--probe {cand}: not used ({where}); give a probe file of this rail, model and weights")

    def reply_to(user: str) -> str:
        """The model's own greedy 64-token reply to ``user`` alone."""
        return e.generate(e.encode_messages([{"role": "user", "content": user}]),
                          SamplingParams(max_tokens=64, temperature=0.0)).text

    if rail == "input":
        s, right, per = ModerationSettings.input_defaults(), 0, collections.defaultdict(lambda: [0, 0])
        for r in plain:
            v = moderate_input(e, [{"role": "user", "content": r["user"]}], s)
            ok = (not v.allowed) == r["block"]
            right += ok
            per[r["category"]][0] += ok
            per[r["category"]][1] += 1
            if not ok:
                print(f"  miss (p_unsafe {v.p_unsafe:.2f}): {r['user']}", flush=True)
        print(f"{weights} input rail, {plain_set.name}: {right}/{len(plain)} = {right / len(plain):.1%}; "
              + ", ".join(f"{k} {a}/{b}" for k, (a, b) in per.items()))
        return 0
    if args.both:
        s_in, s_out, outcome = ModerationSettings.input_defaults(), ModerationSettings(), collections.Counter()
        for r in plain:
            v = moderate_input(e, [{"role": "user", "content": r["user"]}], s_in)
            if not v.allowed:
                outcome[r["block"], "input"] += 1
                if not r["block"]:
                    print(f"  benign request blocked by the input rail ({v.p_unsafe:.2f}): {r['user']!r}", flush=True)
                continue
            reply = reply_to(r["user"])
            w = moderate(e, reply, r["user"], s_out)
            outcome[r["block"], "output" if not w.allowed else "through"] += 1
            if r["block"] and w.allowed:
                print(f"  harmful request's reply let through (in {v.p_unsafe:.2f}, out {w.p_unsafe:.2f}): "
                      f"{r['user']!r} -> {reply[:90]!r}", flush=True)
            elif not r["block"] and not w.allowed:
                print(f"  benign reply blocked by the output rail ({w.p_unsafe:.2f}): {r['user']!r} -> "
                      f"{reply[:70]!r}", flush=True)
        for block in (True, False):
            kind = "harmful" if block else "benign"
            print(f"{weights} both rails, {plain_set.name}, {kind} requests: blocked by the input rail "
                  f"{outcome[block, 'input']}, by the output rail {outcome[block, 'output']}, reply let through "
                  f"{outcome[block, 'through']}")
        return 0
    from check_output_rail_long_pastes import check_rows   # (this folder: teacher-force each reply, then the rail)

    s = ModerationSettings()
    other = read_rows(ROOT / "tests/data/moderation_set_other_author.jsonl")
    right = sum((not v.allowed) == r["block"] for r, v in zip(other, check_rows(e, other, s)))
    print(f"{weights} output rail, another author's replies: {right}/{len(other)}", flush=True)
    caught = benign_blocked = 0
    for r in plain:
        reply = reply_to(r["user"])
        v = moderate(e, reply, r["user"], s)
        if r["block"]:
            caught += not v.allowed
            if v.allowed:
                print(f"  harmful reply allowed (p_unsafe {v.p_unsafe:.2f}): {r['user']!r} -> {reply[:70]!r}",
                      flush=True)
        elif not v.allowed:
            benign_blocked += 1
            print(f"  benign reply blocked (p_unsafe {v.p_unsafe:.2f}): {r['user']!r} -> {reply[:70]!r}", flush=True)
    n = sum(r["block"] for r in plain)
    print(f"{weights} output rail, the model's own replies to {plain_set.name}: harmful blocked {caught}/{n}, benign "
          f"blocked {benign_blocked}/{len(plain) - n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
