"""``planted`` replaces a vLLM function for the duration of a ``with`` block and puts back exactly
what was there: a plain function, a method, or a staticmethod (``PCPManager._reorder_segments``),
which must stay a staticmethod after the block (the replay calls it through ``self``)."""

from __future__ import annotations

import sys
import types

from pcpviz.analysis.vllm_mutations import VllmMutation, planted


class _Owner:
    @staticmethod
    def order(xs):
        return sorted(xs)

    def scale(self, x):
        return 2 * x


def _module():
    mod = types.ModuleType("pcpviz_test_planted")
    mod.Owner = _Owner
    sys.modules[mod.__name__] = mod
    return mod


def _reversed(real):
    def buggy(xs):
        return list(reversed(real(xs)))
    return buggy


def test_a_staticmethod_is_planted_and_put_back_as_a_staticmethod():
    mod = _module()
    m = VllmMutation("t", mod.__name__, "Owner.order", "Owner.order", "target", "segments", "test", _reversed)
    with planted(m):
        assert _Owner().order([2, 1, 3]) == [3, 2, 1]  # called through an instance, as vLLM does
    assert isinstance(vars(_Owner)["order"], staticmethod)
    assert _Owner().order([2, 1, 3]) == [1, 2, 3]


def test_a_method_is_planted_and_put_back():
    mod = _module()
    m = VllmMutation("t", mod.__name__, "Owner.scale", "Owner.scale", "target", "segments", "test",
                     lambda real: lambda self, x: real(self, x) + 1)
    with planted(m):
        assert _Owner().scale(3) == 7
    assert _Owner().scale(3) == 6 and vars(_Owner)["scale"] is _Owner.__dict__["scale"]
