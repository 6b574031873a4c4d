"""Session set-up shared by every test module.

The conformance tier drives the real vLLM 0.33.0 on CPU: vLLM's worker modules must be first
imported under ``pcpviz.vllm.cpu_patches`` (Triton kernels interpreted). Applying the patches
once, here, makes the outcome independent of test order; they change vLLM's own objects only
and leave the process environment as it was (``cpu_environment()`` is scoped), so no GPU is
hidden from the other tests. A session that selects the GPU tier (``-m gpu``) skips them.
"""

import json

import pytest


def _gpu_tier(config) -> bool:
    return "gpu" in (config.getoption("markexpr", "") or "")


def pytest_configure(config):
    if not _gpu_tier(config):
        from pcpviz.vllm import cpu_patches

        cpu_patches.apply_cpu_patches()


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
