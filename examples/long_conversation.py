"""A multi-turn conversation through the rails, showing what the moderation rail reuses each turn.

Each turn the output rail continues the turn's own token ids, so it prefills only its short question
while the whole conversation is reused from the cache.

    python examples/long_conversation.py
"""

from pathlib import Path

from nemoguardrails import LLMRails, RailsConfig

import flashguard

config = Path(__file__).resolve().parent.parent / "configs" / "flash"
rails = LLMRails(RailsConfig.from_path(str(config)))
questions = ["Tell me about the history of Paris in a few sentences.", "What river runs through it?",
             "Name three famous museums there.", "Which one would you visit first, and why?",
             "Summarise our conversation in one sentence."]
messages, last = [], {"prefilled_tokens": 0, "reused_tokens": 0}
for q in questions:
    messages.append({"role": "user", "content": q})
    reply = rails.generate(messages=messages)["content"]
    messages.append({"role": "assistant", "content": reply})
    stats = next(iter(flashguard.engine_stats().values()))["moderation"]
    prefilled = stats["prefilled_tokens"] - last["prefilled_tokens"]
    reused = stats["reused_tokens"] - last["reused_tokens"]
    last = stats
    print(f"user: {q}\nbot:  {reply[:200]}\n      moderation prefilled {prefilled} tokens, reused {reused}\n")
