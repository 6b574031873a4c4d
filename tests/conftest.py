"""Session set-up shared by every test module.

Tests mirror the package's stages, one directory each (``tests/reference``, ``trace``, ``engine``,
``vllm``, ``analysis``, ``views``, ``teaching``, ``cli``, ``costmodel``, ``repo``); a tier is a
directory (``pytest tests/analysis``) or a marker (``-m "not slow"``: what ``make test-fast``
runs; ``-m gpu``: the GPU tier, deselected on machines without one). The vLLM patches for CPU
are applied only by the directories that drive real vLLM code (their own conftest).
"""

import json

import pytest


def _gpu_tier(config) -> bool:
    return "gpu" in (config.getoption("markexpr", "") or "")


def pytest_collection_modifyitems(config, items):
    """Deselect the GPU tier (marker ``gpu``) unless it was asked for: CI has no GPU. On the GPU
    machine: ``pytest -m gpu`` (the normal conftest)."""
    if _gpu_tier(config):
        return
    keep = [i for i in items if i.get_closest_marker("gpu") is None]
    dropped = [i for i in items if i.get_closest_marker("gpu") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


class _WidgetMessages:
    """Every message a widget sent to the front end while the test ran: ``sent`` as
    (widget class, message); ``not_json()`` the ones jupyter_client cannot pack as strict JSON
    (a NaN or inf: the kernel prints "Out of range float values are not JSON compliant" under
    the cell)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    def not_json(self) -> list[str]:
        from jupyter_client.jsonutil import json_default

        bad = []
        for name, msg in self.sent:
            try:
                json.dumps(msg, default=json_default, allow_nan=False)
            except ValueError as e:
                bad.append(f"{name} {sorted(msg.get('state', {}))}: {e}")
        return bad


@pytest.fixture()
def widget_messages(monkeypatch):
    import ipywidgets

    rec = _WidgetMessages()
    orig = ipywidgets.Widget._send

    def send(self, msg, buffers=None):
        rec.sent.append((type(self).__name__, msg))
        return orig(self, msg, buffers)

    monkeypatch.setattr(ipywidgets.Widget, "_send", send)
    return rec
