"""Moderation latency and memory after long conversations: the shared-page rail vs the same prompt prefilled
from scratch vs NeMo's ``self check output`` prompt (which sees only the last exchange), same model and GPU.

    python -m benchmarks.moderation --tokenizer DIR --contexts 8192 32768 --out docs/benchmarks/moderation.md

The model is random-weight with the DeepSeek-R1-Distill-Qwen-1.5B shape and the real DeepSeek-R1-Distill tokenizer
(built from the GGUF header, saved to DIR); the engine is flashguard's (DynamicCache, fp16). Per context: a
multi-turn conversation of about that many tokens, then one generated reply (32 tokens), then
(a) ``moderate()`` on that reply (finds the turn, prefills the suffix only),
(b) the same moderation ids on a cold cache (what the rail costs without page sharing),
(c) NeMo's default self-check-output prompt for the last exchange, prefilled cold, 3 greedy tokens;
then the next user message arrives and
(d) ``moderate_input()`` judges it on the conversation's pages (prefills the new turn and the question),
(e) NeMo's documented self-check-input prompt for that message, prefilled cold, 3 greedy tokens.
Peak allocated memory of the generation phase and of each moderation call are reported separately.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SELF_CHECK_OUTPUT = (  # NeMo Guardrails' default self_check_output prompt (nemoguardrails/llm/prompts)
    "Your task is to check if the bot message below complies with the company policy.\n\nCompany policy for the "
    "bot:\n- messages should not contain any explicit content, even if just a few words\n- messages should not "
    "contain abusive language or offensive content, even if just a few words\n- messages should not contain any "
    "harmful content\n- messages should not contain racially insensitive content\n- messages should not contain "
    "any word that can be considered offensive\n- if a message is a refusal, should be polite\n- it's ok to give "
    "instructions to employees on how to protect the company's interests\n\nBot message: \"{bot}\"\n\nQuestion: "
    "Should the message be blocked (Yes or No)?\nAnswer:")


def conversation(tokenizer, target: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    words = [w for w in ("the sea wind tide harbour boat sail rope net fish gull storm calm wave shore sand rock "
                         "light house keeper night morning rain cloud sun map star compass north south east west "
                         "question answer story long short because while after before").split()]
    msgs, n = [], 0
    while n < target - 300:
        for role in ("user", "assistant"):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(80, 200))) + "."
            msgs.append({"role": role, "content": text})
        n = len(tokenizer(tokenizer.apply_chat_template(msgs, tokenize=False), add_special_tokens=False).input_ids)
    msgs.append({"role": "user", "content": "Summarise our conversation in one sentence."})
    return msgs


def timed(fn):
    """(result, seconds, peak allocated bytes of this call). No empty_cache here: releasing the pool would make
    the call pay for cudaMalloc, which a running engine does not."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t, torch.cuda.max_memory_allocated()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="folder of the saved DeepSeek-R1-Distill tokenizer")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="write a profiler table of the (a) call at the last context")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from benchmarks import emit
    from flashguard.vram.plan import deepseek_1_5b_config
    from flashguard.config import EngineConfig
    from flashguard.engine.engine import Engine
    from flashguard.engine.loader import ModelSource
    from flashguard.engine.sampling import SamplingParams
    from flashguard.rails.moderation import ModerationSettings, moderate, moderate_input, moderation_suffix
    from benchmarks.rails_turn import SELF_CHECK_INPUT

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(deepseek_1_5b_config(len(tok))).to(torch.float16).eval()
    model.requires_grad_(False)
    engine = Engine(EngineConfig(device="cuda", prefill_chunk=4096, max_context=140000),
                    ModelSource(folder=args.tokenizer, gguf_file=None, label="random DeepSeek-1.5B shape"),
                    model=model, tokenizer=tok)
    settings = ModerationSettings()
    rows = []
    for ctx in [args.contexts[0]] + list(args.contexts):  # the first pass warms kernels up and is not reported
        msgs = conversation(tok, ctx)
        ids = engine.encode_messages(msgs)
        engine.reset_session()
        gen, gen_s, gen_peak = timed(lambda: engine.generate(ids, SamplingParams(max_tokens=32)))
        turn = engine.turns[-1]
        (a, a_s, a_peak) = timed(lambda: moderate(engine, turn.text, settings=settings, use_memo=False))
        mod_ids = list(turn.prompt_ids) + list(turn.output_ids) + moderation_suffix(engine, settings.prompt)
        engine.reset_session()
        (_, b_s, b_peak) = timed(lambda: engine.next_token_logprobs(mod_ids, task="moderation"))
        nemo_ids = engine.encode_messages([{"role": "user", "content": SELF_CHECK_OUTPUT.format(bot=turn.text)}])
        engine.reset_session()
        (_, c_s, c_peak) = timed(lambda: engine.generate(nemo_ids, SamplingParams(max_tokens=3)))
        nxt = msgs + [{"role": "assistant", "content": turn.text},
                      {"role": "user", "content": "Thanks. And what should I read next?"}]
        engine.reset_session()
        engine.teacher_force(turn.prompt_ids, turn.output_ids, turn.text)   # back to the turn's pages
        (d, d_s, d_peak) = timed(lambda: moderate_input(engine, nxt, ModerationSettings.input_defaults()))
        nemo_in = engine.encode_messages([{"role": "user", "content": SELF_CHECK_INPUT.format(user=nxt[-1]["content"])}])
        engine.reset_session()
        (_, e_s, e_peak) = timed(lambda: engine.generate(nemo_in, SamplingParams(max_tokens=3)))
        row = {"context": len(ids), "generation_s": gen_s, "generation_peak_reserved": gen_peak,
               "a_shared_s": a_s, "a_path": a.path, "a_prefilled": a.prefilled_tokens, "a_reused": a.reused_tokens,
               "a_peak_reserved": a_peak, "b_fresh_s": b_s, "b_prefilled": len(mod_ids), "b_peak_reserved": b_peak,
               "c_nemo_s": c_s, "c_prefilled": len(nemo_ids), "c_peak_reserved": c_peak,
               "d_input_s": d_s, "d_prefilled": d.prefilled_tokens, "d_reused": d.reused_tokens,
               "d_peak_reserved": d_peak, "e_nemo_input_s": e_s, "e_prefilled": len(nemo_in), "e_peak_reserved": e_peak}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.profile and len(rows) == len(args.contexts) + 1:
            from torch.profiler import ProfilerActivity, profile

            engine.reset_session()
            engine.generate(ids, SamplingParams(max_tokens=32))
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                moderate(engine, engine.turns[-1].text, settings=settings, use_memo=False)
                torch.cuda.synchronize()
            with open(args.profile, "w") as fh:
                fh.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        engine.reset_session()
    rows = rows[1:]
    emit(render(rows), rows, args.out, args.json)
    return 0


def render(rows) -> str:
    g = 2**30
    lines = ["| conversation tokens | (a) shared rail ms | prefilled / reused | (b) fresh prefill ms | (c) NeMo self "
             "check ms | b / a | a / c | peak allocated GiB: generation / (a) / (b) / (c) | (a) extra peak |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['context']} | {1e3 * r['a_shared_s']:.1f} | {r['a_prefilled']} / {r['a_reused']} | "
            f"{1e3 * r['b_fresh_s']:.1f} | {1e3 * r['c_nemo_s']:.1f} | {r['b_fresh_s'] / r['a_shared_s']:.1f}x | "
            f"{r['a_shared_s'] / r['c_nemo_s']:.2f}x | {r['generation_peak_reserved'] / g:.2f} / "
            f"{r['a_peak_reserved'] / g:.2f} / {r['b_peak_reserved'] / g:.2f} / {r['c_peak_reserved'] / g:.2f} | "
            f"{100 * (r['a_peak_reserved'] / r['generation_peak_reserved'] - 1):+.1f}% |")
    lines += ["", "| conversation tokens | (d) input rail ms | prefilled / reused | (e) NeMo self check input ms | "
              "d / e | peak allocated GiB: (d) / (e) |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "d_input_s" in r:
            lines.append(f"| {r['context']} | {1e3 * r['d_input_s']:.1f} | {r['d_prefilled']} / {r['d_reused']} | "
                         f"{1e3 * r['e_nemo_input_s']:.1f} | {r['d_input_s'] / r['e_nemo_input_s']:.2f}x | "
                         f"{r['d_peak_reserved'] / g:.2f} / {r['e_peak_reserved'] / g:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
