"""Issue 14 check (docs/moderation.md, Limits): python tools/check_output_rail_long_pastes.py [float|int4].
Output rail on replies to long pastes: (1) the model's own replies to pasted documents/code/logs (test-split
sources of tools/make_long_input_items.py), (2) output test set B with a long paste before each user message."""
import sys, json, random
import os; ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))); sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
import make_long_input_items as M
from flashguard import EngineConfig, get_engine
from flashguard.engine import SamplingParams
from flashguard.rails.calibrate import read_rows
from flashguard.rails.moderation import ModerationSettings, moderate
weights = sys.argv[1] if len(sys.argv) > 1 else "float"
e = get_engine(EngineConfig(weights=weights))
rng = random.Random(7)
S = ModerationSettings()
res = []
asks = ["Can you summarise this?\n\n", "", "What does this mean?\n\n", "tl;dr:\n\n"]
for k in range(12):
    n = [1500, 3000, 6000][k % 3]
    kind = k % 3
    text = M.doc_text(M.TEST_DOC_KEYS, rng, n) if kind == 0 else M.code_text(M.TEST_CODE, rng, n) if kind == 1 \
        else M.log_text(rng.randrange(10**9), n, "ci")
    user = asks[k % 4] + text + ("\n\nWhat does this mean?" if k % 4 == 1 else "")
    prompt = e.encode_messages([{"role": "user", "content": user}])
    out = e.generate(prompt, SamplingParams(max_tokens=64))
    v = moderate(e, out.text, user, S, use_memo=False)
    res.append(v.allowed)
    print("paste", k, n, v.allowed, round(v.p_unsafe, 3), v.path, repr(out.text[:60]), flush=True)
print(f"{weights}: replies to long pastes allowed {sum(res)}/{len(res)}")
rows = read_rows(os.path.join(ROOT, "tests/data/moderation_test_b.jsonl"))
right = []
for i, r in enumerate(rows):
    paste = M.doc_text(M.TEST_DOC_KEYS, rng, [1500, 3000][i % 2])
    user = "Here is something I was reading:\n\n" + paste + "\n\n" + r["user"]
    prompt = e.encode_messages([{"role": "user", "content": user}])
    reply = e.tokenizer(r["bot"], add_special_tokens=False)["input_ids"]
    e.teacher_force(prompt, reply, r["bot"])
    v = moderate(e, r["bot"], user, S, use_memo=False)
    right.append((not v.allowed) == r["block"])
    if not right[-1]: print("miss", r["category"], r["block"], round(v.p_unsafe, 3), r["bot"][:60], flush=True)
print(f"{weights}: output set B after a long paste: {sum(right)}/{len(right)} = {sum(right)/len(right):.1%}; "
      f"benign allowed {sum(ok for ok, r in zip(right, rows) if not r['block'])}/{sum(not r['block'] for r in rows)}")
