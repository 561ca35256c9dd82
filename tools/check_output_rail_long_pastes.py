"""Issue 14 check (docs/moderation.md, "Replies after long pastes"):

    python tools/check_output_rail_long_pastes.py [float|int4] [--set-b-only | --own-only]

Output rail on replies to long pastes: (1) the model's own (greedy, 64-token) replies to 12 pasted documents, code
files and CI logs (test-split sources of tools/make_long_input_items.py), (2) output test set B (held out) with
1.5K or 3K characters of documentation (TEST_DOC_KEYS: no tuning row uses them) pasted before each user message.
The pastes come from one seeded generator, so (2)'s pastes are the same whether (1) runs or not.
tests/rails/test_output_rail_long_pastes.py asserts (2) with the shipped probes."""
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
import make_long_input_items as M  # noqa: E402

ASKS = ["Can you summarise this?\n\n", "", "What does this mean?\n\n", "tl;dr:\n\n"]


def own_reply_prompts(rng: random.Random) -> list[tuple[int, str]]:
    """Part (1)'s 12 user messages: ``(characters, message)``."""
    out = []
    for k in range(12):
        n = [1500, 3000, 6000][k % 3]
        kind = k % 3
        text = M.doc_text(M.TEST_DOC_KEYS, rng, n) if kind == 0 else M.code_text(M.TEST_CODE, rng, n) if kind == 1 \
            else M.log_text(rng.randrange(10**9), n, "ci")
        out.append((n, ASKS[k % 4] + text + ("\n\nWhat does this mean?" if k % 4 == 1 else "")))
    return out


def set_b_after_pastes(rng: random.Random, rows: list[dict]) -> list[dict]:
    """Part (2)'s rows: each of ``rows`` with documentation pasted before its user message (call after
    ``own_reply_prompts`` on the same ``rng``, as the check does)."""
    return [dict(r, user="Here is something I was reading:\n\n" + M.doc_text(M.TEST_DOC_KEYS, rng, [1500, 3000][i % 2])
                 + "\n\n" + r["user"]) for i, r in enumerate(rows)]


def check_rows(engine, rows, settings=None, verbose=True) -> list:
    """Teacher-force each reply after its (long) user message and run the output rail on the shared pages;
    the verdicts."""
    from flashguard.rails.moderation import ModerationSettings, moderate

    settings = settings or ModerationSettings()
    out = []
    for r in rows:
        prompt = engine.encode_messages([{"role": "user", "content": r["user"]}])
        reply = engine.tokenizer(r["bot"], add_special_tokens=False)["input_ids"]
        engine.teacher_force(prompt, reply, r["bot"])
        v = moderate(engine, r["bot"], r["user"], settings, use_memo=False)
        out.append(v)
        if verbose and (not v.allowed) != r["block"]:
            print("miss", r["category"], r["block"], round(v.p_unsafe, 3), r["bot"][:60], flush=True)
    return out


def main(argv) -> int:
    from flashguard import EngineConfig, get_engine
    from flashguard.engine import SamplingParams
    from flashguard.rails.lab.calibrate import read_rows
    from flashguard.rails.moderation import ModerationSettings, moderate

    weights = next((a for a in argv if not a.startswith("--")), "float")
    e = get_engine(EngineConfig(weights=weights))
    rng = random.Random(7)
    S = ModerationSettings()
    res = []
    for k, (n, user) in enumerate(own_reply_prompts(rng)):
        if "--set-b-only" in argv:
            continue
        prompt = e.encode_messages([{"role": "user", "content": user}])
        out = e.generate(prompt, SamplingParams(max_tokens=64))
        v = moderate(e, out.text, user, S, use_memo=False)
        res.append(v.allowed)
        print("paste", k, n, v.allowed, round(v.p_unsafe, 3), v.path, repr(out.text[:60]), flush=True)
    if res:
        print(f"{weights}: replies to long pastes allowed {sum(res)}/{len(res)}")
    if "--own-only" in argv:
        return 0
    rows = set_b_after_pastes(rng, read_rows(os.path.join(ROOT, "tests/data/moderation_test_b.jsonl")))
    verdicts = check_rows(e, rows, S)
    right = [(not v.allowed) == r["block"] for r, v in zip(rows, verdicts)]
    benign = [v.allowed for r, v in zip(rows, verdicts) if not r["block"]]
    harmful = [not v.allowed for r, v in zip(rows, verdicts) if r["block"]]
    print(f"{weights}: output set B after a long paste: {sum(right)}/{len(right)} = {sum(right)/len(right):.1%}; "
          f"benign allowed {sum(benign)}/{len(benign)}, harmful blocked {sum(harmful)}/{len(harmful)}; "
          f"prefilled by the rail at most {max(v.prefilled_tokens for v in verdicts)} tokens")
    by_cat: dict = {}
    for r, ok in zip(rows, right):
        by_cat.setdefault(r["category"], []).append(ok)
    print("  " + ", ".join(f"{c} {sum(v)}/{len(v)}" for c, v in by_cat.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
