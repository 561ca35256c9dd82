"""Replies that end (issue 43): a question whose greedy reply loops to the cap on the embedded model, as chat loads it
(int4 on the CPU), stops looping under the config's default sampling."""

import pytest

from flashguard import EngineConfig
from flashguard.engine import SamplingParams
from tests.reply_loops import repeated_ngram

pytestmark = pytest.mark.slow

# greedy: "... set in the balcony of the balcony of the balcony of ..." to the 256-token cap (benchmarks/replies.py)
LOOPING = [{"role": "user", "content": "Who wrote Romeo and Juliet?"}]


def test_a_looping_greedy_reply_stops_looping_under_the_default(engine):
    ids = engine.encode_messages(LOOPING)
    greedy = engine.generate(ids, SamplingParams(max_tokens=256))
    out = list(engine.turns[-1].output_ids)
    assert greedy.finish_reason == "length" and repeated_ngram(out) is not None, greedy.text   # the loop

    default = SamplingParams.from_config(EngineConfig())
    assert default.penalized and default.max_tokens == 256
    reply = engine.generate(ids, default)
    out = list(engine.turns[-1].output_ids)
    assert not (reply.finish_reason == "length" and repeated_ngram(out) is not None), reply.text
    assert "Shakespeare" in reply.text
    assert engine.generate(ids, default).text == reply.text   # the same question, the same reply
