"""Replies that end: everyday prompts through the real engine under given sampling settings.

    python -m benchmarks.replies [--config configs/flash] [--setting NAME[=key=value,...] ...] [--json FILE]
                                 [--max-tokens 256] [--limit N] [--no-rails]
    python -m benchmarks.replies --pairs FILE A B [--out FILE.md]   the replies of settings A and B side by side

Each prompt of benchmarks/data/everyday_prompts.jsonl (40 written for this benchmark: recipes, tips, explanations,
short facts, emails, code questions, lists, one-word answers, ...) goes as one user message through ``LLMRails`` on
``--config`` (configs/flash: the embedded model as ``flashguard generate`` runs it, its rails included), once per
setting. A setting is NeMo's ``llm_params`` for the call (the keys ``SamplingParams.from_config`` takes:
temperature, top_p, seed, repetition_penalty, frequency_penalty, presence_penalty, no_repeat_ngram); a bare NAME
with no values is the config's own defaults. ``--no-rails`` calls the provider (the same generation call LLMRails
makes) without the two rails' checks: a quicker sweep, the same replies.

Per setting, the table gives:

- **cap**: the share of replies that hit ``max_tokens`` (finish_reason "length");
- **cap + loop**: the share that hit it *and* repeat themselves: some 4-gram of the reply's tokens occurs 3 or more
  times in it (tokens: the model's tokenizer over the reply's text);
- **loop**: the share with such a 4-gram, cut or not;
- mean reply length in tokens, replies blocked by a rail, seconds a reply.

Every reply is written to ``--json`` (default benchmarks/out/replies.json) so settings can be read side by side
(``--pairs``). Quality is not measured here: read the pairs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from tests.reply_loops import NGRAM, TIMES, repeated_ngram

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "benchmarks" / "data" / "everyday_prompts.jsonl"

# The settings measured for docs/benchmarks/replies.md: explicit values (so a run after the defaults change still
# measures the same thing), and "default" (the config's own).
NEUTRAL = {"temperature": 0.0, "top_p": 1.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
           "presence_penalty": 0.0, "no_repeat_ngram": 0}
SETTINGS = {
    "greedy": {},
    "rep1.05": {"repetition_penalty": 1.05},
    "rep1.1": {"repetition_penalty": 1.1},
    "rep1.15": {"repetition_penalty": 1.15},
    "rep1.2": {"repetition_penalty": 1.2},
    "rep1.3": {"repetition_penalty": 1.3},
    "freq0.3": {"frequency_penalty": 0.3},
    "freq0.5": {"frequency_penalty": 0.5},
    "pres0.5": {"presence_penalty": 0.5},
    "ngram4": {"no_repeat_ngram": 4},
    "rep1.1+ngram6": {"repetition_penalty": 1.1, "no_repeat_ngram": 6},
    "rep1.1+ngram8": {"repetition_penalty": 1.1, "no_repeat_ngram": 8},
    "card": {"temperature": 0.2, "top_p": 0.9, "seed": 0},   # SmolLM2-Instruct's model card
    "card+rep1.1": {"temperature": 0.2, "top_p": 0.9, "seed": 0, "repetition_penalty": 1.1},
}
KEYS = ("temperature", "top_p", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty",
        "no_repeat_ngram")


def parse_setting(text: str) -> tuple[str, dict | None]:
    """``NAME`` (a named setting, or the config's defaults when unknown) or ``NAME=key=value,key=value``."""
    name, _, rest = text.partition("=")
    if not rest:
        return name, ({**NEUTRAL, **SETTINGS[name]} if name in SETTINGS else None)
    params = dict(NEUTRAL)
    for item in rest.split(","):
        key, _, value = item.partition("=")
        if key not in KEYS:
            raise SystemExit(f"--setting {text!r}: unknown key {key!r}; known: {', '.join(KEYS)}")
        params[key] = int(value) if key in ("seed", "no_repeat_ngram") else float(value)
    return name, params


def read_prompts(path: Path, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:limit]


def run_setting(rails, model, params: dict | None, prompts: list[dict], max_tokens: int, use_rails: bool,
                tokenizer) -> list[dict]:
    from flashguard.guardrails.server import usage_scope

    llm_params = {"max_tokens": max_tokens, **(params or {})}
    out = []
    for row in prompts:
        messages = [{"role": "user", "content": row["prompt"]}]
        t0 = time.perf_counter()
        with usage_scope() as usage:
            if use_rails:
                res = rails.generate(messages=messages, options={"llm_params": llm_params,
                                                                 "log": {"activated_rails": True}})
                text = res.response[-1]["content"] if res.response else ""
                blocked = any(r.stop and r.type in ("input", "output")
                              for r in (res.log.activated_rails if res.log else []))
            else:
                text = asyncio.run(model.generate_async(messages, **llm_params)).content
                blocked = False
        seconds = time.perf_counter() - t0
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        gram = repeated_ngram(ids)
        out.append({"id": row["id"], "text": text, "tokens": usage.completion_tokens or (0 if blocked else len(ids)),
                    "finish": usage.finish_reason, "loop": tokenizer.decode(list(gram)) if gram else None,
                    "blocked": blocked, "seconds": round(seconds, 2)})
        print(f"  {row['id']:>2} {'blocked' if blocked else out[-1]['finish']:<7} {out[-1]['tokens']:>4} tok "
              f"{seconds:5.1f} s"
              f"{'  loop ' + repr(out[-1]['loop']) if gram else ''}", flush=True)
    return out


def summary(replies: list[dict], max_tokens: int) -> dict:
    """Shares over all the replies; the mean length over the replies no rail blocked."""
    n = len(replies)
    cap = [r for r in replies if r["finish"] == "length" and not r["blocked"]]
    answered = [r["tokens"] for r in replies if not r["blocked"]]
    return {"n": n, "cap": len(cap), "cap_loop": sum(1 for r in cap if r["loop"]),
            "loop": sum(1 for r in replies if r["loop"] and not r["blocked"]),
            "mean_tokens": sum(answered) / len(answered) if answered else 0.0,
            "blocked": sum(1 for r in replies if r["blocked"]),
            "seconds": sum(r["seconds"] for r in replies) / n if n else 0.0}


def table(results: dict, settings: dict, max_tokens: int) -> str:
    def pct(k: int, n: int) -> str:
        return f"{k}/{n} ({k / n:.0%})"

    lines = [f"max_tokens {max_tokens}; loop: some {NGRAM}-gram of the reply's tokens occurs >= {TIMES} times",
             "", "| setting | sampling | cap | cap + loop | loop | mean tokens | blocked | s / reply |",
             "|---|---|---|---|---|---|---|---|"]
    for name, replies in results.items():
        s = summary(replies, max_tokens)
        params = settings[name]
        shown = "the config's defaults" if params is None else ", ".join(
            f"{k} {v}" for k, v in params.items() if NEUTRAL.get(k) != v) or "greedy, no penalty"
        lines.append(f"| {name} | {shown} | {pct(s['cap'], s['n'])} | {pct(s['cap_loop'], s['n'])} | "
                     f"{pct(s['loop'], s['n'])} | {s['mean_tokens']:.0f} | {s['blocked']} | {s['seconds']:.1f} |")
    return "\n".join(lines)


def pairs(path: str, a: str, b: str) -> str:
    """Markdown: each prompt with the replies of settings ``a`` and ``b``, for reading side by side."""
    data = json.loads(Path(path).read_text())
    prompts = {r["id"]: r for r in data["prompts"]}
    lines = [f"# {a} | {b}", ""]
    for ra, rb in zip(data["replies"][a], data["replies"][b]):
        p = prompts[ra["id"]]
        lines += [f"## {p['id']}. {p['prompt']} ({p['category']})", ""]
        for name, r in ((a, ra), (b, rb)):
            mark = f" [cut at {r['tokens']} tokens{', loop ' + repr(r['loop']) if r['loop'] else ''}]" \
                if r["finish"] == "length" else f" [{r['tokens']} tokens]"
            lines += [f"**{name}**{mark}:", "", "> " + r["text"].replace("\n", "\n> "), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "flash"))
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--setting", action="append", default=None, metavar="NAME[=key=value,...]",
                    help=f"repeatable; named: {', '.join(SETTINGS)}; another bare name: the config's defaults "
                    "(default: all the named ones and 'default')")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    ap.add_argument("--no-rails", action="store_true", help="the provider's generation call alone (no rail checks)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "out" / "replies.json"))
    ap.add_argument("--pairs", nargs=3, metavar=("FILE", "A", "B"), default=None)
    ap.add_argument("--out", default=None, help="with --pairs: write the markdown here (default: stdout)")
    args = ap.parse_args(argv)

    if args.pairs:
        text = pairs(*args.pairs)
        if args.out:
            Path(args.out).write_text(text, encoding="utf-8")
        else:
            print(text)
        return 0

    settings = dict(parse_setting(s) for s in (args.setting or [*SETTINGS, "default"]))
    prompts = read_prompts(Path(args.prompts), args.limit)

    from flashguard.guardrails.provider import FlashGuardModel

    if args.no_rails:   # the provider NeMo would build for the config's main model, without LLMRails
        import yaml

        from flashguard.config import main_parameters

        doc = yaml.safe_load(Path(args.config, "config.yml").read_text(encoding="utf-8"))
        rails, model = None, FlashGuardModel(**main_parameters(doc))
    else:
        from nemoguardrails import LLMRails, RailsConfig

        rails = LLMRails(RailsConfig.from_path(args.config))
        model = rails.llm
        if not isinstance(model, FlashGuardModel):
            raise SystemExit(f"{args.config}: the main model is not flashguard's provider ({type(model).__name__})")
    import torch

    print(f"{len(prompts)} prompts, {args.config}, torch threads {torch.get_num_threads()}", flush=True)
    results = {}
    for name, params in settings.items():
        print(f"{name}: {params if params is not None else 'the config defaults'}", flush=True)
        results[name] = run_setting(rails, model, params, prompts, args.max_tokens, not args.no_rails,
                                    model.engine.tokenizer)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "config": args.config, "max_tokens": args.max_tokens, "rails": not args.no_rails,
            "loop": {"ngram": NGRAM, "times": TIMES}, "settings": {k: settings[k] for k in results},
            "prompts": prompts, "replies": results,
            "summary": {k: summary(v, args.max_tokens) for k, v in results.items()}}, indent=1, ensure_ascii=False))
    print()
    print(table(results, settings, args.max_tokens))
    print(f"\nreplies: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
