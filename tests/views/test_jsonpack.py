"""``pcpviz.views.export.jsonpack.pack`` against the plain reference it replaces.

The reference below is the definition: count every subtree's and string's JSON text, and put a
reference wherever a text at least ``min_chars`` long occurs twice or more, ``shared`` in the order
a pre-order walk meets them. The library's ``pack`` counts strings by value, copies flat lists
whole and keys containers by tokens (a digest instead of a long text); its output must be the
reference's, value for value, on any JSON value.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as quote

from hypothesis import given, settings
from hypothesis import strategies as st

from pcpviz.views.export.jsonpack import _Texts, pack, unpack


def reference_pack(obj, *, min_chars):
    key_of, counts, keep = {}, {}, []

    def key(o):
        if isinstance(o, str):
            k = quote(o)
        elif isinstance(o, dict):
            k = "{" + ",".join((quote(n) if isinstance(n, str) else json.dumps(n)) + ":" + key(v)
                               for n, v in o.items()) + "}"
        elif isinstance(o, list):
            k = "[" + ",".join(key(v) for v in o) + "]"
        else:
            return json.dumps(o)
        assert k == json.dumps(o, separators=(",", ":"))  # the text is json.dumps's
        if len(k) >= min_chars:
            counts[k] = counts.get(k, 0) + 1
            key_of[id(o)] = k
            keep.append(o)
        return k

    key(obj)
    index, shared = {}, []

    def rep(o):
        k = key_of.get(id(o))
        if k is not None and counts[k] > 1:
            if k not in index:
                index[k] = len(shared)
                shared.append(None)
                shared[index[k]] = inner(o)
            return {"$r": index[k]}
        return inner(o)

    def inner(o):
        if isinstance(o, dict):
            return {n: rep(v) for n, v in o.items()}
        if isinstance(o, list):
            return [rep(v) for v in o]
        return o

    return inner(obj), shared


def _not_a_ref(d: dict) -> bool:
    """A figure never holds ``{"$r": <int>}`` alone (its keys are plotly's): the one dict ``unpack``
    reads as a reference."""
    return not (len(d) == 1 and isinstance(d.get("$r"), int))


# Few distinct leaves, so that subtrees repeat; strings with markup, quotes and non-ASCII text.
_text = st.sampled_from(["", "a", "pad", "req0 · chunk 3<br>global token 18–22", 'say "hi"\n', "x" * 30,
                         "[1,2]", "{}", "\u0000 nul", "é" * 12])
_leaf = st.one_of(st.integers(-3, 3), st.sampled_from([0.5, -1.25, 1e300, True, False, None]), _text)
_json = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=5),
    st.dictionaries(st.sampled_from(["x", "y", "z", "$r", "hovertext"]), inner, max_size=4).filter(_not_a_ref)),
    max_leaves=40)


def _subtrees(o):
    yield o
    for v in (o.values() if isinstance(o, dict) else o if isinstance(o, list) else ()):
        yield from _subtrees(v)


@settings(max_examples=400, deadline=None)
@given(_json, st.integers(1, 80))
def test_pack_is_the_reference_pack(obj, min_chars):
    for sub in _subtrees(obj):  # the length a token stands for is its JSON text's (the share threshold)
        assert _Texts(min_chars).key(sub)[1] == len(json.dumps(sub, separators=(",", ":")))
    doubled = [obj, obj, {"again": obj}]  # the same object at several places, and equal copies
    doubled.append(json.loads(json.dumps(obj)))
    for value in (obj, doubled):
        got = pack(value, min_chars=min_chars)
        assert got == reference_pack(value, min_chars=min_chars)
        assert json.dumps(got) == json.dumps(reference_pack(value, min_chars=min_chars))
        assert unpack(*got) == value


def test_equal_texts_share_whatever_the_container_depth():
    row = {"hovertext": ["req0 · chunk 3<br>global token 18–22"] * 3, "z": [[1, 2], [3, None]]}
    obj = {"a": [row, {"deep": [row]}], "b": json.loads(json.dumps(row))}
    packed, shared = pack(obj, min_chars=24)
    assert (packed, shared) == reference_pack(obj, min_chars=24)
    assert unpack(packed, shared) == obj
    assert len([s for s in shared if s == unpack(s, shared) and isinstance(s, dict)]) <= len(shared)
    assert packed["b"] == packed["a"][0]  # the row is stored once: every place refers to it
