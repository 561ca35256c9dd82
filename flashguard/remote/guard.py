"""The guard adapter behind a server (``backend: openai`` against llama-server): the same activated LoRA the local
engine runs (engine/alora.py), exported with ``flashguard export-guard`` (remote/guard_export.py), loaded by the
server (``--lora-scaled guard.gguf:0``, or ``--lora guard.gguf``) and enabled per request.

Contract:
- ``attach(config, source, client)``: the ``RemoteGuard`` for ``guard_adapter``, or None. ``off``: None. A folder:
  its guard.json and invocation are read and checked against the tokenizer's model (as the local engine checks
  them), and the server's adapter is found in ``GET /lora-adapters`` by its invocation as exported
  (``invocation[1:]``) and its ``task_name`` (the export's digest of the guard's weights). No such adapter on the
  server is a ConfigError naming ``guard_adapter`` and the llama-server flags; so is an adapter exported from
  other weights (a stale export), one exported without the shift, and a server without ``/lora-adapters``.
  ``auto``: the guard made for this model (alora.find), if any; where the server lacks it, one warning and no guard
  (the rails decide by the question classifier, as before this guard existed): a server started before the guard
  shipped keeps working, and the warning says how to add it. An adapter converted by hand (no digest) is used where
  it is the only one with the invocation, with one line saying it could not be checked.
- ``RemoteGuard``: ``folder``, ``meta`` (guard.json), ``invocation`` (the full one, as trained: rails/guard.py's
  ``check`` compares it with the tokenizer's), ``adapter_id`` (the server's id), ``server_invocation``; ``lora(on)``:
  the request's ``lora`` field.
- The requests (RemoteEngine): the guard's question names the guard at scale 1; so does every other request of the
  conversation, where the server finds no invocation and runs the prompt without the adapter. The slot's adapters
  then never switch off between a conversation's requests: llama-server clears a slot's whole prompt cache when a
  request turns its activated LoRA off (scale 0, or a plain LoRA on), and would re-prefill the conversation. A prompt
  that holds the invocation itself (a user who typed the tag) is sent without the adapter: no ``lora`` field where the
  server's own scale for it is 0, else scale 0 (that one re-prefill).

llama-server (llama.cpp as vendored in llama-cpp-python 0.3.36; docs/benchmarks/guard_remote.md): an adapter loaded
with ``--lora`` is on at scale 1 for every request that does not name adapters, ``--lora-init-without-apply``
notwithstanding (the server sets each request's adapters itself), so another client's prompt holding ``guard]`` would
run the guard, and a server holding two activated LoRAs refuses such requests ("Cannot run multiple aLoRAs").
``--lora-scaled guard.gguf:0`` leaves requests that name nothing as they were; flashguard names the guard in its own.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..engine import alora
from ..errors import ConfigError
from . import guard_export

log = logging.getLogger("flashguard")

FLAGS = "llama-server -m MODEL.gguf --lora-scaled guard.gguf:0 ..."


class RemoteGuard:
    def __init__(self, folder: Path, meta: dict, invocation: tuple, adapter_id: int, digest: str | None,
                 server_path: str, default_scale: float = 1.0):
        self.folder, self.meta, self.invocation = folder, meta, tuple(invocation)
        self.adapter_id, self.digest, self.server_path = adapter_id, digest, server_path
        self.default_scale = default_scale   # the server's scale for requests that name no adapter
        self.server_invocation = tuple(guard_export.server_invocation(invocation))

    def lora(self, on: bool = True) -> list[dict] | None:
        """The request's ``lora`` field (None: send none). On: the guard at scale 1 (the server runs it from the
        invocation, or not at all where the prompt holds none). Off, for a prompt that holds the invocation: nothing
        where the server's own scale is 0 (``--lora-scaled guard.gguf:0``), else scale 0, which costs the slot's
        cache once (llama-server clears it when a slot's adapters turn off)."""
        if on:
            return [{"id": self.adapter_id, "scale": 1.0}]
        return None if self.default_scale == 0 else [{"id": self.adapter_id, "scale": 0.0}]

    def info(self) -> dict:
        return {"path": str(self.folder), "server_adapter": self.adapter_id, "server_path": self.server_path,
                "digest": self.digest, "made_for": self.meta.get("model_file"), "version": self.meta.get("version")}


def _export_hint(folder: Path | str) -> str:
    return (f"export it with `flashguard export-guard --guard {folder} --gguf guard.gguf` and start the server with "
            f"`{FLAGS}` (docs/remote.md: 'The guard behind llama-server'), or set {alora.KEY}: off")


def attach(config, source, client) -> RemoteGuard | None:
    """The guard of ``config.guard_adapter`` on the server (see the module docstring)."""
    setting = config.guard_adapter
    if setting == "off":
        return None
    folder = alora.find(source) if setting == "auto" else Path(setting)
    if folder is None:
        return None
    folder = Path(folder).expanduser()
    meta = alora.read_meta(folder)
    name, size = alora.model_file_key(source)
    if (meta["model_file"], meta["model_bytes"]) != (name, size):
        raise ConfigError(f"{folder}: it was made for {meta['model_file']} ({meta['model_bytes']:,} bytes), not for "
                          f"{name} ({size:,} bytes), the model_path whose tokenizer renders the prompts; make one "
                          f"for this model with `{alora.TRAIN_HINT}` or set {alora.KEY}: off", key=alora.KEY)
    invocation = guard_export.invocation_of(folder)
    digest = guard_export.guard_digest(folder)
    try:
        found = _find(client, folder, invocation, digest)
    except ConfigError as exc:
        if setting != "auto":
            raise
        log.warning("flashguard: %s; the rails decide without the guard adapter (the question classifier)",
                    str(exc).split(": ", 1)[1])
        return None
    adapter_id, server_path, checked, scale = found
    guard = RemoteGuard(folder, meta, invocation, adapter_id, digest if checked else None, server_path, scale)
    _check_model(client, meta)
    log.info("flashguard: guard adapter %s, the server's adapter %d (%s)%s", folder, adapter_id, server_path,
             "" if checked else " (converted by hand: its weights could not be checked against the folder's)")
    return guard


def _find(client, folder: Path, invocation: tuple, digest: str) -> tuple[int, str, bool, float]:
    adapters = client.lora_adapters()
    if adapters is None:
        raise ConfigError(f"the server at {client.base_url} lists no LoRA adapters (GET /lora-adapters: not a "
                          "llama-server?); the guard adapter needs llama-server with the guard loaded: "
                          + _export_hint(folder), key=alora.KEY)
    want = list(guard_export.server_invocation(invocation))
    ours = guard_export.TASK_PREFIX + digest
    same = [a for a in adapters if list(a.get("alora_invocation_tokens") or []) == want]
    for a in same:
        if a.get("task_name") == ours:
            return int(a["id"]), str(a.get("path")), True, _scale(a)
    stale = [a for a in same if str(a.get("task_name") or "").startswith(guard_export.TASK_PREFIX)]
    hand = [a for a in same if a not in stale]
    if len(hand) == 1 and not stale:
        return int(hand[0]["id"]), str(hand[0].get("path")), False, _scale(hand[0])
    if stale or hand:
        paths = ", ".join(str(a.get("path")) for a in stale + hand)
        what = ("exported from other guard weights (a guard trained since?)" if stale and not hand else
                "several adapters with the guard's invocation and none exported from this guard")
        raise ConfigError(f"the server's adapter {paths} is {what}, not {folder} (digest {digest}): "
                          + _export_hint(folder), key=alora.KEY)
    unshifted = [a for a in adapters if list(a.get("alora_invocation_tokens") or []) == list(invocation)]
    if unshifted:
        raise ConfigError(f"the server's adapter {unshifted[0].get('path')} has the guard's invocation unshifted "
                          f"({list(invocation)}; llama-server would run it from one token early): "
                          + _export_hint(folder), key=alora.KEY)
    listed = ", ".join(str(a.get("path")) for a in adapters) or "none"
    raise ConfigError(f"the server at {client.base_url} has no adapter with the guard's invocation {want} "
                      f"(its adapters: {listed}): " + _export_hint(folder), key=alora.KEY)


def _scale(adapter: dict) -> float:
    try:
        return float(adapter.get("scale", 1.0))
    except (TypeError, ValueError):
        return 1.0


def _check_model(client, meta: dict) -> None:
    """One warning where the server's model file is not the one the guard was made for (by name: a renamed copy
    of the same file is fine, so this is not an error)."""
    props = client.props() or {}
    served = Path(str(props.get("model_path") or "")).name
    if served and served != meta.get("model_file"):
        log.warning("flashguard: the server runs %s; the guard adapter was made for %s (its verdicts are measured "
                    "there only)", served, meta.get("model_file"))


def lacks_invocation(guard: RemoteGuard, ids) -> bool:
    """Whether the server would find no invocation in ``ids`` (then naming the guard at scale 1 runs nothing)."""
    return last_occurrence(ids, guard.server_invocation) < 0


def check_start(guard: RemoteGuard | None, ids, start: int) -> None:
    """The guard's read: the server will start the adapter at ``start`` (the invocation's first token, whose rest is
    the last occurrence of the exported invocation in ``ids``), else a clear error."""
    if guard is None:
        raise ConfigError("no guard adapter is attached for this server (guard_adapter is off, or none was made "
                          f"for this model); the rails' guard verdict needs one: `{alora.TRAIN_HINT}`, then "
                          "`flashguard export-guard`", key=alora.KEY)
    n = len(guard.invocation)
    if not 0 < start < len(ids) or tuple(ids[start:start + n]) != guard.invocation or \
            last_occurrence(ids, guard.server_invocation) != start + 1:
        raise ValueError(f"adapter_from={start} is not where the server starts the guard adapter (the last "
                         f"occurrence of its invocation {list(guard.invocation)} in the {len(ids)} ids)")


def last_occurrence(ids, seq) -> int:
    """Where the last occurrence of ``seq`` starts in ``ids``, or -1 (rails/guard.py's rule, vectorised: it runs on
    every request's prompt, up to the whole context)."""
    arr, n = np.asarray(ids, dtype=np.int64), len(seq)
    if n == 0 or len(arr) < n:
        return -1
    hits = np.ones(len(arr) - n + 1, dtype=bool)
    for j, t in enumerate(seq):
        hits &= arr[j:len(arr) - n + 1 + j] == int(t)
    found = np.flatnonzero(hits)
    return int(found[-1]) if len(found) else -1
