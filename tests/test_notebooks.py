"""Every notebook in notebooks/ executes headless, top to bottom, on CPU.

A cell that raises fails the test with the notebook and cell named. Notebooks are
stored without outputs (checked here too), so diffs stay reviewable.
"""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert any(p.name == "01_pcp_layout.ipynb" for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    monkeypatch.setenv("PCPVIZ_NOTEBOOK_TEST", "1")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name}: {str(e).splitlines()[-1] if str(e) else e}")
    # the widget cells produced a widget view, not an error
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    if "pcpviz.widgets" in "".join(c.source for c in nb.cells):
        views = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
        assert views, f"{path.name}: a widget cell rendered no widget view"
