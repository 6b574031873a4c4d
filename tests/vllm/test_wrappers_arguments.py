"""The propose wrapper reads its arguments without ``inspect.Signature.bind`` on every call
(``recording.wrappers._arguments``): it must find what ``bind`` finds, and refuse what it refuses,
on vLLM 0.33.0's own ``propose`` signatures and on any call shape."""

from __future__ import annotations

import inspect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from pcpviz.vllm.recording.wrappers import _arguments  # noqa: E402

NAMES = ("input_batch", "dummy_run", "last_hidden_states")


def _speculators() -> list:
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import TargetDependentARSpeculator

    out = [TargetDependentARSpeculator.propose]
    try:
        from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

        out.append(DFlashSpeculator.propose)
    except ImportError:
        pass
    return out


def _expected(sig: inspect.Signature, args: tuple, kwargs: dict):
    try:
        b = sig.bind("self", *args, **kwargs)
    except TypeError:
        return TypeError
    return tuple(b.arguments.get(n, sig.parameters[n].default if n in sig.parameters else None) for n in NAMES)


def _got(read, args: tuple, kwargs: dict):
    try:
        return read("self", args, kwargs)
    except TypeError:
        return TypeError


@pytest.mark.parametrize("fn", _speculators(), ids=lambda f: f.__qualname__)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_arguments_read_are_those_bind_finds(fn, data):
    sig = inspect.signature(fn)
    read = _arguments(sig, NAMES)
    params = list(sig.parameters)[1:]
    npos = data.draw(st.integers(0, len(params) + 1))
    args = tuple(f"pos{i}" for i in range(npos))
    names = data.draw(st.lists(st.sampled_from([*params, "not_a_parameter"]), unique=True, max_size=6))
    kwargs = {n: f"kw-{n}" for n in names}
    assert _got(read, args, kwargs) == _expected(sig, args, kwargs)


def test_a_call_as_vllm_makes_it_reads_the_batch_and_the_dummy_flag():
    fn = _speculators()[0]
    sig = inspect.signature(fn)
    required = [p for p in list(sig.parameters.values())[1:] if p.default is inspect.Parameter.empty]
    args = tuple(f"v-{p.name}" for p in required)
    read = _arguments(sig, NAMES)
    assert read("self", args, {"dummy_run": True}) == ("v-input_batch", True, "v-last_hidden_states")
    assert read("self", args, {}) == ("v-input_batch", False, "v-last_hidden_states")
