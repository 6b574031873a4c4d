"""Every notebook in notebooks/ executes headless, top to bottom, on CPU.

A cell that raises fails the test with the notebook and cell named. Notebooks are
stored without outputs (checked here too), so diffs stay reviewable. Each runs on a
copy in a temporary directory (next to a link to data/), so what it writes (runs/,
HTML reports) never lands in the repository; the workbench notebooks (00, 03, 04)
must not print to stderr.

A notebook whose first run leaves files in its working directory (a trace under runs/, an HTML
report) is then run a second time there, in a fresh kernel, as Restart & Run All would: what the
first run wrote must not break the second (a fixed trace directory needs ``overwrite=True``).
Notebooks that write only into fresh temporary directories (``tempfile.mkdtemp``) leave nothing to
collide with and run once, which keeps the cost of the test down.
"""

import hashlib
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

pytestmark = pytest.mark.slow  # every notebook executed headless

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
QUIET = {"00_quickstart", "03_mtp_draft_steps", "04_acceptance_regression"}  # no stderr in any cell


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_there_are_notebooks():
    assert any(p.name == "01_pcp_layout.ipynb" for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before committing"


def _run_all(path: Path, workdir: Path, attempt: str) -> list[dict]:
    """Execute a fresh copy of the notebook in a new kernel in ``workdir``; its cells' outputs."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(workdir)}})
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name} ({attempt} run): {str(e).splitlines()[-1] if str(e) else e}")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    # the widget cells produced a widget view, not an error
    assert not [o for o in outputs if o.get("output_type") == "error"], f"{path.name} ({attempt} run)"
    if path.stem in QUIET:
        stderr = [o["text"][:300] for o in outputs if o.get("name") == "stderr"]
        assert not stderr, f"{path.name} ({attempt} run): stderr under a cell: {stderr}"
    if "pcpviz.views.widgets" in "".join(c.source for c in nb.cells):
        views = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
        assert views, f"{path.name} ({attempt} run): a widget cell rendered no widget view"
    return outputs


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    monkeypatch.setenv("PCPVIZ_NOTEBOOK_TEST", "1")
    work = tmp_path / "notebooks"
    work.mkdir()
    (tmp_path / "data").symlink_to(REPO / "data", target_is_directory=True)
    before = _tree(REPO / "notebooks")
    _run_all(path, work, "first")
    assert _tree(REPO / "notebooks") == before, f"{path.name} wrote into the repository's notebooks/"
    if _tree(work):  # the first run left files behind: Restart & Run All must cope with them
        _run_all(path, work, "second")
        assert _tree(REPO / "notebooks") == before, f"{path.name} wrote into the repository's notebooks/"
