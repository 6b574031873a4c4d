"""An interactive PCP batch builder: type prompt and decode lengths, pick the PCP
size and decode mode, and watch the DualChunkSwap lanes, the gather/restore maps
and the KV write mask change.

    from pcpviz.views.widgets import LayoutBuilder
    LayoutBuilder(prompts="13, 7", decodes="1, 4", pcp=2)
"""

from __future__ import annotations

import html

import ipywidgets as W
import plotly.graph_objects as go

from pcpviz.reference.batch import order_batch
from pcpviz.views.diagram import render_layout
from pcpviz.views.figures.layout import layout_figure
from pcpviz.reference.layout import PCPLayout, plan_layout

__all__ = ["LayoutBuilder", "parse_lengths"]


def parse_lengths(text: str, what: str) -> list[int]:
    """``"13, 7"`` -> [13, 7]; raises ValueError naming the field and the bad entry."""
    out = []
    for part in text.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not a whole number") from None
        if value < 0:
            raise ValueError(f"{what}: {value} is negative")
        out.append(value)
    return out


class LayoutBuilder(W.VBox):
    """Controls + figure + text diagram. ``.pcp_layout`` is the current ``PCPLayout``."""

    def __init__(self, prompts: str = "13", decodes: str = "1, 4", pcp: int = 2,
                 decode_mode: str = "sharded", dcp: int = 1, show_text: bool = True) -> None:
        style = {"description_width": "120px"}
        self.prompts = W.Text(value=prompts, description="prefill lengths", style=style,
                              continuous_update=False)
        self.decodes = W.Text(value=decodes, description="decode queries", style=style,
                              placeholder="1 = no drafts, 1+K with K drafts", continuous_update=False)
        self.pcp = W.IntSlider(value=pcp, min=1, max=8, description="PCP size", style=style)
        self.decode_mode = W.ToggleButtons(options=["sharded", "replicated"], value=decode_mode,
                                           description="decodes", style=style)
        self.dcp = W.Dropdown(options=[("1", 1), ("= PCP", -1)], value=1 if dcp == 1 else -1,
                              description="DCP", style=style)
        self.highlight = W.Dropdown(options=[("none", -1)], value=-1, description="highlight", style=style)
        self.status = W.HTML()
        self.text = W.HTML()
        self.figure = go.FigureWidget()
        self.pcp_layout: PCPLayout | None = None
        self.req_names: list[str] = []
        for control in (self.prompts, self.decodes, self.pcp, self.decode_mode, self.dcp, self.highlight):
            control.observe(self._on_change, names="value")
        children = [
            W.HBox([W.VBox([self.prompts, self.decodes]), W.VBox([self.pcp, self.dcp])]),
            W.HBox([self.decode_mode, self.highlight]),
            self.status,
            self.figure,
        ]
        if show_text:
            children.append(self.text)
        super().__init__(children)
        self.update()

    def _on_change(self, _change) -> None:
        self.update()

    def batch(self) -> tuple[list[int], list[bool], list[str]]:
        """The global batch in vLLM's row order (``pcpviz.reference.batch.order_batch``)."""
        return order_batch(parse_lengths(self.prompts.value, "prefill lengths"),
                           parse_lengths(self.decodes.value, "decode queries"))

    def update(self) -> None:
        try:
            q, prefill, names = self.batch()
            dcp = self.pcp.value if self.dcp.value == -1 else 1
            layout = plan_layout(q, prefill, self.pcp.value,
                                 shard_decode_requests=self.decode_mode.value == "sharded",
                                 dcp_world_size=dcp)
        except ValueError as e:
            self.status.value = f"<b style='color:#b00'>invalid batch:</b> {html.escape(str(e))}"
            return
        self.pcp_layout, self.req_names = layout, names
        options = [("none", -1)] + [(n, i) for i, n in enumerate(names)]
        if list(self.highlight.options) != options:
            keep = self.highlight.value if self.highlight.value < len(names) else -1
            with self.highlight.hold_trait_notifications():
                self.highlight.options = options
                self.highlight.value = keep
        hl = None if self.highlight.value < 0 else self.highlight.value
        fig = layout_figure(layout, names, highlight_req=hl)
        with self.figure.batch_update():
            self.figure.data = ()
            self.figure.layout = {}
            self.figure.add_traces(fig.data)
            self.figure.layout = fig.layout
        self.status.value = (
            f"rows in vLLM order: {', '.join(f'{n}({x})' for n, x in zip(names, q))} — "
            f"T={layout.num_tokens}, P={layout.padded_num_tokens}, per-rank {list(layout.per_rank_num_tokens)}"
        )
        self.text.value = f"<pre style='font-size:11px'>{html.escape(render_layout(layout, names))}</pre>"
