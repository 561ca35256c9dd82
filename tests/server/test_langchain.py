"""``ChatFlashguard`` (langchain-core 1.x BaseChatModel): invoke, stream, a chain, bad parameters, and NeMo
Guardrails' ``langchain`` framework mode with the moderation rail, all on the embedded model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import FLASH, ROOT

langchain_core = pytest.importorskip("langchain_core")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(engine):
    from flashguard.guardrails.langchain_chat import ChatFlashguard

    model = ChatFlashguard(max_tokens=24)
    assert model.engine is engine  # same parameters -> the process's one engine
    return model


def test_invoke_and_stream_agree(llm):
    from langchain_core.messages import HumanMessage, SystemMessage

    msgs = [SystemMessage("You are a helpful assistant."), HumanMessage("What is the capital of France?")]
    reply = llm.invoke(msgs)
    assert "Paris" in reply.content
    assert reply.usage_metadata["output_tokens"] > 0 and reply.usage_metadata["input_tokens"] > 10
    chunks = list(llm.stream(msgs))
    assert len(chunks) > 1
    assert "".join(c.content for c in chunks) == reply.content  # greedy: streaming is the same text


def test_in_a_chain(llm):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate

    chain = ChatPromptTemplate.from_messages([("human", "What is the capital of {country}?")]) | llm | \
        StrOutputParser()
    assert "Paris" in chain.invoke({"country": "France"})


def test_bad_parameter_names_the_keyword_not_a_yaml_path():
    from flashguard.guardrails.langchain_chat import ChatFlashguard

    with pytest.raises(ValueError, match=r"ChatFlashguard parameter kv\.policy: must be one of exact") as err:
        ChatFlashguard(kv={"policy": "everything"})
    assert "models[main]" not in str(err.value)
    with pytest.raises(ValueError, match="unknown key 'temprature'.*LangChain parameters: model, temperature"):
        ChatFlashguard(temprature=0.5)


def test_standard_parameters_are_accepted(llm):
    from flashguard.guardrails.langchain_chat import ChatFlashguard

    model = ChatFlashguard(max_tokens=24, timeout=600, max_retries=2, streaming=True, stop=["\n\n"], temperature=0)
    assert model.engine is llm.engine  # LangChain fields are not engine parameters
    reply = model.invoke("What is the capital of France?")  # streaming=True: invoke goes through _stream
    assert "Paris" in reply.content and reply.response_metadata["model_name"] == "flashguard"


def test_streamed_chunks_carry_model_name_and_usage_once(llm):
    chunks = list(llm.stream("What is the capital of France?"))
    assert [c.chunk_position for c in chunks][-1] == "last"
    assert [bool(c.response_metadata.get("model_name")) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    full = sum(chunks[1:], chunks[0])
    assert full.response_metadata["model_name"] == "flashguard" and full.usage_metadata["output_tokens"] > 0


def test_timeout_stops_the_reply(llm):
    with pytest.raises(TimeoutError, match="timeout=1e-09"):
        llm.invoke("Write a long story about a cat.", timeout=1e-9)
    assert "Paris" in llm.invoke("What is the capital of France?").content  # the engine was released


def test_an_async_stream_left_early_releases_the_engine(llm):
    import asyncio

    async def first_chunk():
        async for chunk in llm.astream("Write a long story about a cat."):
            return chunk

    assert asyncio.run(first_chunk()).content
    assert "Paris" in asyncio.run(llm.ainvoke("What is the capital of France?")).content


SCRIPT = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from nemoguardrails.llm.frameworks.registry import set_default_framework
set_default_framework("langchain")
from nemoguardrails import LLMRails, RailsConfig
rails = LLMRails(RailsConfig.from_path(sys.argv[1]))
from nemoguardrails.integrations.langchain.llm_adapter import LangChainLLMAdapter
assert isinstance(rails.llm, LangChainLLMAdapter), type(rails.llm)
print(type(rails.llm.raw_llm).__name__)
res = rails.generate(messages=[{"role": "user", "content": "What is the capital of France?"}])
print(res["content"])
"""


def test_nemo_langchain_framework_mode_runs_the_rail():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(FLASH)], capture_output=True, text=True, env=env,
                         timeout=600, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ChatFlashguard" in out.stdout and "Paris" in out.stdout
    assert "flashguard moderation: allow" in out.stderr  # the output rail ran on the same engine
