"""HTTP calls to an OpenAI-compatible server (``base_url`` ends in ``/v1``), with httpx.

Contract:
- Every request is a completions request over token ids (``prompt: [ids]``): the server runs exactly the ids
  flashguard rendered, so a rail's request that starts with the conversation's ids meets the server's prefix
  cache (llama-server's slot cache, vLLM's automatic prefix caching, SGLang's radix cache) token for token.
- Failures raise ``RemoteError`` (a ``FlashguardError``: the server answers 502 / 504) saying what happened and
  which key to check: ``base_url`` when the server cannot be reached, ``timeout_s`` when it is too slow, the
  models entry's ``model`` when the server serves another. The API key is read from the environment variable
  ``api_key_env`` names, sent as a bearer token, and never logged or put in an error.
- ``extra_body`` (empty unless set): fields merged into every completions request's body, for a server's own
  options that flashguard does not set, e.g. llama-server's ``{"cache_prompt": False}``, which
  ``benchmarks/remote_load.py`` sets to time the rails without the prefix cache. Not a config key.
- Bodies are encoded with ``orjson``: a body carries the conversation's token ids (a 32K conversation: ~240 KB of
  JSON, in every rail's request), which the standard library's encoder took ~4-6 ms to write and orjson ~0.5.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import httpx
import orjson

from ..errors import FlashguardError


JSON = {"Content-Type": "application/json"}
NUMPY = orjson.OPT_SERIALIZE_NUMPY   # (numpy integers among the ids, as the standard library could not)


class RemoteError(FlashguardError):
    """The serving engine could not be reached, refused the request or did not answer in time."""

    status_code = 502


class RemoteTimeout(RemoteError):
    status_code = 504


class Client:
    def __init__(self, base_url: str, api_key_env: str | None, timeout_s: float):
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.extra_body: dict = {}
        headers = {}
        if api_key_env:
            key = os.environ.get(api_key_env)
            if not key:
                raise FlashguardError(f"the environment variable {api_key_env} (the server's API key) is not set",
                                      key="api_key_env")
            headers["Authorization"] = f"Bearer {key}"
        # connections kept per server; the limit bounds concurrent requests at what a server's slots take
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=httpx.Timeout(timeout_s),
                                 limits=httpx.Limits(max_connections=64, max_keepalive_connections=32))

    def close(self) -> None:
        self.http.close()

    def _fail(self, exc: Exception, what: str) -> RemoteError:
        if isinstance(exc, httpx.TimeoutException):
            return RemoteTimeout(f"the server at {self.base_url} did not answer {what} within {self.timeout_s:g} s; "
                                 "raise timeout_s or check the server's load", key="timeout_s")
        return RemoteError(f"cannot reach the server at {self.base_url} ({type(exc).__name__}: {exc}) {what}; "
                           "start it or fix base_url", key="base_url")

    @staticmethod
    def _refused(response: httpx.Response, what: str) -> RemoteError:
        text = response.text[:300].replace("\n", " ")
        key = {401: "api_key_env", 403: "api_key_env", 404: "base_url"}.get(response.status_code)
        hint = {"api_key_env": "; set api_key_env to the variable holding the server's key",
                "base_url": "; base_url is the server's API root (it usually ends in /v1)"}.get(key, "")
        return RemoteError(f"the server refused {what}: HTTP {response.status_code}: {text}{hint}", key=key)

    def models(self) -> list[str]:
        """The model ids the server serves (``GET /models``)."""
        try:
            r = self.http.get("/models", timeout=min(self.timeout_s, 10.0))
        except httpx.HTTPError as exc:
            raise self._fail(exc, "at start (GET /models)") from exc
        if r.status_code != 200:
            raise self._refused(r, "GET /models")
        data = r.json().get("data") or []
        return [str(m.get("id")) for m in data if isinstance(m, dict)]

    def _root_json(self, path: str):
        """``GET`` of llama-server's own endpoint ``path`` (at the server's root, beside ``/v1``): its JSON, or None
        from a server without it (vLLM, SGLang) or one that cannot be read."""
        root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        try:
            r = self.http.get(f"{root}{path}", timeout=min(self.timeout_s, 10.0))
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def props(self) -> dict | None:
        """llama-server's ``GET /props`` (None elsewhere)."""
        props = self._root_json("/props")
        return props if isinstance(props, dict) else None

    def slot_count(self) -> int | None:
        """The server's slots (llama-server's ``GET /props``: ``total_slots``); None from a server without that
        endpoint (vLLM, SGLang: one shared prefix cache, nothing to lease)."""
        count = (self.props() or {}).get("total_slots")
        return count if isinstance(count, int) and count > 0 else None

    def lora_adapters(self) -> list[dict] | None:
        """llama-server's ``GET /lora-adapters``: its adapters (id, path, scale, task_name, alora_invocation_tokens);
        None from a server without that endpoint."""
        adapters = self._root_json("/lora-adapters")
        return [a for a in adapters if isinstance(a, dict)] if isinstance(adapters, list) else None

    def complete(self, body: dict, what: str = "the request") -> dict:
        """One completions request, answered whole."""
        try:
            r = self.http.post("/completions", headers=JSON,
                               content=orjson.dumps({**body, **self.extra_body, "stream": False}, option=NUMPY))
        except httpx.HTTPError as exc:
            raise self._fail(exc, what) from exc
        if r.status_code != 200:
            raise self._refused(r, what)
        return r.json()

    def stream(self, body: dict, what: str = "the reply") -> Iterator[dict]:
        """One streamed completions request: the server-sent events' JSON objects, in order."""
        body = {**body, **self.extra_body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with self.http.stream("POST", "/completions", content=orjson.dumps(body, option=NUMPY),
                                  headers=JSON) as r:
                if r.status_code != 200:
                    r.read()
                    raise self._refused(r, what)
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise RemoteError(f"the server stopped {what}: {json.dumps(event['error'])[:300]}")
                    yield event
        except httpx.HTTPError as exc:
            raise self._fail(exc, f"while streaming {what} (the reply was cut)") from exc
        raise RemoteError(f"the server at {self.base_url} closed the stream of {what} before it ended")
