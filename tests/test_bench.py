"""The bench's models suite: its cases and its FLOP count (the timings run on a GPU)."""

import io

import numpy as np
import pytest

from pallas_flash import bench


def brute_force_pairs(t, kwargs):
    rows, cols = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = np.ones((t, t), bool)
    if kwargs.get("is_causal"):
        visible &= cols <= rows
    if "local_window_size" in kwargs:
        left, right = kwargs["local_window_size"]
        visible &= (cols >= rows - left) & (cols <= rows + right)
    lengths = kwargs.get("key_value_seq_lengths")
    if lengths is None:
        return visible.sum()
    return np.mean([(visible & (cols < n)).sum() for n in lengths])


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        dict(is_causal=True),
        dict(is_causal=True, local_window_size=(7, 0)),
        dict(local_window_size=(5, 3)),
        dict(key_value_seq_lengths=[10, 37, 0]),
        dict(is_causal=True, local_window_size=(4, 0), key_value_seq_lengths=[12, 37]),
    ],
    ids=str,
)
def test_visible_pairs_count_the_mask(kwargs):
    assert bench._visible_pairs(37, kwargs) == brute_force_pairs(37, kwargs)


def test_model_cases_name_every_family_once_with_a_baseline():
    cases = list(bench.model_cases())
    families = dict.fromkeys(c[0] for c in cases)
    assert len(families) == 8
    for family in families:
        variants = [c for c in cases if c[0] == family]
        model = [c for c in variants if c[1] == "model"]
        assert len(model) == 1
        # Every family is timed beside cuDNN's closest call or the nearest plain call.
        assert model[0][4] is not None or any(c[1] == "plain" for c in variants)
    mla = [c for c in cases if c[0].startswith("DeepSeek")]
    assert [c[3][4:] for c in mla] == [(192, 128), (192, 192)]


def test_model_table_ratios():
    row = dict(family="f", H=64)
    rows = [
        dict(row, impl="pallas_flash", ms=2.0, tflops=100.0, **{"pass": "fwd"}),
        dict(row, impl="pallas_flash_plain", ms=1.0, tflops=125.0, **{"pass": "fwd"}),
        dict(row, impl="cudnn", ms=3.0, tflops=50.0, **{"pass": "fwd"}),
    ]
    out = io.StringIO()
    bench.print_model_table(rows, out=out)
    assert "| f | fwd | 100 | 125 | 50 | 1.50 | 0.80 |" in out.getvalue()
