"""The eviction figure (docs/figures/eviction.png, theory/plots.py): the labels of the T3
thresholds sit beside their dashed lines and off the curves (issue 40, point 7)."""

import itertools

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from attnspec.theory import plots


def test_the_threshold_labels_touch_neither_their_lines_nor_the_curves():
    import matplotlib.pyplot as plt

    fig = plots.eviction_figure()
    try:
        fig.tight_layout()
        fig.canvas.draw()
        (ax,) = fig.axes
        labels = [t for t in ax.texts if "safe for" in t.get_text()]
        assert len(labels) == 2
        renderer = fig.canvas.get_renderer()
        vertical = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
        curves = [ln for ln in ax.lines if ln.get_linestyle() != "--"]
        assert len(vertical) == 2 and len(curves) == 2
        for text in labels:
            box = text.get_window_extent(renderer)
            for line in vertical:
                x = ax.transData.transform((line.get_xdata()[0], 0))[0]
                assert not box.x0 <= x <= box.x1, text.get_text()
            for line in curves:
                points = ax.transData.transform(np.column_stack(line.get_data()))
                for a, b in itertools.pairwise(points):  # each segment, sampled
                    for s in np.linspace(0, 1, 50):
                        px, py = a + s * (b - a)
                        assert not (box.x0 <= px <= box.x1 and box.y0 <= py <= box.y1)
    finally:
        plt.close(fig)
