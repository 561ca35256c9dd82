"""DeepSeek-R1 style reasoning: a tiny random Qwen2 with an R1-like chat template (the generation prompt opens
``<think>``) whose output is scripted by a logits hook on its real forward pass. The provider, NeMo's LLMRails,
the server app, the output rail and the token caps run for real on it."""

import asyncio
import copy

import pytest
import torch

from flashguard.reasoning import ThinkSplitter, split_answer
from tests import tiny

R1_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% elif m['role'] == 'user' %}"
    "<｜User｜>{{ m['content'] }}{% elif m['role'] == 'assistant' %}{% set c = m['content'] %}"
    "{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}<｜Assistant｜>{{ c }}<|im_end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
REASONING = "The user asks for the capital of France. That is Paris."
ANSWER = "The capital of France is Paris."


# ---- the splitter alone ---------------------------------------------------------------------
@pytest.mark.parametrize("pieces", [["<think>abc</think>\n\nThe answer."], list("<think>abc</think>\n\nThe answer."),
                                    ["  <thi", "nk>ab", "c</th", "ink>", "\n", "The ", "answer."]])
def test_the_splitter_finds_the_block_whatever_the_pieces(pieces):
    s = ThinkSplitter()
    out = [s.feed(p) for p in pieces] + [s.finish()]
    assert "".join(r for r, _ in out) == "abc" and "".join(a for _, a in out) == "The answer."


def test_the_splitter_inside_an_opened_block_and_without_one():
    s = ThinkSplitter(inside=True)
    out = [s.feed(p) for p in ["\nthinking </", "think>\n\nDone"]] + [s.finish()]
    assert ("".join(r for r, _ in out), "".join(a for _, a in out)) == ("thinking ", "Done")
    plain = ThinkSplitter()
    assert plain.feed("Hello <think> is a tag") == ("", "Hello <think> is a tag")
    unclosed = ThinkSplitter(inside=True)
    assert unclosed.feed("still thinking </thi") == ("still thinking ", "")
    assert unclosed.finish() == ("</thi", "")  # ran out of tokens inside the block: no answer
    assert split_answer("<think>r</think>\nA") == ("r", "A") and split_answer("A") == (None, "A")


# ---- a scripted reasoning model ---------------------------------------------------------------
class Script:
    """Forces the model's next token: after the longest run of already-emitted script tokens at the end of
    what the model has been fed, the next script token (then end of sequence). A hook on the real ``lm_head``
    output; the fed ids come from a pre-hook on the real input embedding."""

    def __init__(self, model, ids, eos):
        self.ids, self.eos, self.fed = list(ids), eos, []
        model.get_input_embeddings().register_forward_pre_hook(self._record)
        model.lm_head.register_forward_hook(self._force)

    def _record(self, module, args):
        self.fed.extend(int(t) for t in args[0].reshape(-1).tolist())

    def _force(self, module, args, out):
        k = max(k for k in range(len(self.ids) + 1) if k == 0 or self.fed[-k:] == self.ids[:k])
        forced = torch.full_like(out, -30.0)
        forced[..., self.ids[k] if k < len(self.ids) else self.eos] = 30.0
        return forced


def r1_tokenizer():
    """The tiny models' tokenizer (tests/tiny.py) with an R1-like chat template and, as DeepSeek-R1's tokenizer has
    them, the template's role markers as special tokens and ``<think>`` / ``</think>`` as tokens of their own."""
    tok = copy.deepcopy(tiny.tokenizer())
    tok.add_tokens(["<｜User｜>", "<｜Assistant｜>"], special_tokens=True)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = R1_TEMPLATE
    return tok


def n_tokens(text: str) -> int:
    return len(r1_tokenizer()(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def r1_folder(tmp_path_factory):
    """An HF folder: a tiny random Qwen2 with an R1-like chat template."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = r1_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=len(tok), max_position_embeddings=2048,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id)
    folder = tmp_path_factory.mktemp("r1")
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def scripted(llm, text=f"{REASONING}\n</think>\n\n{ANSWER}"):
    engine = llm.engine
    hooks = engine.__dict__.setdefault("_test_script", [])
    if not hooks:
        hooks.append(Script(engine.model, [], engine.tokenizer.eos_token_id))
    hooks[0].ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    return engine


def model(folder, **params):
    from flashguard.guardrails.provider import FlashGuardModel

    return FlashGuardModel(model_path=str(folder), device="cpu", max_context=1024, **params)


def test_the_provider_returns_the_answer_and_the_reasoning_apart(r1_folder):
    from flashguard.reasoning import reasoning_sink

    llm = model(r1_folder)
    scripted(llm)
    res = asyncio.run(llm.generate_async([{"role": "user", "content": "What is the capital of France?"}]))
    assert (res.content, res.reasoning, res.finish_reason) == (ANSWER, REASONING, "stop")

    seen = []

    async def stream():
        reasoning_sink.set(seen.append)   # what `flashguard chat` listens with
        return [c async for c in llm.stream_async("What is the capital of France?")]

    chunks = asyncio.run(stream())
    assert "".join(c.delta_content or "" for c in chunks) == ANSWER
    assert "".join(c.delta_reasoning or "" for c in chunks).strip() == REASONING == "".join(seen).strip()
    assert not any("think>" in (c.delta_content or "") for c in chunks)


def test_max_tokens_leaves_room_for_the_reasoning(r1_folder):
    cap = n_tokens(ANSWER) + 4
    assert n_tokens(REASONING) > cap
    llm = model(r1_folder, max_tokens=cap)   # the answer fits in max_tokens, the reasoning does not
    scripted(llm)
    res = asyncio.run(llm.generate_async("What is the capital of France?"))
    assert res.content == ANSWER and res.finish_reason == "stop"
    tight = model(r1_folder, max_tokens=cap, reasoning_tokens=0)
    scripted(tight)
    res = asyncio.run(tight.generate_async("What is the capital of France?"))
    assert res.finish_reason == "length" and res.content == "" and REASONING.startswith(res.reasoning)


def rails_for(folder, tmp_path, judge_reasoning=False):
    from nemoguardrails import LLMRails, RailsConfig

    from tests.conftest import make_config

    cfg = make_config(tmp_path, f"""
models:
  - type: main
    engine: flashguard
    model: flashguard
    parameters: {{model_path: "{folder}", device: cpu, max_context: 1024, max_tokens: 64}}
passthrough: true
rails:
  output:
    flows: [flashguard moderate output]
    streaming: {{enabled: true, chunk_size: 200, context_size: 50, stream_first: false}}
custom_data:
  flashguard_moderation: {{probe: "off", judge_reasoning: {str(judge_reasoning).lower()}}}
""")
    return LLMRails(RailsConfig.from_path(str(cfg)))


def test_nemo_gets_the_answer_and_the_rail_judges_the_answer_only(r1_folder, tmp_path):
    from flashguard.rails.moderation import ModerationSettings, moderation_suffix

    rails = rails_for(r1_folder, tmp_path)
    engine = scripted(rails.llm)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    res = rails.generate(messages=msgs, options={"log": {"activated_rails": True}})
    assert res.response[-1]["content"] == ANSWER and res.reasoning_content == REASONING
    rail = next(r for r in res.log.activated_rails if r.name == "flashguard moderate output")
    verdict = rail.executed_actions[0].return_value.metadata
    turn = engine.turns[-1]
    suffix = len(moderation_suffix(engine, ModerationSettings().prompt))
    answer = engine.tokenizer(f"\n</think>\n\n{ANSWER}", add_special_tokens=False)["input_ids"]
    assert REASONING in turn.text and len(turn.output_ids) > len(answer)
    judged = verdict["prefilled_tokens"] + verdict["reused_tokens"]
    assert judged == len(turn.prompt_ids) + len(answer) + suffix   # the answer, not the reasoning
    assert verdict["reused_tokens"] >= len(turn.prompt_ids) - 1
    # NeMo's own shape without options: the trace inlined as <think>...</think>, which split_answer takes off
    inline = rails.generate(messages=msgs)["content"]
    assert split_answer(inline) == (REASONING, ANSWER)


def test_judge_reasoning_judges_the_turn_as_generated_on_its_own_pages(r1_folder, tmp_path):
    from flashguard.rails.moderation import ModerationSettings, moderation_suffix

    rails = rails_for(r1_folder, tmp_path, judge_reasoning=True)
    engine = scripted(rails.llm)
    res = rails.generate(messages=[{"role": "user", "content": "Capital of France?"}],
                         options={"log": {"activated_rails": True}})
    assert res.response[-1]["content"] == ANSWER
    verdict = next(r for r in res.log.activated_rails if r.name == "flashguard moderate output") \
        .executed_actions[0].return_value.metadata
    turn = engine.turns[-1]
    suffix = len(moderation_suffix(engine, ModerationSettings().prompt))
    assert verdict["path"] == "shared" and verdict["prefilled_tokens"] <= suffix + 1
    assert verdict["prefilled_tokens"] + verdict["reused_tokens"] == len(turn.prompt_ids) + len(turn.output_ids) + suffix


def test_the_server_returns_the_answer_plain_and_streamed(r1_folder, tmp_path):
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from flashguard.guardrails.server import build_app

    rails = rails_for(r1_folder, tmp_path)
    scripted(rails.llm)
    client = TestClient(build_app(rails, Starlette()))
    body = {"model": "flashguard", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ANSWER
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    import json

    deltas = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    text = "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas if d.get("choices"))
    assert text == ANSWER


def test_the_chat_shows_the_reasoning_dimmed_only_when_asked(r1_folder, tmp_path, capsys):
    from flashguard.cli_chat import DIM, PLAIN, _stream_reply

    rails = rails_for(r1_folder, tmp_path)
    scripted(rails.llm)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert asyncio.run(_stream_reply(rails, msgs)) == ANSWER
    hidden = capsys.readouterr().out
    assert REASONING not in hidden and ANSWER in hidden
    assert asyncio.run(_stream_reply(rails, msgs, show_reasoning=True)) == ANSWER
    shown = capsys.readouterr().out
    plain = shown.replace(DIM, "").replace(PLAIN, "")
    assert DIM in shown and REASONING in plain and plain.index(REASONING) < plain.index(ANSWER)
