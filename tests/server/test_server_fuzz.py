"""200 malformed requests against the real server: each gets a clear 4xx, and the server stays healthy."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
bad_message = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.fixed_dictionaries({"content": st.text(max_size=20)}),                                   # no role
    st.fixed_dictionaries({"role": st.one_of(st.integers(), st.none(), st.lists(st.text())),   # role not a string
                           "content": st.text(max_size=20)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(st.integers(), st.booleans(),
                                                                            st.dictionaries(st.text(), st.text()))}),
)
good_messages = st.just([{"role": "user", "content": "hi"}])
bodies = st.one_of(
    st.binary(min_size=1, max_size=64).filter(lambda b: not _is_json(b)).map(lambda b: ("raw", b)),
    st.one_of(scalars, st.lists(scalars, max_size=3)).map(lambda v: ("json", v)),                     # not an object
    st.fixed_dictionaries({"model": st.text(max_size=10),
                           "messages": st.one_of(scalars, st.just([]))}).map(lambda v: ("json", v)),
    st.fixed_dictionaries({"messages": st.lists(bad_message, min_size=1, max_size=3)}).map(lambda v: ("json", v)),
    st.fixed_dictionaries({"messages": good_messages,
                           "max_tokens": st.one_of(st.integers(max_value=0), st.integers(min_value=5000),
                                                   st.text(max_size=5), st.booleans(), st.floats(allow_nan=False))
                           }).map(lambda v: ("json", v)),
)


def _is_json(b: bytes) -> bool:
    try:
        json.loads(b)
        return True
    except ValueError:
        return False


def test_malformed_requests_get_a_clear_4xx_and_the_server_stays_healthy(server):
    seen = []

    @settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies)
    def malformed(body):
        kind, value = body
        content = value if kind == "raw" else json.dumps(value).encode()
        r = httpx.post(server.url + "/v1/chat/completions", content=content, timeout=60,
                       headers={"content-type": "application/json"})
        seen.append(r.status_code)
        assert 400 <= r.status_code < 500, (value, r.status_code, r.text)
        assert r.json()["error"]["message"]

    malformed()
    assert len(seen) >= 200
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": "flashguard", "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
