"""``plant``: a bug in no catalogue, patched into a copy of pcpviz for the tour and notebook 04."""

from __future__ import annotations

import pytest

from pcpviz.analysis.mutations import MUTATIONS, PLANTED_MARK, main, plant


def test_plant_patches_a_copy_and_replaces_only_an_earlier_planted_copy(tmp_path):
    m = next(m for m in MUTATIONS if m.name == "draft_prefill_hidden_shifted")
    root = plant(m.name, tmp_path / "p")
    src = (root / "pcpviz" / m.file).read_text()
    assert m.new in src and (root / "data" / "models").is_dir()
    assert (root / PLANTED_MARK).read_text().strip() == m.name
    with pytest.raises(ValueError, match="not empty"):
        plant(m.name, root)
    other = MUTATIONS[0]
    plant(other.name, root, overwrite=True)
    assert other.new in (root / "pcpviz" / other.file).read_text()
    assert m.new not in (root / "pcpviz" / m.file).read_text()  # the earlier bug is gone
    assert (root / PLANTED_MARK).read_text().strip() == other.name


def test_plant_never_replaces_a_directory_it_did_not_write(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (mine / PLANTED_MARK).write_text("x")  # even with the mark, a foreign file keeps it safe
    with pytest.raises(ValueError, match="not empty"):
        plant(MUTATIONS[0].name, mine, overwrite=True)
    assert (mine / "notes.txt").read_text() == "keep"


def test_the_command_line_fails_with_one_line(tmp_path, capsys):
    assert main(["no_such_bug", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown mutation 'no_such_bug'" in err
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(m.name in out for m in MUTATIONS)
