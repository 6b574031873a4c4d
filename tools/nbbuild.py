"""Write a notebook from a list of ("md"|"code", source) cells, without outputs.

    python tools/nbbuild.py   # not needed by users; notebooks are committed as .ipynb
"""
import nbformat


def write(path, cells):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(s.strip()) if k == "md" else nbformat.v4.new_code_cell(s.strip())
                for k, s in cells]
    nbformat.write(nb, path)
