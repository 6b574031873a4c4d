"""Parts of figures drawn once for several figures (``SharedParts``, ``drawn_part``, ``add_part``).

The HTML report draws a figure per (step, rank) page; at PCP=64 many of a page's strips are the
same on every rank of the step (the global and draft block-table rows, the DCP strips). A figure
that is given a ``SharedParts`` asks ``drawn_part`` for each strip by a ``content_key`` of what it
is drawn from: the first figure draws it (its heatmap trace and label annotations through
``safe_spec`` once), the others get the same objects, and their ``draw_strip`` call is recorded
again (``lod.replay_strip``), so each page is what drawing it alone gives. The export's
``figure_json`` and ``tokens.strips`` then convert those parts once (their memos, ``json`` and
``strips``, for these parts only), and the packer walks them once.

    parts = SharedParts()
    d, heat, labels = drawn_part(parts, ("global rows", table, ...), draw)   # draw() -> the same three
    add_part(fig, (d, heat, labels), (1, 1), parts=parts)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from pcpviz.views.figures.canvas import Canvas, safe_spec
from pcpviz.views.figures.content_key import content_key
from pcpviz.views.figures.lod import Drawn, record_strips, replay_strip

__all__ = ["SharedParts", "drawn_part", "add_part"]


@dataclass(frozen=True)
class SharedParts:
    """Parts of figures drawn once for the figures of one export that draw them alike (PCP=64: a
    step's global and draft block-table rows, the same on every rank's page), by ``content_key``
    of what they are drawn from; and, for them only, the memos of what the export makes of them
    (``figure_json``'s, ``tokens.strips``'), so that every page holds them as one object.

    ``ids``: the ids of the containers the parts hold (kept alive by ``drawn``): the memos keep
    those alone, not every page's figures. ``parts.get(key)`` is None until ``parts.put(key,
    part, containers)``; ``asked`` counts the ``get`` calls (a figure that asked none holds no part)."""

    drawn: dict = field(default_factory=dict)
    ids: set = field(default_factory=set)
    json: dict = field(default_factory=dict)
    strips: dict = field(default_factory=dict)
    asked: list = field(default_factory=lambda: [0])  # how many parts were asked for (``get``)

    def get(self, key: str) -> Any:
        self.asked[0] += 1
        hit = self.drawn.get(key)
        return None if hit is None else hit[0]

    def put(self, key: str, part: Any, containers: Iterable[Any]) -> Any:
        self.drawn[key] = (part, list(containers))
        self.ids.update(map(id, self.drawn[key][1]))
        return part


def drawn_part(parts: SharedParts | None, key: tuple, draw: Callable[[], tuple[Drawn, dict, list]]) -> tuple:
    """``draw()``'s ``(drawn strip, heatmap trace, label annotations)`` (one ``draw_strip`` call);
    with ``parts``, drawn once per ``content_key(*key)`` (``key``: everything ``draw`` reads), the
    trace's containers and the annotations through ``safe_spec`` then, and the call recorded again
    each time the part is used."""
    if parts is None:
        return draw()
    k = content_key(*key)
    hit = parts.get(k)
    if hit is None:
        with record_strips() as calls:
            d, heat, annots = draw()
        if len(calls) != 1:
            raise AssertionError(f"drawn_part: a part draws one strip, not {len(calls)}")
        heat = {n: v if isinstance(v, str) else safe_spec(v) for n, v in heat.items()}
        annots = [safe_spec(a) for a in annots]
        hit = parts.put(k, (d, heat, annots, calls[0]),
                        [*(v for v in heat.values() if not isinstance(v, str)), *annots, calls[0]])
    replay_strip(hit[3])
    return hit[:3]


def add_part(fig: Canvas, part: tuple, cell: tuple[int, int], *, parts: SharedParts | None) -> Drawn:
    """Add ``drawn_part``'s heatmap to ``cell`` (row, column) of ``fig`` and its labels to the
    annotations (telling ``fig`` they went through ``safe_spec`` when ``parts`` drew them); the
    drawn strip."""
    d, heat, annots = part
    fig.add(heat, *cell)
    fig.annotations.extend(annots)
    if parts is not None:
        fig.add_done(*(v for v in heat.values() if not isinstance(v, str)), *annots)
    return d
