"""A batch of images as one PNG grid, each tile with its label below it (``visiontune show``).

The tiles are the batch's pixels, enlarged by a whole factor (each pixel a square, nothing resampled) so
that a 32 px image is readable; where each tile sits and its label are written into the PNG's text as
JSON (``visiontune``: ``tiles`` with ``box`` [left, top, right, bottom], ``label``; ``scale``), so the
picture can be checked against the batch.
"""

from __future__ import annotations

import json
import math

import torch

from visiontune import files

MIN_TILE = 96  # px on screen: a 32 px image is drawn 3x
PAD, LABEL_H = 4, 14


def write_grid(images: torch.Tensor, labels: list[str], out: str) -> None:
    """``images`` uint8 [N, 3, S, S]; one tile per image, row-major, at most 8 a row."""
    import io

    from PIL import Image, ImageDraw
    from PIL.PngImagePlugin import PngInfo

    n, _, size, _ = images.shape
    scale = max(1, math.ceil(MIN_TILE / size))
    side, cols = size * scale, min(8, n)
    rows = math.ceil(n / cols)
    cell_w, cell_h = side + 2 * PAD, side + LABEL_H + 2 * PAD
    grid = Image.new("RGB", (cols * cell_w, rows * cell_h), "white")
    draw = ImageDraw.Draw(grid)
    tiles = []
    for i in range(n):
        left, top = (i % cols) * cell_w + PAD, (i // cols) * cell_h + PAD
        tile = images[i].permute(1, 2, 0).repeat_interleave(scale, 0).repeat_interleave(scale, 1)
        grid.paste(Image.fromarray(tile.contiguous().numpy()), (left, top))
        text = labels[i] if draw.textlength(labels[i]) <= side else labels[i][: max(1, side // 7)] + "..."
        draw.text((left, top + side + 1), text, fill="black")  # black on the white band: never on the image
        tiles.append({"box": [left, top, left + side, top + side], "label": labels[i]})
    info = PngInfo()
    info.add_text("visiontune", json.dumps({"tiles": tiles, "scale": scale}))
    buf = io.BytesIO()
    grid.save(buf, "PNG", pnginfo=info)
    files.atomic_write(out, buf.getvalue())
