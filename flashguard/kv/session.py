"""KVSession: one conversation's KV cache, owned by the engine, with one owner of its page references.

The engine keeps one session (the last sequence it ran). Everything it does to the cache goes through this
interface, so no caller needs to know which cache it is:

- ``ids``: exactly the tokens whose K/V the cache holds.
- ``forward(tokens, private=False)``: the one way K/V reaches the cache. ``with session.forward(tokens) as cache:``
  run the model (or the decode step) over ``tokens`` with ``cache``; they sit at positions ``len(ids)``, ... . On a
  normal exit the forward is settled (a tiered cache keys, bounds and stores its pages: ``TieredCache.end``) and
  ``ids`` grows by ``tokens``; on an exception every layer goes back to ``ids`` and the exception propagates. A
  ``private`` forward's K/V are not the base model's (a guard adapter's suffix): its pages are never keyed by
  content nor stored for another sequence (``TieredCache.private_from``); the caller crops them away after.
- ``crop(n)`` keeps the first ``n`` tokens (a new turn that diverges, a moderation suffix cropped away).
- ``release(keep_pages)`` ends the session: every page reference it holds goes back to the store (with
  ``keep_pages`` its resident pages are stored first, for a later session with the same prefix). Every path
  that drops a session calls it; afterwards the session holds nothing and must not be used.
- ``references()``: page references this session holds (tests check they go back to zero).
- ``leaving(tokens)``: window tokens that will leave the device for the store once ``tokens`` more are fed (the
  engine announces L2 room for a prompt only when some will).

``DynamicSession`` wraps transformers' DynamicCache (no pages); ``TieredSession`` wraps ``TieredCache`` over the
engine's shared ``PageStore`` and, on a GPU, its ``PoolBuffers`` (kv/pool.py: the device buffers pass from one
session to the next).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Sequence

log = logging.getLogger("flashguard")


@contextlib.contextmanager
def forwarding(cache, tokens: Sequence[int]) -> Iterator[object]:
    """The forward protocol for a cache driven outside a session (``flashguard stress``, benchmarks, tests):
    ``with forwarding(cache, ids): model(input_ids=..., past_key_values=cache)``. A TieredCache is told the ids
    and their position (``begin``) and settles after (``end``); any other transformers Cache needs nothing. No
    undo on a failure: a session's ``forward`` is the engine's path."""
    from .cache import TieredCache

    tiered = isinstance(cache, TieredCache)
    if tiered:
        cache.begin(tokens, start=cache.length)
    yield cache
    if tiered:
        cache.end()


class KVSession:
    cache = None
    kind = ""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.released = False

    def adopt(self, ids: Sequence[int], dtype, device) -> int:
        """On a new session: reuse stored pages of the longest page-aligned prefix of ``ids``; tokens reused."""
        return 0

    @contextlib.contextmanager
    def forward(self, tokens: Sequence[int], private: bool = False) -> Iterator[object]:
        """One forward over ``tokens`` (see the module docstring); yields the cache the model is given."""
        tokens = [int(t) for t in tokens]
        self._begin(tokens, private)
        try:
            yield self.cache
        except BaseException:
            try:
                self.undo()   # every layer back to ``ids`` (some may have appended the tokens, others not)
            except Exception as err:  # noqa: BLE001 - the forward's own error is the one to raise
                log.warning("flashguard: the cache could not be brought back after a failed forward (%s)", err)
            raise
        try:
            self._end()
        except Exception as exc:   # the forward ran but its pages did not settle (e.g. out of memory storing them):
            from .disk import PageLost   # the cache is not at ``ids`` nor past them; the engine recomputes on this

            raise PageLost(f"the forward's pages could not be settled ({type(exc).__name__}: {exc})") from exc
        self.ids.extend(tokens)

    def _begin(self, tokens: list[int], private: bool = False) -> None:
        """Before a forward over ``tokens`` (at position ``len(ids)``)."""

    def _end(self) -> None:
        """After that forward succeeded in every layer."""

    def leaving(self, tokens: int) -> int:
        """Window tokens that leave the device for the store once ``tokens`` more are fed (whole pages; 0 when
        the sequence still fits the device, and always for a cache without pages)."""
        return 0

    def undo(self) -> None:
        raise NotImplementedError

    def crop(self, n: int) -> None:
        raise NotImplementedError

    def release(self, keep_pages: bool = True) -> None:
        self.released = True

    def references(self) -> int:
        return 0

    def stats(self) -> dict:
        return {"kind": self.kind, "tokens": len(self.ids)}


class DynamicSession(KVSession):
    """transformers' DynamicCache: every token of every layer on the device, no pages."""

    kind = "dynamic"

    def __init__(self, model_config) -> None:
        from transformers import DynamicCache

        super().__init__()
        self.cache = DynamicCache(config=model_config)

    def undo(self) -> None:
        keep = len(self.ids)
        for layer in getattr(self.cache, "layers", []):
            keys = getattr(layer, "keys", None)
            if keys is not None and keys.dim() == 4 and keys.shape[-2] > keep:
                layer.keys, layer.values = keys[..., :keep, :], layer.values[..., :keep, :]

    def crop(self, n: int) -> None:
        if n < len(self.ids):
            self.cache.crop(n - len(self.ids))   # negative = tokens to drop (transformers >= 5.2x refuses positive)
            del self.ids[n:]

    def release(self, keep_pages: bool = True) -> None:
        self.cache = None
        self.ids = []
        super().release()


class TieredSession(KVSession):
    """flashguard's TieredCache over the engine's PageStore."""

    kind = "tiered"

    def __init__(self, model, cache_config, store, model_id: str, preallocate: bool, pool=None) -> None:
        from .cache import TieredCache

        super().__init__()
        self.store = store
        self.cache = TieredCache(model.config, cache_config, store=store, model_id=model_id,
                                 preallocate=preallocate, pool=pool).attach(model)

    def adopt(self, ids: Sequence[int], dtype, device) -> int:
        reused = self.cache.adopt_prefix(ids, dtype, device)
        self.ids = [int(t) for t in ids[:reused]]
        return reused

    def _begin(self, tokens: list[int], private: bool = False) -> None:
        self.cache.begin(tokens, start=len(self.ids), private=private)

    def _end(self) -> None:
        self.cache.end()

    def leaving(self, tokens: int) -> int:
        return self.cache.tokens_leaving(tokens)

    def undo(self) -> None:
        keep = len(self.ids)
        self.cache.undo_to(keep)
        del self.cache.token_ids[keep:]

    def crop(self, n: int) -> None:
        if n < len(self.ids):
            self.cache.crop_to(n)
            del self.ids[n:]

    def release(self, keep_pages: bool = True) -> None:
        if not self.released:
            self.cache.release(keep_pages=keep_pages)
        self.ids = []
        super().release()

    def references(self) -> int:
        return sum(self.cache.stored)

    def stats(self) -> dict:
        return {**super().stats(), **self.cache.stats()}
