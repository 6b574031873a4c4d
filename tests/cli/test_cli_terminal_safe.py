"""Text from a trace (request ids, prompts, file names) reaches the terminal as text: a control
sequence or a bidirectional override in it is printed as an escape, never acted on."""

from __future__ import annotations

import subprocess
import sys

from pcpviz.synthetic import RequestSpec, generate

HOSTILE = ("a\x1b[2J\x1b]0;pwned\x07", "b\u202eevil\r")


def _traces(tmp_path):
    for name, p in (("a", 0.7), ("b", 0.2)):
        generate([RequestSpec(HOSTILE[0], 12, 3), RequestSpec(HOSTILE[1], 9, 3)], pcp=2,
                 num_speculative_tokens=2, accept_prob=p).write(tmp_path / name)
    return tmp_path / "a", tmp_path / "b"


def test_request_ids_with_control_characters_are_printed_escaped(tmp_path):
    a, b = _traces(tmp_path)
    for args in (["diff", str(a), str(b)], ["explain", str(b), str(a)], ["check", str(a)]):
        r = subprocess.run([sys.executable, "-m", "pcpviz.cli", *args], capture_output=True, text=True, timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode in (0, 1) and "Traceback" not in out, (args, out[-2000:])
        assert not any(c in out for c in "\x1b\x07\r\u202e"), (args, [c for c in "\x1b\x07\r\u202e" if c in out])
        if args[0] == "diff":
            assert "b\\u202eevil\\x0d" in r.stdout  # the id is shown, escaped


def test_terminal_safe_keeps_tabs_newlines_and_ordinary_unicode():
    from pcpviz.cli.guard import terminal_safe

    assert terminal_safe("x\ty\nz · ✓ é") == "x\ty\nz · ✓ é"
    assert terminal_safe("\x00\x08\x7f\x9b\u200b\u2066") == "\\x00\\x08\\x7f\\x9b\\u200b\\u2066"
