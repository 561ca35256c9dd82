"""A LangChain chain on flashguard's engine, then the same model guarded by NeMo Guardrails' LangChain
integration (``RunnableRails``), with the moderation rail reusing the conversation's pages.

    pip install -e ".[langchain]" && python examples/langchain_chain.py "France"
"""

import sys
from pathlib import Path

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from nemoguardrails import RailsConfig
from nemoguardrails.integrations.langchain.runnable_rails import RunnableRails

import flashguard
from flashguard.guardrails.langchain_chat import ChatFlashguard

country = sys.argv[1] if len(sys.argv) > 1 else "France"
llm = ChatFlashguard(max_tokens=48)                      # flashguard parameters go here too (model_path=..., kv=...)
prompt = ChatPromptTemplate.from_messages([("system", "Answer in one sentence."),
                                           ("human", "What is the capital of {country}?")])

chain = prompt | llm | StrOutputParser()
print("plain chain:  ", chain.invoke({"country": country}))
print("streamed:     ", end="")
for piece in chain.stream({"country": country}):
    print(piece, end="", flush=True)
print()

config = RailsConfig.from_path(str(Path(__file__).resolve().parent.parent / "configs" / "flash"))
guarded = prompt | RunnableRails(config, llm=llm) | StrOutputParser()
print("guarded chain:", guarded.invoke({"country": country}))
print(flashguard.engine_stats())
