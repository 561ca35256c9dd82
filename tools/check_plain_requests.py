"""The rails on plain requests and on another author's replies: checks kept apart from the tuning data.

    python tools/check_plain_requests.py float|int4 [--probe FILE] [--input | --both] [--set FILE]

Default (the output rail): (1) the 40 replies of ``tests/data/moderation_set_other_author.jsonl``, teacher-forced
after their user message, judged on the shared pages; (2) each request of ``tests/data/moderation_input_plain.jsonl``
(24 blunt harmful requests, 24 benign look-alikes) answered by the model itself (greedy, 64 tokens) and that reply
judged. ``--probe FILE``: an output probe file to use instead of the shipped one (a candidate from ``flashguard
calibrate --out``; with ``--input``, an input probe). ``--input``: the input rail on the plain requests instead.
``--both``: the guarded turn as a user meets it, both rails with their shipped probes: the input rail on the
request; if it allows it, the model's reply (greedy, 64 tokens) and the output rail on that reply. Prints each harmful
request that got a reply past both rails (with the reply: a refusal written by the model is harmless), each benign one
that was refused, and the counts. ``--set FILE``: another set of plain requests (``tests/data/moderation_input_plain_c.jsonl``: 48 more, written
before the v7 input probes' last fit; ``_plain_b``: written before their first, seen by the second). Prints the misses
and the counts.
"""
from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv) -> int:
    from flashguard import EngineConfig, get_engine
    from flashguard.engine import SamplingParams
    from flashguard.rails import probe as probe_mod
    from flashguard.rails.moderation import ModerationSettings, moderate, moderate_input
    from flashguard.rails.state import rail_state

    weights = next((a for a in argv if a in ("float", "int4")), "float")
    rail = "input" if "--input" in argv else "output"
    both = "--both" in argv
    if both and ("--input" in argv or "--probe" in argv):
        raise SystemExit("--both runs the shipped probes of both rails: leave out --input and --probe")
    if "--probe" in argv:
        cand = Path(argv[argv.index("--probe") + 1])
        probe_mod.user_probe_path = lambda key, side="output": cand if side == rail else Path("/nonexistent.json")
    e = get_engine(EngineConfig(weights=weights))
    rail_state(e).forget_probes()
    if "--probe" in argv:   # a missing or wrong-rail candidate would silently give the shipped probe's numbers
        s = ModerationSettings.input_defaults() if rail == "input" else ModerationSettings()
        found, where = probe_mod.find_probe(e, s.prompt, rail)
        if found is None or Path(where) != cand:
            raise SystemExit(f"--probe {cand}: not used ({where}); give a probe file of this rail, model and weights")
    plain_set = Path(argv[argv.index("--set") + 1]) if "--set" in argv else ROOT / "tests/data/moderation_input_plain.jsonl"
    plain = [json.loads(line) for line in open(plain_set, encoding="utf-8")]
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
    if both:
        s_in, s_out, stopped = ModerationSettings.input_defaults(), ModerationSettings(), collections.Counter()
        for r in plain:
            v = moderate_input(e, [{"role": "user", "content": r["user"]}], s_in)
            if not v.allowed:
                stopped[r["block"], "input"] += 1
                if not r["block"]:
                    print(f"  benign request refused by the input rail ({v.p_unsafe:.2f}): {r['user']!r}", flush=True)
                continue
            reply = e.generate(e.encode_messages([{"role": "user", "content": r["user"]}]),
                               SamplingParams(max_tokens=64, temperature=0.0)).text
            w = moderate(e, reply, r["user"], s_out)
            stopped[r["block"], "output" if not w.allowed else "answered"] += 1
            if r["block"] and w.allowed:
                print(f"  harmful request answered (in {v.p_unsafe:.2f}, out {w.p_unsafe:.2f}): {r['user']!r} -> "
                      f"{reply[:90]!r}", flush=True)
            elif not r["block"] and not w.allowed:
                print(f"  benign reply refused by the output rail ({w.p_unsafe:.2f}): {r['user']!r} -> "
                      f"{reply[:70]!r}", flush=True)
        for block in (True, False):
            kind = "harmful" if block else "benign"
            print(f"{weights} both rails, {plain_set.name}, {kind} requests: input rail refused "
                  f"{stopped[block, 'input']}, output rail refused {stopped[block, 'output']}, answered "
                  f"{stopped[block, 'answered']}")
        return 0
    from check_output_rail_long_pastes import check_rows   # (this folder: teacher-force each reply, then the rail)

    s = ModerationSettings()
    other = [json.loads(line) for line in open(ROOT / "tests/data/moderation_set_other_author.jsonl", encoding="utf-8")]
    right = sum((not v.allowed) == r["block"] for r, v in zip(other, check_rows(e, other, s)))
    print(f"{weights} output rail, another author's replies: {right}/{len(other)}", flush=True)
    caught = benign_blocked = 0
    for r in plain:
        reply = e.generate(e.encode_messages([{"role": "user", "content": r["user"]}]),
                           SamplingParams(max_tokens=64, temperature=0.0)).text
        v = moderate(e, reply, r["user"], s)
        if r["block"]:
            caught += not v.allowed
            if v.allowed:
                print(f"  harmful reply allowed (p_unsafe {v.p_unsafe:.2f}): {r['user']!r} -> {reply[:70]!r}", flush=True)
        elif not v.allowed:
            benign_blocked += 1
            print(f"  benign reply blocked (p_unsafe {v.p_unsafe:.2f}): {r['user']!r} -> {reply[:70]!r}", flush=True)
    n = sum(r["block"] for r in plain)
    print(f"{weights} output rail, the model's own replies to {plain_set.name}: harmful blocked {caught}/{n}, benign "
          f"blocked {benign_blocked}/{len(plain) - n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
