"""The OpenAI-compatible backend (``backend: openai``): a serving engine a team already runs (llama-server, vLLM,
SGLang) runs the model; flashguard renders the conversation, streams the reply and asks the rails' questions.

- ``client.py``: the HTTP calls (``/models``, ``/completions`` plain and streamed), each error naming the key to fix.
- ``engine.py``: ``RemoteEngine``, the same public surface as the local ``Engine`` for the provider, the server
  and the rails (``encode_messages``, ``stream``, ``read``, ``turns``, ``stats``).
- ``slots.py``: slot leases: a turn's requests keep one of llama-server's slots (``slot_leases: auto``).
- ``guard.py``: the guard adapter on llama-server (``guard_adapter``): found by its export's invocation and digest,
  named per request. ``guard_export.py``: ``flashguard export-guard`` (the guard as a llama.cpp LoRA GGUF).
"""
