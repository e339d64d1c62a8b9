"""One picture of a distributed array: who holds which block, in the whole cluster.

``jax.debug.visualize_array_sharding`` labels devices by id only, handles 1-D and 2-D arrays,
and prints once per process. This draws the global array once: each block is a rectangle,
coloured by the process that holds it and labelled with the device; a block held by several
devices (replication) is split into one stripe per holder. A text/plain form lists the same
facts, for saved notebooks and for reading.

Works on the plain-data layouts of ``spmd.engine.arrays.shards`` (no jax needed here).
"""

from __future__ import annotations

import base64
import io
import textwrap
from collections import defaultdict

Block = tuple[int, int, list[int], list[int], int]  # device, process, starts, stops, replica
TITLE_WIDTH = 64  # characters of the picture's title that fit its width at fontsize 10


def merge(layouts: list[dict]) -> dict:
    """One layout from every process's own: the union of their blocks, by device."""
    merged = dict(layouts[0])
    by_device = {}
    for part in layouts:
        for block in part["blocks"]:
            by_device[block[0]] = tuple(block)
    merged["blocks"] = [by_device[d] for d in sorted(by_device)]
    return merged


def missing_devices(layout: dict) -> list[int]:
    """Devices the array lives on that no process reported."""
    have = {b[0] for b in layout["blocks"]}
    return sorted(int(d) for d in layout["devices"] if int(d) not in have)


def _kind(layout: dict) -> str:
    """'CPU', 'GPU' or 'TPU': how jax names the devices in its own pictures."""
    return layout.get("platform", "cpu").upper()


def _slices(starts, stops) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(starts, stops)) + "]"


def _holders(layout: dict) -> dict[tuple, list[Block]]:
    """Blocks by region (starts, stops), each with its holders in device order."""
    regions: dict[tuple, list[Block]] = defaultdict(list)
    for block in layout["blocks"]:
        regions[(tuple(block[2]), tuple(block[3]))].append(block)
    return dict(sorted(regions.items()))


def headline(layout: dict, title: str) -> str:
    shape = ",".join(str(s) for s in layout["shape"])
    parts = [f"{title}: {layout['dtype']}[{shape}]"]
    if layout["mesh"]:
        parts.append("mesh " + ", ".join(f"{k}={v}" for k, v in layout["mesh"].items()))
    if layout["spec"]:
        parts.append(layout["spec"])
    processes = {p for _, p, *_ in layout["blocks"]}
    regions = _holders(layout)
    parts.append(
        f"{len(regions)} block{'s' if len(regions) != 1 else ''} on {len(layout['blocks'])} "
        f"device{'s' if len(layout['blocks']) != 1 else ''} of {len(processes)} "
        f"process{'es' if len(processes) != 1 else ''}"
    )
    return ", ".join(parts)


def text(layout: dict, title: str) -> str:
    """The layout in words: one line per block, its holders, and its replication."""
    lines = [headline(layout, title)]
    regions = _holders(layout)
    width = max(len(_slices(*r)) for r in regions)
    for (starts, stops), holders in regions.items():
        kind = _kind(layout)
        who = ", ".join(f"{kind} {d} (process {p})" for d, p, *_ in holders)
        copies = f"   replicated ×{len(holders)}" if len(holders) > 1 else ""
        lines.append(f"  {_slices(starts, stops).ljust(width)}  {who}{copies}")
    gone = missing_devices(layout)
    if gone:
        lines.append(f"  (no answer about devices {', '.join(map(str, gone))})")
    return "\n".join(lines)


def _drawn_dims(layout: dict) -> tuple[list[int], list[int]]:
    """(the two dimensions drawn as rows and columns, the other sharded dimensions, whose
    blocks become separate panels)."""
    shape = layout["shape"]
    regions = list(_holders(layout))
    sharded = [d for d in range(len(shape)) if len({r[0][d] for r in regions}) > 1]
    if len(shape) == 1:
        return [0], []
    if len(sharded) >= 2:
        return sharded[-2:], sharded[:-2]
    if len(sharded) == 1:
        d = sharded[0]
        other = len(shape) - 1 if d != len(shape) - 1 else len(shape) - 2
        return sorted([d, other]), []
    return [len(shape) - 2, len(shape) - 1], []


def draw(layout: dict, title: str) -> bytes:
    """The picture, as PNG bytes."""
    out = io.BytesIO()
    figure(layout, title).savefig(out, format="png")
    return out.getvalue()


def figure(layout: dict, title: str):
    """The picture, as a matplotlib Figure (not attached to pyplot: nothing to close)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    shape = layout["shape"]
    dims, panel_dims = _drawn_dims(layout)
    panels: dict[tuple, list[Block]] = defaultdict(list)
    for block in layout["blocks"]:
        key = tuple((block[2][d], block[3][d]) for d in panel_dims)
        panels[key].append(block)
    keys = sorted(panels)
    cols = min(len(keys), 4)
    rows = (len(keys) + cols - 1) // cols
    one_d = len(dims) == 1
    height = shape[dims[0]] if not one_d else 1
    width = shape[dims[-1]]
    aspect = height / max(width, 1)
    panel_w = 5.2
    panel_h = max(1.1, min(5.2, panel_w * aspect)) if not one_d else 1.6
    fig = Figure(figsize=(panel_w * cols + 0.4, panel_h * rows + 1.4), dpi=100)
    colours = matplotlib.colormaps["tab10"]
    processes = sorted({b[1] for b in layout["blocks"]})
    for i, key in enumerate(keys):
        ax = fig.add_subplot(rows, cols, i + 1)
        regions: dict[tuple, list[Block]] = defaultdict(list)
        for block in panels[key]:
            region = tuple((block[2][d], block[3][d]) for d in dims)
            regions[region].append(block)
        for region, holders in regions.items():
            (r0, r1), (c0, c1) = ((0, 1), region[0]) if one_d else region
            stripe = (c1 - c0) / len(holders)
            for k, (device, process, *_rest) in enumerate(sorted(holders)):
                x0 = c0 + k * stripe
                ax.add_patch(
                    Rectangle(
                        (x0, r0),
                        stripe,
                        r1 - r0,
                        facecolor=colours(process % 10),
                        edgecolor="white",
                        linewidth=1.5,
                    )
                )
                # a label that does not fit across its stripe (~0.75 in) is turned upright
                vertical = stripe / width * panel_w < 0.8
                ax.text(
                    x0 + stripe / 2,
                    (r0 + r1) / 2,
                    f"{_kind(layout)} {device}",
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=9,
                    fontweight="bold",
                    rotation=90 if vertical else 0,
                )
            ax.add_patch(
                Rectangle((c0, r0), c1 - c0, r1 - r0, fill=False, edgecolor="black", linewidth=2)
            )
            if len(holders) > 1:
                ax.text(
                    c1 - 0.02 * width,
                    r0 + 0.04 * (r1 - r0) + (0.04 if one_d else 0),
                    f"×{len(holders)}",
                    ha="right",
                    va="top",
                    fontsize=8,
                    color="black",
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none"},
                )
        ax.set_xlim(0, width)
        ax.set_ylim(height, 0)
        col_edges = sorted({e for r in regions for e in (r[-1][0], r[-1][1])})
        ax.set_xticks(col_edges)
        ax.set_xlabel(f"dim {dims[-1]}")
        if one_d:
            ax.set_yticks([])
        else:
            ax.set_yticks(sorted({e for r in regions for e in r[0]}))
            ax.set_ylabel(f"dim {dims[0]}")
        if panel_dims:
            ax.set_title(
                ", ".join(f"dim {d} {a}:{b}" for d, (a, b) in zip(panel_dims, key)), fontsize=9
            )
        ax.tick_params(labelsize=8)
    fig.suptitle(_title_lines(layout, title), fontsize=10)
    fig.legend(
        handles=[Patch(color=colours(p % 10), label=f"process {p}") for p in processes],
        loc="lower center",
        ncol=min(len(processes), 8),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def _title_lines(layout: dict, title: str) -> str:
    first, *rest = headline(layout, title).split(", ")
    # (a DTensor's placements make a long line: wrapped to the figure's width)
    lines = [first, *textwrap.wrap(", ".join(rest), TITLE_WIDTH)]
    dims, panel_dims = _drawn_dims(layout)
    whole = [d for d in range(len(layout["shape"])) if d not in dims and d not in panel_dims]
    if whole:
        names = ", ".join(f"dim {d}" for d in whole)
        lines.append(f"{names} not drawn: not sharded, every block spans it whole")
    return "\n".join(lines)


def bundle(layout: dict, title: str) -> dict:
    """The MIME bundle of one picture: PNG, and the text form as text/plain."""
    png = base64.b64encode(draw(layout, title)).decode("ascii")
    return {"image/png": png, "text/plain": text(layout, title)}
