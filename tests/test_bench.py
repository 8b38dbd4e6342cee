"""The bench: its suites' cases, FLOP counts, tables and flags (the timings run on a GPU)."""

import argparse
import importlib.util
import io
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash
from pallas_flash.bench import __main__ as cli
from pallas_flash.bench import compile as compile_suite
from pallas_flash.bench import decode, grid, masks, models, overheads, ragged, scale, shapes, timing


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
    assert models._visible_pairs(37, kwargs) == brute_force_pairs(37, kwargs)


def test_model_cases_name_every_family_once_with_a_baseline():
    cases = list(models.model_cases())
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


def test_shapes_suite_covers_the_calls_off_the_grid():
    points = list(shapes.shapes_grid())
    assert any(p["k"] == 1 and p["n"] > 1 and p["causal"] for p in points)  # MQA
    assert any(1 < p["k"] < p["n"] for p in points)  # GQA
    assert any(p["t"] != p["s"] for p in points)  # cross-attention
    assert any(p["t"] >= 65536 and p["b"] == 1 for p in points)
    assert {80, 96, 192, 256} <= {p["h"] for p in points}
    assert any(p["t"] % 128 for p in points)  # lengths off the tiles


def test_grid_table_names_cross_attention_and_gqa():
    point = dict(H=128, causal=False, B=16, **{"pass": "fwd"})
    rows = [
        dict(point, T=1024, S=8192, N=16, K=16, impl="pallas_flash", tflops=500.0),
        dict(point, T=1024, S=8192, N=16, K=16, impl="cudnn", tflops=400.0),
        dict(point, T=1024, S=1024, N=32, K=8, impl="pallas_flash", tflops=300.0),
    ]
    out = io.StringIO()
    grid.print_table(rows, ["pallas_flash", "cudnn"], out=out)
    assert "| pass | pallas_flash TFLOP/s | cudnn TFLOP/s | pf/cudnn |" in out.getvalue()
    assert "| 128 | 0 | 1024/8192 | 16 | 16 | fwd | 500 | 400 | 1.25 |" in out.getvalue()
    assert "| 128 | 0 | 1024 | 16 | 32/8 | fwd | 300 | - | - |" in out.getvalue()
    # Kernel time where the rows have it: its own ratio beside the wall time's.
    rows[0]["kernel_tflops"], rows[1]["kernel_tflops"] = 560.0, 400.0
    out = io.StringIO()
    grid.print_table(rows, ["pallas_flash", "cudnn"], out=out)
    assert "| 128 | 0 | 1024/8192 | 16 | 16 | fwd | 500 | 400 | 1.25 | 1.40 |" in out.getvalue()
    assert "| 128 | 0 | 1024 | 16 | 32/8 | fwd | 300 | - | - | - |" in out.getvalue()


def test_mask_table_gives_ms_and_the_ratio_to_dense_causal():
    rows = [
        dict(case="dense causal", impl="pallas_flash", ms=2.0, **{"pass": "fwd"}),
        dict(case="dense causal", impl="pallas_flash", ms=6.0, **{"pass": "fwd+bwd"}),
        dict(case="window", impl="cudnn", ms=1.0, **{"pass": "fwd"}),
        dict(case="window", impl="cudnn", ms=None, error="refused", **{"pass": "fwd+bwd"}),
    ]
    out = io.StringIO()
    masks.print_mask_table(rows, out=out)
    assert "| case | impl | fwd ms | fwd+bwd ms |" in out.getvalue()
    assert "| window | cudnn | 1.0 | - | 0.50 | - |" in out.getvalue()


def test_model_table_ratios():
    row = dict(family="f", H=64)
    rows = [
        dict(row, impl="pallas_flash", ms=2.0, tflops=100.0, **{"pass": "fwd"}),
        dict(row, impl="pallas_flash_plain", ms=1.0, tflops=125.0, **{"pass": "fwd"}),
        dict(row, impl="cudnn", ms=3.0, tflops=50.0, **{"pass": "fwd"}),
    ]
    out = io.StringIO()
    models.print_model_table(rows, out=out)
    assert "| f | fwd | 100 | 125 | 50 | 1.50 | 0.80 | - | - |" in out.getvalue()
    # Kernel time where the rows have it (a GPU run): its own ratios beside the wall time's.
    kernels = [dict(ms=1.5, tflops=133.3), dict(ms=1.0, tflops=200.0), dict(ms=2.7, tflops=74.1)]
    for r, k in zip(rows, kernels):
        r.update(kernel_ms=k["ms"], kernel_tflops=k["tflops"])
    out = io.StringIO()
    models.print_model_table(rows, out=out)
    assert "| f | fwd | 100 | 125 | 50 | 1.50 | 0.80 | 1.80 | 0.67 |" in out.getvalue()


def test_decode_table_shows_wall_and_kernel_times():
    case = dict(B=1, S=1024, N=8, K=2, H=64, T=1, ragged=False, page=None)
    rows = [
        dict(case, impl="pallas_flash", ms=0.1, tbps=1.0, device_ms=0.04, device_tbps=2.5),
        dict(case, impl="flash_attention", ms=0.2, tbps=0.5, device_ms=0.05, device_tbps=2.0),
        dict(case, impl="memcpy", ms=0.1, tbps=2.0, device_ms=0.06, device_tbps=3.33),
    ]
    out = io.StringIO()
    decode.print_decode_table(rows, out=out)
    text = out.getvalue()
    wall, kernels = text.split("kernel time per call")
    header = "| case | pallas_flash ms (TB/s) | flash_attention ms (TB/s) | memcpy ms (TB/s) |"
    assert header in wall and header in kernels
    assert (
        "| B1 S1024 N8/K2 H64 T1 | 0.100 (1.00) | 0.200 (0.50) | 0.100 (2.00) | 0.50 | 0.50 |"
        in (wall)
    )
    # memcpy's 0.06 ms moved twice pf's bytes: pf reads at 0.06 / (2 * 0.04) of its rate.
    assert (
        "| B1 S1024 N8/K2 H64 T1 | 0.040 (2.50) | 0.050 (2.00) | 0.060 (3.33) | 0.80 | 0.75 |"
        in (kernels)
    )


@pytest.mark.parametrize("t, lengths", [(1, [40, 64, 0]), (4, [64, 64, 64]), (4, [40, 64, 7])])
def test_flash_attention_decode_is_decode_attention(t, lengths):
    """The decode suite's flash_attention row on decode's arrays: decode's attention (tokens at
    the end of each sequence, causal among themselves) where T = 1 or every length is S; with
    shorter lengths and T > 1 the last token's, its earlier tokens seeing the later ones."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((3, t, 4, 16), np.float32)
    k, v = rng.standard_normal((2, 3, 64, 2, 16), np.float32)
    lengths = np.asarray(lengths, np.int32)
    both = jax.jit(
        lambda q, k, v, lengths: (
            pallas_flash.decode_attention(q, k, v, key_value_seq_lengths=lengths, backend="xla"),
            decode.flash_attention_decode(q, k, v, lengths, backend="xla"),
        )
    )
    want, got = both(q, k, v, lengths)
    if t == 1 or (lengths == 64).all():
        np.testing.assert_allclose(got, want, atol=1e-6)
    else:
        np.testing.assert_allclose(got[:, -1], want[:, -1], atol=1e-6)
        assert not np.allclose(got[0, 0], want[0, 0], atol=1e-3)


def test_decode_table_without_kernel_times_prints_the_wall_times_alone():
    case = dict(B=1, S=1024, N=8, K=2, H=64, T=1, ragged=False, page=None)
    out = io.StringIO()
    decode.print_decode_table([dict(case, impl="pallas_flash", ms=0.1, tbps=1.0)], out=out)
    assert "wall time per call" in out.getvalue()
    assert "kernel time" not in out.getvalue()


def test_overheads_table_gives_each_option_over_its_baseline():
    point = dict(H=64, causal=True, **{"pass": "fwd"})
    ms = dict(plain=1.0, sinks=1.02, triton=2.0, triton_sinks=2.5, dropout=1.1)
    rows = [dict(point, case=case, ms=value) for case, value in ms.items()]
    rows.append(dict(point, case="triton_dropout", ms=None, error="refused"))
    out = io.StringIO()
    overheads.print_overheads_table(rows, out=out)
    assert "| 64 | 1 | fwd | 1.0 | 1.02 | 2.0 | 2.5 | 1.1 | - | 1.020 | 1.250 | 1.100 | - |" in (
        out.getvalue()
    )


def _experiments():
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "experiments.py"
    spec = importlib.util.spec_from_file_location("experiments", path)
    experiments = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(experiments)
    return experiments


def test_fused_dq_masks_narrow_the_window_to_the_left_when_causal():
    masks = _experiments().mosaic_backward._fused_dq_masks
    assert masks("window:64", 2, 256, causal=True) == (
        dict(window=(64, 0)),
        dict(local_window_size=(64, 0)),
    )
    assert masks("window:64", 2, 256, causal=False)[0] == dict(window=(64, 64))
    packed, cudnn = masks("packed:4", 2, 256, causal=True)
    assert cudnn is None  # cuDNN takes no segment ids
    ids = packed["segment_ids"][0]
    assert ids.shape == (2, 256) and list(ids[0, ::64]) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="window:W or packed:D"):
        masks("doc:4", 2, 256, causal=True)


def test_per_call_median_sums_each_calls_kernels_in_start_order():
    # Two kernels per call (0.1 and 0.2 ms, the second call slowed), events out of order.
    events = [(30, 0.2), (0, 0.1), (10, 0.2), (20, 0.5), (40, 0.1), (50, 0.2)]
    assert timing.per_call_median([events], 3) == pytest.approx(0.3)
    # Two GPUs, each one kernel per call, their clocks apart: each plane in its own order.
    other = [(1000, 0.4), (1010, 0.4), (1020, 0.9)]
    assert timing.per_call_median([events, other], 3) == pytest.approx(1.1)  # 0.7, 1.1, 1.2
    # Not dividing evenly (a kernel the profiler missed): the mean.
    assert timing.per_call_median([events[:5]], 2) == pytest.approx(1.1 / 2)


@pytest.mark.gpu
def test_device_ms_reads_the_kernels_of_a_call():
    import jax
    import jax.numpy as jnp

    x = jnp.ones((64, 1024, 1024), jnp.float32)  # 256 MiB: a copy takes ~0.1 ms
    f = jax.jit(lambda x: x * 2.0)
    total, kernels = timing.device_ms(f, (x,), calls=5)
    # total is the median call's, kernels' the mean call's.
    assert kernels and total == pytest.approx(sum(kernels.values()), rel=0.2)
    # At most the wall time, at least what 512 MiB of traffic takes at 5 TB/s.
    assert 512 * 2**20 / 5e12 * 1e3 < total < timing.median_ms(f, (x,), calls=5, repeats=3)


def test_persistent_experiment_candidates_are_tiles_the_kernel_takes():
    """benchmarks/experiments.py mosaic-persistent --smoke: both candidates of every case (the
    default tiles, persistent and not, and persistent in the snake order where the causal pairs
    apply) pass `why_not` at the case's shapes."""
    mosaic_forward = _experiments().mosaic_forward
    out = io.StringIO()
    mosaic_forward.mosaic_persistent(out, smoke=True)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(rows) == len(mosaic_forward.PERSISTENT_CASES)
    for row in rows:
        assert row["why_not_per_item"] is None and row["why_not_persistent"] is None, row
        assert row.get("why_not_snake") is None, row
    # The snake beside the pairs where they apply (plain causal calls), at every head dim.
    snakes = {row["case"] for row in rows if "why_not_snake" in row}
    assert "H128 causal 2k MHA" in snakes and "H128 cap 30 causal 4k" in snakes
    assert "H64 causal 4096" in snakes
    assert "H128 window 4k at 16k" not in snakes and "H128 4 documents causal 4k" not in snakes
    defaults = {row["case"]: row["default"] for row in rows}
    assert "persistent=True" in defaults["gpt-oss: sinks, window 128"]
    assert "persistent=False" in defaults["H128 causal 16k GQA"]


def _ncu_summary():
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "ncu_summary.py"
    spec = importlib.util.spec_from_file_location("ncu_summary", path)
    ncu_summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ncu_summary)
    return ncu_summary, path.parent / "results"


def test_ncu_summary_reads_the_committed_profile():
    """benchmarks/ncu_summary.py on the forward kernels profiled on the H200
    (results/h200-ncu-forward.csv.gz): ours and cuDNN's, the numbers
    docs/notes/forward.md, "What limits the forward" quotes."""
    ncu_summary, results = _ncu_summary()
    profile = results / "h200-ncu-forward.csv.gz"
    table = dict(ncu_summary.summary(str(profile)))
    assert [name.startswith("pallas_flash") for name in table["kernel"]] == [1, 0, 1, 0]
    assert all(value != "-" for values in table.values() for value in values)
    # H=128 causal 2k in the snake: DRAM-bound, L2 missed (ours) against cuDNN's.
    dram, l2 = (list(map(ncu_summary.number, table[k])) for k in ("DRAM %", "L2 hit %"))
    assert dram[2] > 70 and dram[3] < 25 and l2[2] < 15 and l2[3] > 70
    # H=64 16k: ours spills, cuDNN does not.
    spills = list(map(ncu_summary.number, table["local (spill) requests"]))
    assert spills[0] > 1e6 and spills[1] == 0


def test_ncu_summary_reads_the_backward_profiles():
    """The backward profiles that docs/notes/backward.md, "What limits the backward" quotes:
    the two-kernel backward's kernels keep the tensor pipe busier than the fused "fixed" one,
    which spills, and cuDNN's backward is one persistent kernel between them."""
    ncu_summary, results = _ncu_summary()
    tables = [
        dict(ncu_summary.summary(str(results / f"h200-ncu-backward-{name}.csv.gz")))
        for name in ("two-kernel", "fixed")
    ]
    for table in tables:
        assert all(value != "-" for values in table.values() for value in values)
    two, fixed = (
        {column[0]: dict(zip(table, column)) for column in zip(*table.values())} for table in tables
    )

    def metric(kernels, prefix, label):
        (row,) = [row for name, row in kernels.items() if name.startswith(prefix)]
        return ncu_summary.number(row[label])

    fused_tensor = metric(fixed, "pallas_flash__dkv", "tensor pipe %")
    assert metric(two, "pallas_flash__dkv", "tensor pipe %") > fused_tensor + 10
    assert metric(two, "pallas_flash__dq", "tensor pipe %") > fused_tensor + 10
    assert metric(fixed, "pallas_flash__dkv", "local (spill) requests") > 5e7
    assert metric(two, "pallas_flash__dkv", "local (spill) requests") == 0


def test_ncu_summary_gives_durations_in_ms(tmp_path):
    """ncu scales each page's duration unit to the kernels' size (us for XLA's small ones):
    the summary's ms row converts it."""
    ncu_summary, _ = _ncu_summary()
    page = tmp_path / "raw.csv"
    page.write_text('"Kernel Name","gpu__time_duration.sum"\n"","us"\n"small_fusion","20.32"\n')
    (duration,) = dict(ncu_summary.summary(str(page)))["ms"]
    assert ncu_summary.number(duration) == pytest.approx(0.02032)


@pytest.mark.parametrize(
    "argv, unread",
    [
        (["--suite", "compile", "--head-dims", "64"], "--head-dims"),
        (["--suite", "decode", "--seqs=4096"], "--seqs"),
        (["--suite", "masks", "--impls", "cudnn", "--causal", "yes"], "--causal, --impls"),
        (["--suite", "scale", "--layers", "2"], "--layers"),
    ],
)
def test_a_flag_the_suite_does_not_read_is_an_error(argv, unread, capsys):
    """No flag is silently ignored: a suite given one it does not read exits with an error that
    names it (before any work)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert f"does not take {unread};" in capsys.readouterr().err


@pytest.mark.parametrize("on_gpu", [True, False])
@pytest.mark.parametrize("suite", list(cli.SUITES))
def test_every_flag_a_suite_reads_is_accepted(suite, on_gpu):
    """The flags listed for a suite pass the check (and --out always); one more is refused."""
    parser = argparse.ArgumentParser()
    argv = ["--suite", suite, "--out", "x.jsonl", *cli.suite_flags(suite, on_gpu)]
    expected = {"--suite", "--out", *cli.suite_flags(suite, on_gpu)}
    assert cli.check_flags(parser, argv, suite, on_gpu) == expected
    unread = sorted({"--head-dims", "--quick", "--layers"} - set(cli.suite_flags(suite, on_gpu)))
    with pytest.raises(SystemExit):
        cli.check_flags(parser, [*argv, unread[0]], suite, on_gpu)


@pytest.mark.parametrize("suite", ["masks", "shapes", "overheads"])
def test_a_gpu_suite_without_a_gpu_says_so(suite, monkeypatch):
    monkeypatch.setattr(cli.device_lib, "gpu_compute_capability", lambda: None)
    with pytest.raises(SystemExit, match=f"--suite {suite} needs an NVIDIA GPU"):
        cli.main(["--suite", suite])


def test_an_implementation_the_suite_does_not_time_is_an_error(monkeypatch, capsys):
    monkeypatch.setattr(cli.device_lib, "gpu_compute_capability", lambda: (9, 0))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--suite", "shapes", "--impls", "pallas_flash_window"])
    assert exit_info.value.code == 2
    assert "--suite shapes does not time pallas_flash_window" in capsys.readouterr().err


@pytest.fixture
def cpu_bench(monkeypatch, tmp_path):
    """The bench without a GPU, its clock and random inputs stubbed (every call 1 ms, inputs of
    ones), in an empty working directory: what each suite's CPU path runs, prints and writes,
    in about a second (the timed functions themselves are tested against the oracle elsewhere)."""
    monkeypatch.setattr(cli.device_lib, "gpu_compute_capability", lambda: None)
    for module in (timing, decode, models, scale):
        monkeypatch.setattr(module, "median_ms", lambda f, args, **kw: 1.0)

    def ones(key, shape, dtype=jnp.float32):
        return jnp.asarray(np.ones(shape), dtype)

    monkeypatch.setattr(jax.random, "normal", ones)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "suite, header",
    [
        ("grid", "| H | causal | seq | B | heads | pass | pallas_flash ms | xla ms |"),
        (
            "decode",
            "| case | pallas_flash ms (TB/s) | flash_attention ms (TB/s) | xla ms (TB/s) | memcpy",
        ),
        ("models", "| family | pass | pallas_flash TFLOP/s | plain TFLOP/s | cudnn TFLOP/s |"),
        ("scale", "| impl | devices | T | fwd+bwd ms | TFLOP/s per device | efficiency |"),
    ],
    ids=["grid", "decode", "models", "scale"],
)
def test_each_suite_runs_its_cpu_path(suite, header, cpu_bench, capsys):
    """Every row goes to --out as a line of JSON, the table (units in its header) to stdout,
    a line per measurement to stderr."""
    rows = cli.main(["--suite", suite, "--out", "rows.jsonl"])
    assert rows and all(row["ms"] == 1.0 for row in rows), rows
    written = (cpu_bench / "rows.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in written] == rows
    out, err = capsys.readouterr()
    assert header in out
    assert len(err.splitlines()) >= len(rows) and "| " not in err
    assert out.endswith(f"appended {len(rows)} rows to rows.jsonl\n")


def test_the_bench_writes_no_file_unless_asked(cpu_bench, capsys):
    rows = cli.main(["--suite", "grid", "--passes", "fwd"])
    assert len(rows) == 4 and list(cpu_bench.iterdir()) == []
    assert "appended" not in capsys.readouterr().out


def test_compile_suite_runs_each_row_in_a_fresh_process_then_the_cache(cpu_bench, monkeypatch):
    calls = []

    def fresh(impl, layers, shape, *, interpret, cache_dir=None):
        calls.append((impl, layers, cache_dir is not None))
        times = dict(lower_s=1.0, compile_s=2.0, first_call_ms=3.0)
        return dict(suite="compile", impl=impl, layers=layers, **times)

    monkeypatch.setattr(compile_suite, "_compile_row_in_subprocess", fresh)
    rows = cli.main(["--suite", "compile", "--layers", "1", "3"])
    assert calls == [
        ("pallas_flash", 1, False),
        ("pallas_flash", 3, False),
        ("xla", 1, False),
        ("xla", 3, False),
        ("pallas_flash", 3, True),
        ("pallas_flash", 3, True),
    ]
    assert [row.get("cache") for row in rows[-2:]] == ["cold", "warm"]


def test_compile_row_of_a_spec_times_one_model():
    """What the compile suite's subprocess (python -m pallas_flash.bench.compile SPEC) runs."""
    spec = dict(impl="xla", layers=1, shape=[1, 32, 2, 16], interpret=True)
    row = compile_suite.row_of_spec(json.dumps(spec))
    assert row["dtype"] == "float32" and "error" not in row, row
    assert row["lower_s"] >= 0 and row["compile_s"] > 0 and row["first_call_ms"] > 0


def test_decode_ceilings_name_the_bound_and_its_share():
    """Each pallas_flash row's TFLOP/s and shares of the case's read ceiling and the run's
    matmul ceiling (kernel time where measured); the bound is the longer of the two times."""
    case = dict(B=1, S=1024, N=8, K=2, H=64, T=1, ragged=False, page=None)
    matmul = dict(impl="matmul", ms=1.0, tflops=90.0, device_ms=1.0, device_tflops=100.0)
    for flops, bound, share in ((2e8, "memory", 0.5), (2e11, "compute", 2.0)):
        rows = [
            dict(case, impl="pallas_flash", ms=1.5, device_ms=1.0, tbps=1.0, device_tbps=1.5),
            dict(case, impl="read", ms=0.6, device_ms=0.5),
        ]
        rows[0]["flops"] = flops
        decode._add_ceilings(rows, matmul)
        pf = rows[0]
        assert pf["device_tflops"] == round(flops / 1e9, 2) and pf["bound"] == bound
        assert pf["of_read"] == 0.5 and pf["of_roofline"] == share
        assert pf["of_matmul"] == round(flops / 100.0 / 1e9, 3)
    out = io.StringIO()
    decode.print_ceiling_table([matmul, *rows], out=out)
    assert "matmul ceiling (100.0 TFLOP/s), kernel time" in out.getvalue()
    assert "| B1 S1024 N8/K2 H64 T1 | pallas_flash | 1.0000 | 1.50 | 0.50 | 200.0 | 2.00 |" in (
        out.getvalue()
    )


def test_decode_flops_and_bytes():
    """2 (H + Hv) FLOPs per query head and visible key (token t of T at L - T + t); a latent
    cache's bytes are its one row of H columns."""
    case = dict(B=2, S=8, N=2, K=1, H=8, T=2, ragged=False, page=None)
    # L=5: tokens at 3 and 4 see 4 + 5 keys; L=1: at -1 and 0, 0 + 1.
    assert decode.decode_flops(case, [5, 1]) == 2 * 16 * 2 * 10
    assert decode.decode_flops(dict(case, hv=4), [5, 1]) == 2 * 12 * 2 * 10
    assert decode.decode_kv_bytes(case, [5, 1], 2) == 6 * 16 * 2
    assert decode.decode_kv_bytes(dict(case, hv=4), [5, 1], 1) == 6 * 8


def test_decode_case_groups():
    """--cases picks the groups; the speculative group spans T = 4, 8, 16 over 4, 8, 16 query
    heads per KV head; the float8 group runs each shape after its twin in the queries' dtype."""
    spec = list(decode.suite_cases(["speculative"]))
    assert {(c["T"], c["N"] // c["K"]) for c in spec} == {
        (t, g) for t in (4, 8, 16) for g in (4, 8, 16)
    }
    fp8 = list(decode.suite_cases(["fp8"], quick=True))
    assert [c["cache"] for c in fp8] == [None, "float8_e4m3fn"] * 2
    mla = list(decode.suite_cases(["mla"]))
    assert {c["N"] for c in mla} >= {16, 32, 128} and all(c["hv"] == 512 for c in mla)
    assert {c["group"] for c in decode.suite_cases(decode.CASES, quick=True)} == set(decode.CASES)


def test_decode_tiles_add_a_row_per_entry_over_float8_caches():
    """--decode-tiles: a "pallas_flash_<entry>" call per entry over a float8 cache (in place of
    the alternative tiles), none over its bfloat16 twin; each computes the default's attention
    (in the interpreter, split in two and in the rule's three); a bad entry is named."""
    bs = decode.parse_decode_tiles("16x128x8x3x2")
    assert (bs.block_m, bs.block_kv, bs.num_warps, bs.num_stages, bs.kv_splits) == (
        16,
        128,
        8,
        3,
        2,
    )
    assert decode.parse_decode_tiles("16x64x4x4").kv_splits == 0
    for bad in ("16x64x4", "16x64x4x4x2x1", "16x48x4x4", "16xbx4x4"):
        with pytest.raises(ValueError, match=f"--decode-tiles entry '{bad}' must be BMxBKVxWxS"):
            decode.parse_decode_tiles(bad)
    case = dict(B=2, S=64, N=4, K=2, H=32, T=1, ragged=True, page=16, group="fp8")
    twin = decode.decode_fns(case, interpret=True, tiles=["16x16x4x1x2"])
    assert "pallas_flash_16x16x4x1x2" not in twin
    case["cache"] = "float8_e4m3fn"
    fns = decode.decode_fns(case, interpret=True, tiles=["16x16x4x1x2"])
    assert list(fns) == ["pallas_flash", "xla", "pallas_flash_16x16x4x1x2"]
    inputs = decode.decode_inputs(case, jnp.float32)
    want = fns["pallas_flash"](*inputs)
    np.testing.assert_allclose(fns["pallas_flash_16x16x4x1x2"](*inputs), want, atol=1e-5)


def test_an_unknown_case_group_is_an_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--suite", "decode", "--cases", "gqa", "nope"])
    assert exit_info.value.code == 2
    assert "--suite decode has no case group nope; its --cases: gqa" in capsys.readouterr().err


def test_ragged_table_gives_each_call_over_ragged():
    row = dict(suite="ragged", goal="mixed", case="mixed 2048 + 63 x 1", tbps=1.0, tflops=2.0)
    rows = [
        dict(row, impl="ragged", ms=1.0, kernel_ms=0.5, max_abs_diff=0.0),
        dict(row, impl="ragged_hint", ms=0.9, kernel_ms=0.4, max_abs_diff=0.0, max_query_len=2048),
        dict(
            row, impl="split", ms=1.2, kernel_ms=0.6, ratio=1.2, ratio_hint=1.5, max_abs_diff=0.0078
        ),
        dict(row, impl="padded", ms=None, error="OOM"),
    ]
    out = io.StringIO()
    ragged.print_ragged_table(rows, out=out)
    text = out.getvalue()
    assert "kernel time" in text
    split = "| mixed | mixed 2048 + 63 x 1 | split | 0.6000 | 1.00 | 2.0 | 1.200 | 1.500 | 0.0078 |"
    assert split in text
    assert "| mixed | mixed 2048 + 63 x 1 | padded | - | - | - | - | - | - |" in text


def test_ragged_ratios_hint_and_prefill_tiles():
    """A comparator's time over every ragged call's (ratio: ragged's, ratio_hint:
    ragged_hint's); a ragged call or a failed one gets none. The variants: ragged_hint with the
    batch's most new tokens, and one call per --prefill-tiles entry with those prefill tiles."""
    measured = dict(
        ragged=dict(kernel_ms=2.0),
        ragged_hint=dict(kernel_ms=1.0),
        ragged_tiles_64x32x4x2=dict(kernel_ms=None, error="OOM"),
        split=dict(kernel_ms=3.0),
        padded=dict(kernel_ms=None),
    )
    assert ragged.ratios_over_ragged(measured, "split", "kernel_ms") == dict(
        ratios=dict(ragged=1.5, ragged_hint=3.0), ratio=1.5, ratio_hint=3.0
    )
    assert ragged.ratios_over_ragged(measured, "ragged_hint", "kernel_ms") == {}
    assert ragged.ratios_over_ragged(measured, "padded", "kernel_ms") == {}
    lengths, q_lens = [40, 24], [24, 1]
    k_pages, v_pages, tables = ragged.paged_cache(lengths, 16)
    q = jnp.zeros((25, ragged.GQA.N, ragged.GQA.H), jnp.bfloat16)
    args = ragged.ragged_args(q, q_lens, lengths, k_pages, v_pages, tables)
    calls = dict(ragged=(None, args, None))
    calls = ragged.ragged_variants(calls, q_lens, True, tiles=["64x32x4x2"])
    assert list(calls) == ["ragged", "ragged_hint", "ragged_tiles_64x32x4x2"]
    assert calls["ragged_hint"][0].__wrapped__.keywords["max_query_len"] == 24
    bs = calls["ragged_tiles_64x32x4x2"][0].__wrapped__.keywords["block_sizes"]
    prefill = (bs.block_m_prefill, bs.block_kv_prefill, bs.num_warps_prefill, bs.num_stages_prefill)
    assert prefill == (64, 32, 4, 2)
    with pytest.raises(ValueError, match="entry '64x32' must be BMxBKVxWxS"):
        ragged.parse_tiles("64x32")


def test_ragged_before_and_after(tmp_path, capsys):
    """--before's rows (labels before and after, one run id) side by side; --before needs --out;
    the flags are --suite ragged's."""
    case = dict(suite="ragged", goal="decode", case="decode B64", impl="ragged")
    path = tmp_path / "rows.jsonl"
    rows = [
        dict(case, label="before", run="r1", kernel_ms=2.0),
        dict(case, label="after", run="r1", kernel_ms=1.5),
        dict(case, label="after", run="r0", kernel_ms=9.0),
        dict(case, impl="paged", label="after", run="r1", ms=3.0),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = io.StringIO()
    ragged.print_before_after(ragged.read_rows(str(path), "r1"), out=out)
    text = out.getvalue()
    assert "| decode | decode B64 | ragged | 2.0 | 1.5 | 0.750 |" in text
    assert "| decode | decode B64 | paged | - | 3.0 | - |" in text
    args = argparse.Namespace(out=None, before=str(tmp_path), repeats=1, cases=None)
    with pytest.raises(SystemExit, match="--before needs --out"):
        ragged.run(args, on_gpu=False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--suite", "decode", "--before", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--suite decode" in capsys.readouterr().err and "--before" in ragged.FLAGS


def test_a_failing_call_is_a_row_with_its_error():
    """A measurement that raises is data: the row keeps its fields, the measured ones None, and
    says why; the run goes on."""
    row = timing.run_point("no_such_impl", 1, 8, 8, 1, 1, 8, jnp.float32, False, "fwd")
    assert row["impl"] == "no_such_impl" and row["ms"] is None and row["tflops"] is None
    assert row["error"] == "ValueError: unknown implementation 'no_such_impl'"
    partial = dict(ms=1.0)
    with timing.recording_failure(partial, "ms", "tbps"):
        raise RuntimeError("out of memory")
    assert partial == dict(ms=None, tbps=None, error="RuntimeError: out of memory")


def test_lowering_dump_writes_each_case_s_programs_and_kernels(tmp_path):
    """benchmarks/lowering_dump.py (a refactor's before/after proof): a case's StableHLO and its
    kernel modules for an abstract H200, without locations, the same text when lowered twice."""
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "lowering_dump.py"
    spec = importlib.util.spec_from_file_location("lowering_dump", path)
    lowering_dump = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lowering_dump)
    qkv, options = lowering_dump.CASES["plain_h128"]
    for out in (tmp_path / "a", tmp_path / "b"):
        out.mkdir()
        lowering_dump.run("plain_h128", qkv, options, out)
    texts = {p.name: p.read_text() for p in (tmp_path / "a").iterdir()}
    assert {"plain_h128.fwdbwd.hlo.txt", "plain_h128.fwdbwd.kernels.txt"} <= set(texts)
    assert "// mosaic" in texts["plain_h128.fwdbwd.kernels.txt"]
    assert "loc(" not in texts["plain_h128.fwdbwd.hlo.txt"]
    assert texts == {p.name: p.read_text() for p in (tmp_path / "b").iterdir()}
