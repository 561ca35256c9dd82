"""The input probe's mean state over the user's message (``rails/moderation.py: pooled_state``), on a tiny random
model: it equals the mean of the model's own hidden states over the message, whatever the prefill chunks and whatever
the session already holds, and ``message_start`` is where the message's turn begins."""

import torch

from flashguard.rails.moderation import message_start, pooled_state
from tests import tiny


def reference(engine, ids, start):
    with torch.no_grad():
        out = engine.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return torch.stack([h[0, -1] for h in out.hidden_states]), \
        torch.stack([h[0, start:].mean(0) for h in out.hidden_states])


def test_the_mean_over_the_message_matches_the_models_own_forward(tmp_path):
    engine = tiny.engine(tmp_path / "m", prefill_chunk=16)
    msgs = [{"role": "user", "content": tiny.text(40)}, {"role": "assistant", "content": tiny.text(30, 1)},
            {"role": "user", "content": tiny.text(70, 2)}]
    ids = engine.encode_messages(msgs)
    start = message_start(engine, msgs, ids)
    # the turn of the new message starts right after the previous reply's end of turn and <|im_start|>
    assert engine.tokenizer.decode(ids[start:start + 5]) == "user\n" and 0 < start < len(ids) - 70
    assert message_start(engine, msgs[:1]) == 0
    last, mean = reference(engine, ids, start)
    layers = range(last.shape[0])
    for held in ([], ids[:start - 7], ids[:start + 9], ids[:-1]):   # nothing, the history, into the message, all
        engine.reset_session()
        if held:
            engine.next_token_state(held, task="calibration")
        hidden, pooled, reused = pooled_state(engine, ids, start, layers)
        assert reused <= start
        assert torch.allclose(hidden, last, atol=3e-3) and torch.allclose(pooled, mean, atol=3e-3), held
    one = pooled_state(engine, ids, start, (1,))[1]
    assert torch.allclose(one[0], mean[1], atol=3e-3)
