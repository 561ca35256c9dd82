"""``benchmarks/remote_load.py``'s parts that decide what its table says, without a server: the reply-ownership
check (every request's own prompt length, a reply carrying another's is found), the conversations it sends, and the
two configs it loads (flashguard's with ``backend: openai``, NeMo's self-check rails with its shipped prompts)."""

from __future__ import annotations

import yaml

from benchmarks import remote_load


def words(messages):
    return sum(len(m["content"].split()) for m in messages)


def test_unique_prompt_gives_every_request_its_own_length():
    seen: set[int] = set()
    base = [{"role": "user", "content": "one two three"}]
    counts = []
    for _ in range(5):   # the same messages five times: each gets lengthened until its count is new
        msgs, n = remote_load.unique_prompt(base, words, seen)
        assert n == words(msgs)
        counts.append(n)
    assert counts == [3, 4, 5, 6, 7] and seen == set(counts)
    assert base == [{"role": "user", "content": "one two three"}]   # the caller's list is not changed


def test_ownership_mismatches_finds_a_reply_that_went_to_another_request():
    records = [{"status": 200, "expected": 100, "got": 100, "reply_id": "a"},
               {"status": 200, "expected": 101, "got": 102, "reply_id": "b"},   # another request's prompt
               {"status": 200, "expected": 102, "got": 102, "reply_id": "c"},
               {"status": 200, "expected": 103, "got": 103, "reply_id": "c"},   # the same reply twice
               {"status": 502, "expected": 104}]                                  # unanswered: counted as 5xx instead
    bad = remote_load.ownership_mismatches(records)
    assert [r["expected"] for r in bad] == [101, 102, 103]
    assert remote_load.ownership_mismatches(records[:1]) == []


def test_conversation_has_about_the_asked_tokens_and_seeds_share_no_prefix():
    from flashguard.engine import loader
    from flashguard.engine.encoding import MessageEncoder

    tok, _ = loader.load_tokenizer(loader.resolve_model(None))
    encode = MessageEncoder(tok, None).encode
    prose = remote_load.prose_ids(tok)
    a = remote_load.conversation(encode, tok, prose, 1500, seed=1, piece=200)
    b = remote_load.conversation(encode, tok, prose, 1500, seed=2, piece=200)
    for msgs in (a, b):
        assert 1400 <= len(encode(msgs)) <= 1560
        assert [m["role"] for m in msgs[:2]] == ["user", "assistant"] and msgs[-1]["role"] == "assistant"
    assert a[0]["content"] != b[0]["content"]


def test_the_configs_load_as_nemo_reads_them(tmp_path):
    from nemoguardrails import RailsConfig

    flash = remote_load.flash_config(tmp_path / "flash", remote_load.ROOT / "configs" / "flash",
                                     "http://127.0.0.1:9/v1", "served", None, 64, 0.9999)
    cfg = RailsConfig.from_path(str(flash))
    params = cfg.models[0].parameters
    assert cfg.models[0].engine == "flashguard" and params["backend"] == "openai" and params["max_tokens"] == 64
    assert cfg.custom_data["flashguard_input_moderation"]["threshold"] == 0.9999
    assert cfg.rails.input.flows == ["flashguard moderate input"]
    off = remote_load.flash_config(tmp_path / "off", remote_load.ROOT / "configs" / "flash",
                                   "http://127.0.0.1:9/v1", "served", None, 64, 0.9999, rails=False)
    assert RailsConfig.from_path(str(off)).rails.input.flows == []

    nemo = RailsConfig.from_path(str(remote_load.self_check_config(tmp_path / "nemo", "http://127.0.0.1:9/v1",
                                                                   "served", 3)))
    assert nemo.models[0].engine == "openai" and nemo.models[0].parameters["base_url"] == "http://127.0.0.1:9/v1"
    assert nemo.rails.input.flows == ["self check input"] and nemo.rails.output.flows == ["self check output"]
    tasks = {p.task: p for p in nemo.prompts}
    assert set(tasks) == {"self_check_input", "self_check_output"}
    assert all(p.max_tokens == 3 for p in tasks.values()) and "{{ user_input }}" in tasks["self_check_input"].content
    assert yaml.safe_load((tmp_path / "nemo" / "config.yml").read_text())["passthrough"] is True
