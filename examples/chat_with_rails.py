"""A guarded answer through NeMo Guardrails' Python API, with the rails log and flashguard's counters.

    python examples/chat_with_rails.py "What is the capital of France?"
"""

import json
import sys
from pathlib import Path

from nemoguardrails import LLMRails, RailsConfig

import flashguard

config = Path(__file__).resolve().parent.parent / "configs" / "flash"
rails = LLMRails(RailsConfig.from_path(str(config)))
question = sys.argv[1] if len(sys.argv) > 1 else "What is the capital of France?"
print(rails.generate(messages=[{"role": "user", "content": question}])["content"])
rails.explain().print_llm_calls_summary()
print(json.dumps(flashguard.engine_stats(), indent=2))
