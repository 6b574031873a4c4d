"""Repeated JSON stored once: ``pack`` and ``unpack`` (the HTML report's embedded data).

The figures of consecutive steps repeat most of their JSON: a stepped colorscale per heatmap,
the template, axes, the hover texts of requests whose rows did not change. ``pack`` replaces every
subtree or string that occurs more than once and is at least ``min_chars`` long as JSON by
``{"$r": i}``, with ``shared[i]`` holding it once (itself packed); ``unpack`` inverts it, and the
page's script does the same in the browser. On the shipped PCP=2 traces this takes the embedded
data from ~5 MB to under 1 MB.

Two passes. The first writes every dict's and list's JSON text (``json.dumps``'s, with ``(",",
":")`` separators) bottom-up and counts each text, and counts strings by value; the second
rebuilds the object, putting a reference where a counted text or string occurs twice or more,
``shared`` in the order the second pass first meets them. Lists of numbers alone and lists of
strings alone are the bulk of a figure (coordinates, hover-text rows): their text is one C call,
their strings are counted with one ``Counter.update``, and the second pass copies such a list
whole unless it holds a repeated string (one ``set.isdisjoint``).
"""

from __future__ import annotations

import json
from collections import Counter
from hashlib import blake2b
from json.encoder import encode_basestring_ascii as _quote
from typing import Any, Sequence

__all__ = ["pack", "unpack", "Packer", "SHARE_MIN_CHARS"]

SHARE_MIN_CHARS = 24
"""Subtrees (and strings) whose JSON is at least this long are stored once when they repeat."""

_SCALARS = frozenset({int, float, bool, type(None)})
_STR = frozenset({str})
_INT = frozenset({int})
_SHORT = 33
"""Tokens up to this long are the JSON text itself (a digest token is 33 characters)."""
_encode = json.JSONEncoder(separators=(",", ":")).encode


def pack(obj: Any, *, min_chars: int = SHARE_MIN_CHARS) -> tuple[Any, list]:
    """``(packed, shared)``: ``obj`` (JSON values) with every subtree or string that occurs more
    than once and is at least ``min_chars`` long as JSON replaced by ``{"$r": i}``, where
    ``shared[i]`` holds it once (itself packed).

    ``pack({"a": [1, 2, 3], "b": [1, 2, 3]}, min_chars=5)`` ->
    ``({"a": {"$r": 0}, "b": {"$r": 0}}, [[1, 2, 3]])``;
    ``pack(["a long hover text", "a long hover text", "x"], min_chars=5)`` ->
    ``([{"$r": 0}, {"$r": 0}, "x"], ["a long hover text"])``.
    """
    return Packer(min_chars=min_chars).pack(obj)


class Packer:
    """``pack`` in two calls, so that its first pass over the parts of an object can run while the
    rest is still being made: ``add(part)`` walks a part now, ``pack(obj)`` walks the rest and
    gives what ``pack(obj)`` gives. Each added part must occur in ``obj`` (else ``pack`` raises),
    unchanged since it was added; ``obj`` may hold it more than once.

    ``p = Packer(min_chars=5); p.add(row); p.pack({"a": row, "b": row})`` is
    ``pack({"a": row, "b": row}, min_chars=5)``.
    """

    def __init__(self, *, min_chars: int = SHARE_MIN_CHARS) -> None:
        self.texts = _Texts(min_chars)

    def add(self, part: dict | list) -> None:
        """Walk ``part`` (a dict or list of ``obj``) now."""
        if id(part) in self.texts.seen:
            raise ValueError("Packer.add: this part was walked already")
        self.texts.key(part)
        self.texts.early.add(id(part))

    def pack(self, obj: Any) -> tuple[Any, list]:
        """``pack(obj)``'s ``(packed, shared)``."""
        texts = self.texts
        texts.key(obj)
        if texts.early:
            raise ValueError(f"Packer.pack: {len(texts.early)} added part(s) not in the object packed")
        texts.count_again()
        return _Rebuild(texts).run(obj)


class _Texts:
    """The first pass: each container's token by ``id`` (those whose JSON text is at least
    ``min_chars`` long), how often each token occurs, how often each string occurs, and which lists
    hold no container.

    A container's token stands for its JSON text without holding it: the text itself when that is
    short, else ``"\\x00"`` and a 128-bit BLAKE2b digest of the text in which every child
    container's text is replaced by the child's token. Equal texts give equal tokens and (but for a
    digest collision, ~2^-64 for a billion tokens) unequal texts unequal ones: ``\\x00`` never
    occurs in JSON text, and a token's digest has a fixed length. Holding the texts themselves
    cost more memory than the figures (540 MiB of texts for 300 MiB of figures at PCP=64).

    A container met again (the same object, as figures sharing their parts hold it: at PCP=64 a
    step's token order on each of its ranks) is not walked again: its token is counted once more,
    and ``count_again`` then counts once more every container and string under it, which is all
    the second pass asks of the counts (whether one is above 1)."""

    def __init__(self, min_chars: int) -> None:
        self.min_chars = min_chars
        self.key_of: dict[int, str] = {}
        self.counts: dict[str, int] = {}
        self.strs: Counter[str] = Counter()
        self.flat: set[int] = set()  # lists of numbers alone or of strings alone
        self.keep: list[Any] = []  # holds every keyed object alive so its id() stays unique
        self.seen: dict[int, tuple[str, int]] = {}  # id of every container walked -> key()'s answer
        self.again: list[Any] = []  # the containers met more than once, each time after the first
        self.early: set[int] = set()  # parts walked ahead (Packer.add) and not yet met in the object

    def count_again(self) -> None:
        """Count once more every container (its token) and string under a container met again,
        each at most once: then a count is above 1 exactly where walking every occurrence would
        have made it so. ``strs`` counts strings where ``key`` does: dict values and list items."""
        visited: set[int] = set()
        stack = self.again
        while stack:
            o = stack.pop()
            for v in (o.values() if type(o) is dict else o):
                tv = type(v)
                if tv is str:
                    self.strs[v] += 1
                elif (tv is dict or tv is list) and id(v) not in visited:
                    visited.add(id(v))
                    k = self.key_of.get(id(v))
                    if k is not None:
                        self.counts[k] += 1
                    if id(v) not in self.flat:
                        stack.append(v)
                    elif v and type(v[0]) is str:
                        self.strs.update(v)

    def _token(self, o: Any, text: str, n: int) -> str:
        """``o``'s token from ``text`` (its JSON text with child containers as tokens) and its JSON
        text's length ``n``; counted when ``n`` reaches ``min_chars``."""
        k = text if len(text) <= _SHORT else "\x00" + blake2b(text.encode(), digest_size=16).hexdigest()
        if n >= self.min_chars:
            self.counts[k] = self.counts.get(k, 0) + 1
            self.key_of[id(o)] = k
            self.keep.append(o)
        return k

    def key(self, o: Any) -> tuple[str, int]:
        """``(token, length of o's JSON text)`` (``json.dumps``'s text, with its separators)."""
        t = type(o)
        if t is str:
            self.strs[o] += 1
            q = _quote(o)
            return q, len(q)
        if t is dict or t is list:
            got = self.seen.get(id(o))
            if got is not None:  # met again: counted, what is under it by count_again
                if id(o) in self.early:  # walked ahead (Packer.add): this is the meeting it counted
                    self.early.discard(id(o))
                elif got[1] >= self.min_chars:
                    self.counts[got[0]] += 1
                    self.again.append(o)
                return got
            got = self.seen[id(o)] = self._dict(o) if t is dict else self._list(o)
            return got
        text = json.dumps(o)
        return text, len(text)

    def _dict(self, o: dict) -> tuple[str, int]:
        parts, n = [], 1 + 2 * len(o)  # the braces, the colons and the commas (none in {})
        for name, v in o.items():
            tv = type(v)
            if tv is str:
                self.strs[v] += 1
                vk = _quote(v)
                vn = len(vk)
            elif tv is int:
                vk = int.__repr__(v)
                vn = len(vk)
            else:
                vk, vn = self.key(v)
            nk = _quote(name) if type(name) is str else json.dumps(name)
            parts.append(nk + ":" + vk)
            n += len(nk) + vn
        text = "{" + ",".join(parts) + "}"
        return self._token(o, text, n + (0 if o else 1)), n + (0 if o else 1)

    def _list(self, o: list) -> tuple[str, int]:
        kinds = set(map(type, o))
        if kinds == _INT:  # integers alone (most coordinates): their text without the encoder
            text = "[" + ",".join(map(int.__repr__, o)) + "]"
        elif kinds <= _SCALARS:  # numbers alone: no part of it is shared on its own
            text = _encode(o)
        elif kinds == _STR:
            self.strs.update(o)
            text = "[" + ",".join(map(_quote, o)) + "]"
        else:
            keys = [self.key(v) for v in o]
            n = 1 + max(len(o), 1) + sum(vn for _, vn in keys)
            return self._token(o, "[" + ",".join([vk for vk, _ in keys]) + "]", n), n
        self.flat.add(id(o))
        return self._token(o, text, len(text)), len(text)


class _Rebuild:
    """The second pass: ``o`` with references to ``shared`` where a text or string repeats."""

    def __init__(self, texts: _Texts) -> None:
        self.t = texts
        self.index: dict[str, int] = {}
        self.shared: list[Any] = []
        self.multi = {s for s, c in texts.strs.items() if c > 1 and len(_quote(s)) >= texts.min_chars}

    def run(self, obj: Any) -> tuple[Any, list]:
        return self.inner(obj), self.shared

    def _ref(self, k: str, make: Any) -> dict:
        i = self.index.get(k)
        if i is None:
            i = self.index[k] = len(self.shared)
            self.shared.append(None)
            self.shared[i] = make()
        return {"$r": i}

    def rep(self, o: Any) -> Any:
        if type(o) is str:
            return self._ref(_quote(o), lambda: o) if o in self.multi else o
        k = self.t.key_of.get(id(o))
        if k is not None and self.t.counts[k] > 1:
            return self._ref(k, lambda: self.inner(o))
        return self.inner(o)

    def inner(self, o: Any) -> Any:
        if isinstance(o, dict):
            return {n: self.rep(v) for n, v in o.items()}
        if isinstance(o, list):
            if id(o) in self.t.flat and not (o and type(o[0]) is str and not self.multi.isdisjoint(o)):
                return o[:]  # numbers alone, or strings none of which repeats
            return [self.rep(v) for v in o]
        return o


def unpack(packed: Any, shared: Sequence[Any]) -> Any:
    """``obj`` again from ``pack``'s ``(packed, shared)``."""
    if isinstance(packed, list):
        return [unpack(v, shared) for v in packed]
    if isinstance(packed, dict):
        if len(packed) == 1 and isinstance(packed.get("$r"), int):
            return unpack(shared[packed["$r"]], shared)
        return {n: unpack(v, shared) for n, v in packed.items()}
    return packed
