"""The design page's diagrams, drawn as SVG from the descriptions below: the three transports, and the collectives of
one training step. ``make docs`` runs it (``python -m launch.docs.diagrams``) and writes docs/transports.svg and
docs/step.svg; tests/test_docs.py checks that the committed files are what it draws.

What they show is docs/design.md's account ("The statistics", "Transports", "The DataParallel exchange", "Uneven
inputs under Join") and syncbn_dist/comm/: one float64 payload per layer forward (``[sum(C), sumsq(C), count]``)
and one backward (``[sum(dy), sum(dy*x_hat), 0]``), each followed by the collective's tag, 2C+6 values either way;
replicas of one process exchange in-process
through replica 0 (``SyncMaster``, the others' ``SlavePipe``), whose master also all-reduces over the process group
when there is one; under ``Join``, a joined rank's listener thread answers each collective with an empty shard while
its main thread answers DDP's.

The output is plain text, the same on every machine: no plotting library, a monospace font, sizes from the labels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple, Sequence
from xml.sax.saxutils import escape

FONT = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', 'Liberation Mono', monospace"
CHAR_W = 0.6  # a monospace glyph's advance, in font sizes
INK, MUTED, PAPER, BOX = "#1f2937", "#6b7280", "#ffffff", "#f3f4f6"
PAYLOAD, CONTROL, DDP = "#3949ab", "#9ca3af", "#e08a00"


class Row(NamedTuple):
    """One collective of the step: who takes part (lane indices), its label, its kind, and notes on lanes."""

    label: str
    lanes: tuple[int, ...]
    kind: str  # "payload", "control" or "ddp"; "section" for a heading row
    notes: tuple[tuple[int, str], ...] = ()


# One DDP training step of a model with two synchronized layers, bn1 then bn2, C channels each, under torch's Join:
# ranks 0 and 1 still have batches, rank 2 has run out. With every rank active there is no lane 3 and no control.
STEP_LANES = ("rank 0", "rank 1", "rank 2:\nlistener", "rank 2:\nmain thread")
_ACTIVE, _SYNC, _DDP = (0, 1), (0, 1, 2), (0, 1, 3)
_ZERO = ((2, "zeros, count 0"),)
STEP_ROWS = (
    Row("forward", (), "section"),
    Row("DDP's own forward collectives", _DDP, "ddp", ((3, "DDP's join hook"),)),
    Row("header: active-rank count (Join only)", _SYNC, "control", ((2, "adds 0"),)),
    Row("control before bn1 (9 float64)", _SYNC, "control"),
    Row("bn1: [sum, sumsq, count, tag], 2C+6 float64", _SYNC, "payload", _ZERO),
    Row("control before bn2 (9 float64)", _SYNC, "control"),
    Row("bn2: [sum, sumsq, count, tag], 2C+6 float64", _SYNC, "payload", _ZERO),
    Row("backward", (), "section"),
    Row("control before bn2 (9 float64)", _SYNC, "control"),
    Row("bn2: [sum dy, sum dy*x_hat, 0, tag], 2C+6 float64", _SYNC, "payload", _ZERO),
    Row("DDP: gradient bucket all_reduce", _DDP, "ddp", ((3, "DDP's join hook"),)),
    Row("control before bn1 (9 float64)", _SYNC, "control"),
    Row("bn1: [sum dy, sum dy*x_hat, 0, tag], 2C+6 float64", _SYNC, "payload", _ZERO),
    Row("DDP: gradient bucket all_reduce", _DDP, "ddp", ((3, "DDP's join hook"),)),
)
STEP_LEGEND = (
    (PAYLOAD, "syncbn_dist's payload: one all_reduce per layer and direction, whatever the world size"),
    (CONTROL, "Join's controls: the header in every forward under Join; one before each payload while a rank has"),
    (None, "joined (then the joined rank's listener thread answers with an empty shard: zeros, count 0)"),
    (DDP, "DistributedDataParallel's own collectives (weight and bias gradients are DDP's, as for nn.BatchNorm)"),
)


class Panel(NamedTuple):
    """One transport: processes, each holding replicas of the layer."""

    title: str
    subtitle: str
    processes: int
    replicas: int


TRANSPORTS = (
    Panel('"distributed"', "processes (DDP, FSDP2)", 2, 1),
    Panel('"dataparallel"', "nn.DataParallel replicas", 1, 3),
    Panel('"dataparallel", both', "replicas in every process", 2, 2),
)


def _text(x: float, y: float, text: str, size: float = 12, fill: str = INK, anchor: str = "start",
          weight: str = "normal") -> str:
    lines = text.split("\n")
    spans = "".join(
        f'<tspan x="{x:g}" dy="{0 if i == 0 else size * 1.2:g}">{escape(line)}</tspan>' for i, line in enumerate(lines)
    )
    return (f'<text x="{x:g}" y="{y:g}" font-size="{size:g}" fill="{fill}" text-anchor="{anchor}" '
            f'font-weight="{weight}">{spans}</text>')


def _width(text: str, size: float = 12) -> float:
    return max(len(line) for line in text.split("\n")) * size * CHAR_W


def _svg(width: float, height: float, title: str, body: Sequence[str]) -> str:
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:g}" height="{height:g}" '
        f'viewBox="0 0 {width:g} {height:g}" font-family="{escape(FONT, {chr(39): "&apos;"})}" role="img">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{width:g}" height="{height:g}" fill="{PAPER}"/>',
        *body,
        "</svg>",
        "",
    ])


def step_svg(lanes: Sequence[str] = STEP_LANES, rows: Sequence[Row] = STEP_ROWS) -> str:
    """The step as a sequence diagram: a lane per rank (or thread), a row per collective, a dot per member."""
    margin, row_h, lane_w = 16, 30, 112
    label_w = max(_width(row.label) for row in rows) + 24
    head_h = 44
    x0 = margin + label_w
    lane_x = [x0 + lane_w * (i + 0.5) for i in range(len(lanes))]
    legend_h = 18 * len(STEP_LEGEND) + 16
    height = margin + head_h + row_h * len(rows) + 12 + legend_h
    width = x0 + lane_w * len(lanes) + margin
    body = []
    top, bottom = margin + head_h, margin + head_h + row_h * len(rows)
    for x, name in zip(lane_x, lanes):
        body.append(_text(x, margin + 12, name, 12, INK, "middle", "bold"))
        body.append(f'<line x1="{x:g}" y1="{top - 6:g}" x2="{x:g}" y2="{bottom:g}" stroke="{CONTROL}" '
                    'stroke-dasharray="2 4"/>')
    colour = {"payload": PAYLOAD, "control": CONTROL, "ddp": DDP}
    for index, row in enumerate(rows):
        y = top + row_h * index + row_h / 2
        if row.kind == "section":
            body.append(_text(margin, y + 5, row.label, 13, INK, "start", "bold"))
            body.append(f'<line x1="{margin + _width(row.label, 13) + 8:g}" y1="{y:g}" x2="{width - margin:g}" '
                        f'y2="{y:g}" stroke="{BOX}" stroke-width="2"/>')
            continue
        stroke = colour[row.kind]
        body.append(_text(x0 - 12, y + 4, row.label, 12, INK if row.kind != "control" else MUTED, "end"))
        xs = [lane_x[lane] for lane in row.lanes]
        dash = ' stroke-dasharray="5 3"' if row.kind == "control" else ""
        body.append(f'<line x1="{min(xs):g}" y1="{y:g}" x2="{max(xs):g}" y2="{y:g}" stroke="{stroke}" '
                    f'stroke-width="{3 if row.kind == "payload" else 2}"{dash}/>')
        for x in xs:
            body.append(f'<circle cx="{x:g}" cy="{y:g}" r="5" fill="{stroke}"/>')
        for lane, note in row.notes:
            body.append(_text(lane_x[lane], y + 15, note, 10, MUTED, "middle"))
    y = bottom + 12 + 14
    for fill, line in STEP_LEGEND:
        if fill is not None:
            body.append(f'<rect x="{margin:g}" y="{y - 9:g}" width="14" height="4" fill="{fill}"/>')
        body.append(_text(margin + 22, y, line, 11, INK))
        y += 18
    return _svg(width, height, "The collectives of one training step under torch's Join", body)


def transports_svg(panels: Sequence[Panel] = TRANSPORTS) -> str:
    """The three transports side by side: process boxes holding replica boxes, and what each member sends."""
    margin, gap, panel_w, link_h = 30, 40, 268, 64
    replica_h, replica_gap, pad = 34, 12, 12

    def process_height(panel: Panel) -> float:
        return pad * 2 + 18 + panel.replicas * replica_h + (panel.replicas - 1) * replica_gap

    top = 60
    drawing_h = max(process_height(p) * p.processes + link_h * (p.processes - 1) for p in panels)
    notes = (
        "Each member sends one float64 payload per layer and direction: [sum(C), sumsq(C), count] forward and",
        "[sum(dy), sum(dy*x_hat), 0] backward, each with its tag (2C+6 values). Replicas of one process send",
        "theirs to replica 0, whose SyncMaster",
        "sums them and hands the totals back (in backward the autograd engine sums at the master's node); with a",
        "process group too, the master all-reduces the sum, so one payload per process crosses the network.",
    )
    height = top + drawing_h + 28 + 16 * len(notes)
    width = margin + 16 + panel_w * len(panels) + gap * (len(panels) - 1)
    body = [
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{PAYLOAD}"/></marker></defs>'
    ]
    for index, panel in enumerate(panels):
        left = margin + index * (panel_w + gap)
        process_h = process_height(panel)
        body.append(_text(left, 30, panel.title, 13, INK, "start", "bold"))
        body.append(_text(left, 48, panel.subtitle, 11, MUTED))
        box_w = panel_w - 2 * pad - (64 if panel.replicas > 1 else 0)
        masters = []  # the middle of each process's replica 0 (or its only layer), y
        for process in range(panel.processes):
            y = top + process * (process_h + link_h)
            body.append(f'<rect x="{left:g}" y="{y:g}" width="{panel_w:g}" height="{process_h:g}" rx="8" '
                        f'fill="none" stroke="{INK}"/>')
            name = "one process" if panel.processes == 1 else f"process (rank {process})"
            body.append(_text(left + pad, y + pad + 10, name, 11, MUTED))
            if panel.replicas > 1:
                body.append(_text(left + panel_w - pad, y + pad + 10, "in-process sum", 10, PAYLOAD, "end"))
            for replica in range(panel.replicas):
                ry = y + pad + 18 + replica * (replica_h + replica_gap)
                rx = left + pad
                if panel.replicas == 1:
                    label = "SyncBatchNorm layer"
                elif replica == 0:
                    label = "replica 0: SyncMaster"
                else:
                    label = f"replica {replica}: SlavePipe"
                body.append(f'<rect x="{rx:g}" y="{ry:g}" width="{box_w:g}" height="{replica_h:g}" rx="5" '
                            f'fill="{BOX}" stroke="{MUTED}"/>')
                body.append(_text(rx + 10, ry + 21, label, 12))
                if replica == 0:
                    masters.append(ry + replica_h / 2)
                else:  # the slave's payload to the master's thread, the totals back: in-process
                    ax = rx + box_w + 16 + 12 * (replica - 1)
                    body.append(f'<path d="M{rx + box_w:g},{ry + replica_h / 2:g} H{ax:g} V{masters[-1]:g} '
                                f'H{rx + box_w + 2:g}" fill="none" stroke="{PAYLOAD}" stroke-width="1.5" '
                                'marker-end="url(#arrow)" marker-start="url(#arrow)"/>')
        if len(masters) > 1:  # the all_reduce between processes, from each replica 0: one payload per process
            x = left - 16
            body.append(f'<path d="M{left + pad:g},{masters[0]:g} H{x:g} V{masters[-1]:g} H{left + pad:g}" '
                        f'fill="none" stroke="{PAYLOAD}" stroke-width="3"/>')
            mid = top + process_h + link_h / 2
            body.append(_text(left + pad, mid - 2, "all_reduce over the", 11, PAYLOAD))
            body.append(_text(left + pad, mid + 12, "process group", 11, PAYLOAD))
    y = top + drawing_h + 28
    for line in notes:
        body.append(_text(16, y, line, 11, INK))
        y += 16
    return _svg(width, height, "syncbn_dist's three transports", body)


DIAGRAMS = {"transports.svg": transports_svg, "step.svg": step_svg}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs"), help="folder to write the SVG files to")
    args = parser.parse_args(argv)
    for name, draw in DIAGRAMS.items():
        (args.out / name).write_text(draw(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
