"""Sampling penalties (engine/sampling.py ``Penalties``) and the decode loop under them: fast, no model."""

import pytest
import torch

from flashguard import ConfigError, EngineConfig, PromptError
from flashguard.engine import decode_loop
from flashguard.engine.sampling import Penalties, SamplingParams


def penalized(logits, generated, **params):
    p = Penalties(SamplingParams(**params))
    for t in generated:
        p.add(t)
    return p.apply(torch.tensor(logits))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_generated_tokens():
    out = penalized([2.0, -1.0, 3.0, 0.5], [0, 1, 0], repetition_penalty=2.0)
    assert out.tolist() == [1.0, -2.0, 3.0, 0.5]   # tokens 2 and 3 were never generated: unchanged


def test_frequency_and_presence_penalties_are_openais():
    # logit - frequency * count - presence, for each generated token
    out = penalized([1.0, 1.0, 1.0, 1.0], [0, 0, 2], frequency_penalty=0.5, presence_penalty=0.25)
    assert out.tolist() == pytest.approx([1.0 - 2 * 0.5 - 0.25, 1.0, 1.0 - 0.5 - 0.25, 1.0])


def test_no_repeat_ngram_bans_the_token_that_would_repeat_an_ngram():
    out = penalized([0.0] * 10, [5, 6, 7, 5, 6], no_repeat_ngram=3)
    assert out[7] == float("-inf") and torch.isfinite(out[torch.arange(10) != 7]).all()
    out = penalized([0.0] * 10, [5, 6, 7, 5, 8], no_repeat_ngram=3)   # (5, 8) never came before: nothing banned
    assert torch.isfinite(out).all()


def test_penalties_leave_the_engines_logits_alone():
    logits = torch.tensor([2.0, -1.0, 3.0])
    p = Penalties(SamplingParams(repetition_penalty=1.5))
    assert p.apply(logits) is logits   # nothing generated yet
    p.add(0)
    assert p.apply(logits)[0] != logits[0] and logits.tolist() == [2.0, -1.0, 3.0]   # a copy was changed
    off = Penalties(SamplingParams())
    off.add(0)
    assert off.apply(logits) is logits   # no penalty: no copy, no work


def test_a_greedy_loop_ends_under_a_repetition_penalty():
    """A 'model' whose next token is always 7, with the end of turn (2) second: greedy repeats 7 to the cap; a
    repetition penalty lowers 7 once it was generated, and the end of turn wins."""
    logits = torch.tensor([0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 2.5])

    def reply(params):
        out = []
        last = decode_loop.joined(decode_loop.run(logits, lambda token: logits, params, None, max_new=16,
                                                  eos_ids=frozenset({2}), detokenize=lambda ids: "x" * len(ids),
                                                  prompt_tokens=3, out=out))
        return out, last.finish_reason

    assert reply(SamplingParams(max_tokens=16)) == ([7] * 16, "length")
    assert reply(SamplingParams(max_tokens=16, repetition_penalty=1.3)) == ([7], "stop")   # 2.5 / 1.3 < 2.0
    assert reply(SamplingParams(max_tokens=16, frequency_penalty=0.2)) == ([7, 7, 7], "stop")   # 2.5 - 0.6 < 2.0


def test_sampling_params_from_config_takes_the_configs_penalties_unless_the_call_gives_its_own():
    config = EngineConfig(repetition_penalty=1.3, frequency_penalty=0.1, presence_penalty=0.2, no_repeat_ngram=5)
    p = SamplingParams.from_config(config)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.no_repeat_ngram) == (1.3, 0.1, 0.2, 5)
    p = SamplingParams.from_config(config, repetition_penalty=1.0, frequency_penalty=0, presence_penalty=0,
                                   no_repeat_ngram=0)
    assert not p.penalized
    assert not SamplingParams().penalized   # the struct's own defaults are plain greedy: tools and benchmarks


@pytest.mark.parametrize("params, word", [({"repetition_penalty": 0}, "repetition_penalty"),
                                          ({"frequency_penalty": 3}, "frequency_penalty"),
                                          ({"presence_penalty": -2.5}, "presence_penalty"),
                                          ({"no_repeat_ngram": -1}, "no_repeat_ngram")])
def test_bad_penalties_name_the_key(params, word):
    with pytest.raises(PromptError, match=word):
        SamplingParams(**params)
    with pytest.raises(ConfigError, match=word):
        EngineConfig.from_parameters(params)
