"""The sharding picture's logic on hand-written layouts (no processes): what a GPU cluster,
an N-D array and a missing answer look like."""

from __future__ import annotations

import base64

from spmd import picture


def layout(shape, blocks, platform="cpu", spec="P('x')", mesh=None):
    return {
        "shape": shape,
        "dtype": "float32",
        "nbytes": 4,
        "sharding": "",
        "mesh": mesh or {"x": 2},
        "spec": spec,
        "devices": {b[0]: b[1] for b in blocks},
        "platform": platform,
        "blocks": blocks,
        "process": 0,
    }


def test_gpu_devices_are_named_as_jax_names_them():
    gpus = layout([4], [(0, 0, [0], [2], 0), (1, 1, [2], [4], 0)], platform="gpu")
    assert picture.text(gpus, "w").splitlines() == [
        "w: float32[4], mesh x=2, P('x'), 2 blocks on 2 devices of 2 processes",
        "  [0:2]  GPU 0 (process 0)",
        "  [2:4]  GPU 1 (process 1)",
    ]


def test_a_3d_array_sharded_on_three_dims_is_drawn_as_panels():
    blocks = []
    device = 0
    for a in (0, 2):
        for b in (0, 3):
            for c in (0, 4):
                blocks.append((device, device // 2, [a, b, c], [a + 2, b + 3, c + 4], 0))
                device += 1
    cube = layout([4, 6, 8], blocks, spec="P('x', 'y', 'z')", mesh={"x": 2, "y": 2, "z": 2})
    assert picture._drawn_dims(cube) == ([1, 2], [0])  # rows, columns; panels over dim 0
    png = base64.b64decode(picture.bundle(cube, "cube")["image/png"])
    assert png.startswith(b"\x89PNG")


def test_devices_no_process_answered_for_are_named():
    merged = picture.merge([layout([4], [(0, 0, [0], [2], 0)])])
    merged["devices"] = {0: 0, 1: 1}
    assert picture.missing_devices(merged) == [1]
    assert picture.text(merged, "v").endswith("(no answer about devices 1)")


def test_each_block_is_painted_in_its_owning_processs_colour():
    import matplotlib
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    # two devices per process, with the ids jax gives them: colouring by device would differ
    blocks = [
        (0, 0, [0], [2], 0),
        (1, 0, [2], [4], 0),
        (2048, 1, [4], [6], 0),
        (2049, 1, [6], [8], 0),
    ]
    fig = picture.figure(layout([8], blocks, mesh={"x": 4}), "w")
    FigureCanvasAgg(fig).draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())
    (ax,) = fig.axes
    colours = matplotlib.colormaps["tab10"]
    for device, process, (start,), (stop,), _ in blocks:
        # a point inside the block, away from its label in the middle
        x, y = ax.transData.transform((start + 0.2 * (stop - start), 0.2))
        painted = pixels[pixels.shape[0] - int(round(y)), int(round(x)), :3] / 255
        expected = np.array(colours(process)[:3])
        assert np.allclose(painted, expected, atol=0.02), (device, process, painted)
