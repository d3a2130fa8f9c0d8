"""The tensor summary every report row rests on, against the plain definition it replaces:
abs().min(), abs().max(), isnan().any() and the infinities, for every float dtype, layout and
kind of special value, with and without the sign hints that let one-signed tensors skip |t|."""

import collections
import math

import pytest
import torch

from numguard_nb import numerics, row_sink, stats

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INF = math.inf


def reference(t: torch.Tensor):
    """(abs_min, abs_max, nan, posinf, neginf) the slow, obvious way."""
    t64 = t.double()
    nan = bool(torch.isnan(t64).any())
    posinf = bool((t64 == INF).any())
    neginf = bool((t64 == -INF).any())
    magnitude = t64.abs()
    return float(magnitude.min()), float(magnitude.max()), nan, posinf, neginf


def summary(t: torch.Tensor, hints=None, site="site"):
    with torch.no_grad():
        row = stats.device_stats(t, sign_hints=hints, site=site)
    return stats.decode(stats.to_host([row])[0])


def assert_matches(t: torch.Tensor, hints=None, site="site", label="", exact_beside_nan=True):
    """`exact_beside_nan`: the infinities beside a nan are looked up (the CPU fast path); else a
    nan hides them (posinf, neginf None), as on a device."""
    abs_min, abs_max, nan, posinf, neginf, _ = summary(t, hints, site)
    ref_min, ref_max, ref_nan, ref_posinf, ref_neginf = reference(t)
    assert nan == ref_nan, label
    if ref_nan:
        # as min() and max() of a tensor holding nan say
        assert math.isnan(abs_min) and math.isnan(abs_max)
        if exact_beside_nan:
            assert (posinf, neginf) == (ref_posinf, ref_neginf), label
        else:
            assert posinf is None and neginf is None
        return
    assert (abs_min, abs_max) == (ref_min, ref_max), (label, t.dtype)
    assert (posinf, neginf) == (ref_posinf, ref_neginf), label


def special_tensors(dtype, n):
    torch.manual_seed(n)
    base = torch.randn(n, dtype=torch.float64)
    cases = {
        "mixed": base,
        "positive": base.abs() + 0.5,
        "negative": -(base.abs() + 0.5),
        "zeros": torch.zeros(n, dtype=torch.float64),
        "positive with -0.0": torch.cat([base.abs()[:-1] + 1, torch.tensor([-0.0], dtype=torch.float64)]),
        "relu": base.clamp_min(0),
    }
    out = {}
    for name, values in cases.items():
        out[name] = values.to(dtype)
        for special, position in (("nan", 1), ("+inf", n // 2), ("-inf", n - 1)):
            t = values.clone()
            t[position] = float(special.replace("+", "")) if special != "nan" else math.nan
            out[f"{name} with {special}"] = t.to(dtype)
        both = values.clone()
        both[0], both[-1] = INF, -INF
        out[f"{name} with both infinities"] = both.to(dtype)
        for infinities in ([INF], [-INF], [INF, -INF]):
            t = values.clone()
            t[1] = math.nan
            t[-len(infinities):] = torch.tensor(infinities, dtype=torch.float64)
            out[f"{name} with nan and {infinities}"] = t.to(dtype)
        if name in ("positive", "negative"):  # one sign throughout, nan and inf included
            t = values.clone()
            t[1], t[-1] = math.nan, math.copysign(INF, values[0].item())
            out[f"{name} with nan and inf of its sign"] = t.to(dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [7, 70_000], ids=["small", "large"])
def test_summary_matches_the_plain_definition(dtype, n):
    for name, t in special_tensors(dtype, n).items():
        assert_matches(t, label=name)
        assert_matches(t, hints={}, label=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_and_transposed_tensors(dtype):
    torch.manual_seed(0)
    t = torch.randn(300, 400).to(dtype)
    assert_matches(t.t())  # not contiguous: |t| still goes through the scratch buffer
    assert_matches(t[::3, 1::2])
    assert_matches(t.abs().t(), hints={})
    t[5, 7] = -INF
    assert_matches(t.t())


def test_views_whose_bits_cannot_be_read_directly():
    # a negative-bit view (autograd makes them) cannot be viewed as integers: |t| still can
    t = torch.tensor([0.5, -2.0, 3.0])._neg_view()
    assert_matches(t, hints={})
    assert_matches(torch.tensor([0.5, 2.0])._neg_view(), hints={})
    assert_matches(torch.randn(4, 1).expand(4, 300), hints={})  # stride 0


def test_a_site_whose_sign_changes_is_summarised_right_every_time():
    """The hint is only a guess about the next tensor at a site: each guess must be checked."""
    hints = {}
    torch.manual_seed(0)
    sequence = [
        torch.rand(1000) + 0.1,            # one-signed: the site is hinted
        torch.randn(1000),                 # mixed: the hint was wrong, |t| is needed
        torch.rand(1000) + 0.1,            # mixed last time: summarised through |t|
        -(torch.rand(1000) + 0.1),
        torch.tensor([1.0, -INF, 2.0]),
        torch.tensor([1.0, INF, 2.0]),
    ]
    for t in sequence:
        assert_matches(t, hints=hints, site=("module", "output"))


def test_infinities_are_told_apart_exactly_on_cpu():
    # finite values that would overflow a sum do not read as both infinities
    big = torch.finfo(torch.float16).max
    t = torch.tensor([big, big, -INF], dtype=torch.float16)
    _, _, _, posinf, neginf, _ = summary(t)
    assert (posinf, neginf) == (False, True)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool, torch.complex64], ids=str)
def test_other_dtypes(dtype):
    t = torch.tensor([3, -5, 0, 2]).to(dtype)
    abs_min, abs_max, nan, posinf, neginf, _ = summary(t)
    expected = t.abs() if dtype is not torch.bool else t
    assert (abs_min, abs_max) == (float(expected.min().real), float(expected.max().real))
    assert not nan and not posinf and not neginf


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu", "device-path"])
def test_a_complex_infinity_is_signed_by_its_parts(device_path, monkeypatch):
    # log(0j) is -inf + 0j: a -inf as a real log(0) is (used up by exp(), a mask's kin), not +inf
    if device_path:
        monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    cases = {(-INF, 0.0): (False, True), (INF, 1.0): (True, False), (0.0, -INF): (False, True),
             (float("nan"), 0.0): (None, None)}
    for (real, imag), signs in cases.items():
        t = torch.tensor([complex(real, imag), 2 + 1j], dtype=torch.complex64)
        with torch.no_grad():
            row = stats.device_stats(t, sign_hints={}, site="s")
        _, _, nan, posinf, neginf, _ = stats.decode(stats.to_host([row])[0])
        assert (posinf, neginf) == signs and nan == math.isnan(real), (real, imag)
    flag = numerics.output_flag([torch.tensor([complex(-INF, 0.0)], dtype=torch.complex64)])
    assert numerics.fine(float(flag))


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu", "device-path"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8], ids=str)
def test_integer_magnitudes_do_not_wrap_at_the_dtype_s_minimum(dtype, device_path, monkeypatch):
    # |int8 -128| is 128, where `abs()` wraps back to -128: a report would print a negative
    # abs min and an abs max below |-128|
    if device_path:
        monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    low = torch.iinfo(dtype).min
    cases = [[low, 5], [low], [-3, 7], [-100, 0, 5], [4, 9], [-9, -4], [torch.iinfo(dtype).max, 1]]
    for values in cases:
        if dtype is torch.uint8 and min(values) < 0:
            continue
        t = torch.tensor(values, dtype=dtype)
        with torch.no_grad():
            row = stats.device_stats(t, sign_hints={}, site="s")
        abs_min, abs_max, nan, posinf, neginf, _ = stats.decode(stats.to_host([row])[0])
        assert (abs_min, abs_max) == (float(min(map(abs, values))), float(max(map(abs, values)))), values
        assert not nan and not posinf and not neginf


def test_smallest_nonzero_magnitude_for_underflow_checks():
    t = torch.tensor([0.0, -1e-6, 3.0, 0.0])
    with torch.no_grad():
        row = stats.device_stats(t, nonzero_min=True, sign_hints={}, site="s")
    abs_min, abs_max, _, _, _, nonzero = stats.decode(stats.to_host([row])[0])
    assert (abs_min, abs_max) == (0.0, 3.0)
    assert nonzero == pytest.approx(1e-6)


def test_a_tensor_the_fast_path_cannot_read_still_gets_its_numbers(monkeypatch):
    """Where reading |t| through its bits fails (a backend without integer aminmax, an unusual
    tensor), the plain reductions take over: no row may lose its numbers to an optimisation."""
    def unreadable(*args, **kwargs):
        raise RuntimeError("aminmax not implemented for 'Int'")

    monkeypatch.setattr(stats, "_bit_stats", unreadable)
    for name, t in special_tensors(torch.float32, 300).items():
        assert_matches(t, label=name, exact_beside_nan=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_device_path_stacks_a_pass_and_reads_it_at_once(dtype):
    """What a GPU gets: 0-d tensors left where they are, one stack and one transfer per pass;
    here run on CPU tensors, which take the same steps. The signed min and max tell the
    infinities exactly."""
    tensors = special_tensors(dtype, 300)
    bits = stats._BITS[dtype]
    with torch.no_grad():
        rows = [stats._bit_stats(t, bits, False, None, None, read_now=False) for t in tensors.values()]
    assert all(isinstance(x, torch.Tensor) and x.dim() == 0 for row in rows for x in row)
    for (name, t), values in zip(tensors.items(), stats.to_host(rows)):
        abs_min, abs_max, nan, posinf, neginf, _ = stats.decode(values)
        ref_min, ref_max, ref_nan, ref_posinf, ref_neginf = reference(t)
        assert nan == ref_nan, name
        if not nan:
            assert (abs_min, abs_max) == (ref_min, ref_max), name
            assert (posinf, neginf) == (ref_posinf, ref_neginf), name
        else:  # beside a nan, min and max are nan: the infinities are unknown
            assert posinf is None and neginf is None, name


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_large_device_tensor_is_summarised_in_pieces_to_the_same_row(dtype, layout, monkeypatch):
    """On a device, the smallest non-zero |t| is found by writing |t| out: past
    `DEVICE_PIECE_BYTES` a piece at a time (the peak memory of a step with 1.5 GiB logits grows
    by a piece, not by the logits), and the row is the one the whole tensor gives."""
    bits = stats._BITS[dtype]
    made = []
    real_abs = torch.Tensor.abs
    monkeypatch.setattr(torch.Tensor, "abs", lambda t: made.append(t.numel()) or real_abs(t))
    monkeypatch.setattr(stats, "_abs_into_workspace", lambda t, bits: None)  # as on a device
    for name, t in special_tensors(dtype, 3000).items():
        t = t.reshape(60, 50)
        if layout == "transposed":
            t = t.t()
        with torch.no_grad():
            monkeypatch.setattr(stats, "DEVICE_PIECE_BYTES", 1 << 40)
            whole = stats._bit_stats(t, bits, True, None, None, read_now=False)
            monkeypatch.setattr(stats, "DEVICE_PIECE_BYTES", 400 * t.element_size())
            made.clear()
            pieces = stats._bit_stats(t, bits, True, None, None, read_now=False)
        assert made and max(made) <= 400, (name, made)
        for a, b in zip(whole, pieces):
            assert torch.equal(a, b) or (a.isnan() and b.isnan()), name


def _device_summary(t: torch.Tensor):
    with torch.no_grad():
        row = stats._bit_stats(t, stats._BITS[t.dtype], False, None, None, read_now=False)
    return stats.decode(stats.to_host([row])[0])


def test_on_a_device_an_infinity_beside_finite_values_near_the_maximum_keeps_its_sign():
    # A sum of the values (the device row's signs before) overflowed here: (3e38 + 3e38) - inf
    # read as both infinities.
    t = torch.tensor([3e38, 3e38, -INF, 1.0])
    abs_min, abs_max, nan, posinf, neginf, _ = _device_summary(t)
    assert (abs_min, abs_max, nan, posinf, neginf) == (1.0, INF, False, False, True)
    abs_min, abs_max, nan, posinf, neginf, _ = _device_summary(-t)
    assert (abs_max, posinf, neginf) == (INF, True, False)


def test_the_device_row_is_computed_outside_autocast_and_autocast_is_back_after(monkeypatch):
    """Under autocast a norm or a sum would first copy a bfloat16 tensor to float32 (on CUDA):
    a pass and a write per value that the statistics must not cost."""
    seen = []
    real_norm = torch.linalg.vector_norm

    def watched(t, *args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return real_norm(t, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", watched)
    t = torch.tensor([0.5, -2.0, 3.0], dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        abs_min, abs_max, *_ = _device_summary(t)
        assert torch.is_autocast_enabled("cpu")
    assert seen == [False] and (abs_min, abs_max) == (0.5, 3.0)


@pytest.mark.cuda
def test_on_a_gpu_under_autocast_the_statistics_copy_no_tensor_to_float32():
    t = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        stats.device_stats(t)  # warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            row = stats.device_stats(t)
    names = {event.name for event in prof.events()}
    assert not names & {"aten::_to_copy", "aten::to", "aten::copy_"}, sorted(names)
    reference_max = float(t.float().abs().max())
    assert stats.decode(stats.to_host([row])[0])[1] == reference_max


def test_device_rows_beside_rows_of_another_kind_are_read_in_one_pass(monkeypatch):
    """Integers and complex numbers keep the plain row on a device; read with float tensors'
    device rows in one stack, each is turned into the host row its kind needs."""
    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    tensors = [torch.tensor([3.0, -INF, 0.5]), torch.tensor([-7, 2, 5]),
               torch.tensor([1.0, math.nan]), torch.tensor([1 + 1j, -2j]),
               torch.tensor([-2.0, 4.0])]
    with torch.no_grad():
        rows = [stats.device_stats(t) for t in tensors]
    assert [type(row) is stats.DeviceRow for row in rows] == [True, False, True, False, True]
    decoded = [stats.decode(values)[:5] for values in stats.to_host(rows)]
    assert decoded[0] == (0.5, INF, False, False, True)
    assert decoded[1] == (2.0, 7.0, False, False, False)
    assert math.isnan(decoded[2][1]) and decoded[2][2:] == (True, None, None)
    assert decoded[3][:3] == (pytest.approx(math.sqrt(2)), 2.0, False)
    assert decoded[4] == (2.0, 4.0, False, False, False)


def test_a_pass_of_mixed_dtypes_is_read_in_order_with_a_copy_per_dtype_not_per_value(monkeypatch):
    """Under autocast a pass mixes bfloat16 activations with float32 weights and gradients. A
    stack of mixed dtypes copies value by value (on a GPU a kernel launch each: 3,300 a pass of
    GPT-2); the read-back stacks each dtype apart and puts the rows back in order."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    tensors = [(torch.arange(1, 9) * (i + 1)).to(dtypes[i % 4]) for i in range(240)]
    tensors[7] = torch.tensor([2.0, -INF], dtype=torch.bfloat16)
    with torch.no_grad():
        rows = [stats.device_stats(t) for t in tensors]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        values = stats.to_host(rows)
    counts = collections.Counter(event.name for event in prof.events())
    assert counts["aten::copy_"] <= 12, counts["aten::copy_"]
    assert counts["aten::narrow"] <= 4, counts["aten::narrow"]
    for i, (t, row) in enumerate(zip(tensors, values)):
        abs_min, abs_max, nan, posinf, neginf, _ = stats.decode(row)
        if i == 7:
            assert (abs_min, abs_max, nan, posinf, neginf) == (2.0, INF, False, False, True)
        else:
            assert (abs_min, abs_max, nan) == (i + 1, 8 * (i + 1), False), (i, row)


def _rows_through_sink(tensors, sink):
    with torch.no_grad():
        return [stats.device_stats(t, sink=sink) for t in tensors]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_written_in_place_read_back_as_the_device_rows_do(monkeypatch, dtype, device):
    """A pass's device rows written into its sink (no tensor per row) read back to the same
    numbers as rows of 0-d tensors, over more rows than a block holds and beside rows of other
    kinds, in the pass's order (on a GPU, under bf16 autocast too)."""
    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    tensors = [t.to(device) for t in special_tensors(dtype, 300).values()]
    tensors = (tensors * (1 + 2 * row_sink.ROWS_PER_BLOCK // len(tensors)))[:2 * row_sink.ROWS_PER_BLOCK + 7]
    tensors[5] = torch.tensor([-7, 2, 5], device=device)  # an integer tensor: a plain row, beside them
    sink = stats.RowSink()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        rows = _rows_through_sink(tensors, sink)
    assert sum(type(row) is int for row in rows) == len(tensors) - 1
    with torch.no_grad():
        expected = stats.to_host([stats.device_stats(t) for t in tensors])
    got = stats.to_host(rows, sink)
    assert [str(row) for row in got] == [str(row) for row in expected]  # (nan == nan as text)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_written_together_read_back_as_lean_rows_written_one_at_a_time(monkeypatch, dtype, device):
    """A pass's weights are summarised together (`RowSink.write_many`: two multi-tensor
    reductions, abs max and max, per device and dtype). Their rows give what a lean row (one
    `aminmax`) gives, nan, abs max and the infinities, over more rows than a block holds and
    after rows written one at a time; what they give up is the abs min of a tensor holding a
    positive value (unmeasured) and the -inf beside a +inf with no nan."""
    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    cases = {name: t.to(device) for name, t in special_tensors(dtype, 300).items()}
    names = (list(cases) * (1 + 2 * row_sink.ROWS_PER_BLOCK // len(cases)))[:2 * row_sink.ROWS_PER_BLOCK + 7]
    one, together = stats.RowSink(abs_min=False), stats.RowSink(abs_min=False)
    _rows_through_sink([torch.ones(3, dtype=dtype, device=device)] * 5, together)  # rows before
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"), torch.no_grad():
        expected = stats.to_host([one.write(cases[name]) for name in names], one)
        got = stats.to_host(together.write_many([cases[name] for name in names]), together)
    for name, want, have in zip(names, expected, got):
        abs_min, abs_max, nan, posinf, neginf, _ = stats.decode(have)
        w_abs_min, w_abs_max, w_nan, w_posinf, w_neginf, _ = stats.decode(want)
        assert str((abs_max, nan, posinf)) == str((w_abs_max, w_nan, w_posinf)), (name, have, want)
        both = name.endswith("both infinities")
        assert neginf == (False if both else w_neginf), (name, have, want)
        values = cases[name].double()
        if values.isnan().any() or not (values > 0).any():  # (nan: abs min is nan, as its max)
            assert str(abs_min) == str(w_abs_min), (name, have, want)
        else:
            assert abs_min is None, (name, have)


def test_a_sink_handed_on_to_the_next_pass_reads_only_that_pass_s_rows(monkeypatch):
    """Blocks go from one pass to the next once read: a later, shorter pass reads its own
    values, also when read a few rows at a time (sync=True reads after each call)."""
    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    first = stats.RowSink()
    stats.to_host(_rows_through_sink([torch.full((3,), float("nan"))] * 40, first), first)
    first.release()
    second = stats.RowSink()
    tensors = [torch.tensor([1.0, -float(i + 2)]) for i in range(9)]
    rows = _rows_through_sink(tensors, second)
    read = []
    for start in range(0, 9, 4):
        read += stats.to_host(rows[start:start + 4], second)
    assert [stats.decode(values)[:3] for values in read] == [(1.0, i + 2.0, False) for i in range(9)]


def test_a_row_written_in_place_makes_no_object_for_the_garbage_collector(monkeypatch):
    """A handle is a plain int, and the row's numbers live in a block: writing a pass of rows
    leaves nothing the collector tracks (a 0-d tensor and a tuple per row did)."""
    import gc

    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    tensors = [torch.randn(4, dtype=torch.bfloat16) for _ in range(500)]
    warm = stats.RowSink()
    _rows_through_sink(tensors, warm)
    warm.release()  # its blocks, made once, serve the next pass
    sink = stats.RowSink()
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = len(gc.get_objects())
        rows = _rows_through_sink(tensors, sink)
        made = len(gc.get_objects()) - before
    finally:
        if enabled:
            gc.enable()
    assert all(type(row) is int for row in rows)
    assert made < 10, made


def test_a_row_whose_write_fails_leaves_no_stale_value_between_the_pass_s_rows(monkeypatch):
    """A tensor the in-place reductions refuse gets its plain row instead; the sink's row it took
    is left finite, not holding the last pass's value, for a check over the range."""
    from numguard_nb import numerics

    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    monkeypatch.setattr(numerics, "DEFERRED_DEVICE_TYPES", {"cpu"})
    earlier = stats.RowSink()
    _rows_through_sink([torch.full((2,), float("nan"))] * 3, earlier)
    earlier.release()  # its block, with nan rows, goes to the next pass
    refused = torch.tensor([1.0, 2.0])
    aminmax = torch.aminmax

    def refusing(t, *args, **kwargs):
        if t is refused and "out" in kwargs:
            raise RuntimeError("no out= for this kind of tensor")
        return aminmax(t, *args, **kwargs)

    monkeypatch.setattr(torch, "aminmax", refusing)
    sink = stats.RowSink()
    rows = _rows_through_sink([torch.tensor([1.0]), refused, torch.tensor([3.0])], sink)
    assert [type(row) is int for row in rows] == [True, False, True]
    assert bool(numerics.stats_flag(rows, sink).isfinite())
    assert [stats.decode(values)[1] for values in stats.to_host(rows, sink)] == [1.0, 2.0, 3.0]


def test_a_detached_guard_leaves_no_spare_blocks_of_rows_behind(monkeypatch):
    """The sinks' blocks go from pass to pass while a guard is attached; detaching frees them
    (on a GPU they are device memory)."""
    from torch import nn

    from numguard_nb import Guard

    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 1))
    with Guard(model):
        model(torch.randn(2, 4)).sum().backward()
        assert row_sink._spare_blocks  # handed on between passes
    assert not any(row_sink._spare_blocks.values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_row_written_under_autocast_makes_no_float32_copy_and_needs_no_switch(monkeypatch, device):
    """Autocast casts the functional `linalg_vector_norm` to float32 on a GPU (a copy of the
    tensor per row), but has no kernel for the `out=` overloads a sink writes with: the sink
    writes under autocast as it is, without turning it off and on per row."""
    from torch.profiler import ProfilerActivity, profile

    for op in ("aten::aminmax.out", "aten::linalg_vector_norm.out"):
        assert "Autocast" not in torch._C._dispatch_dump(op), op
    assert row_sink._OUT_OVERLOADS_AUTOCAST is False
    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    tensors = [torch.randn(64, 64, device=device, dtype=torch.bfloat16) for _ in range(4)]
    sink = stats.RowSink()
    with torch.autocast(device, dtype=torch.bfloat16), profile(activities=[ProfilerActivity.CPU]) as prof:
        rows = _rows_through_sink(tensors, sink)
    names = collections.Counter(event.name for event in prof.events())
    assert all(type(row) is int for row in rows)
    assert names["aten::_to_copy"] == 0 and names["aten::linalg_vector_norm"] == 4, names
    assert [stats.decode(values)[1] for values in stats.to_host(rows, sink)] == [
        float(t.abs().max()) for t in tensors]


def test_a_device_row_of_zeros_reads_plus_zero_not_minus_zero(monkeypatch):
    """abs max is max(-min, max): for zeros -0.0 beside 0.0, which a report printed as
    -0.00e+00; the row reads +0.0, as the host's does."""
    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    sink = stats.RowSink()
    zeros = [torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)]
    with torch.no_grad():
        rows = _rows_through_sink(zeros, sink) + [stats.device_stats(t) for t in zeros]
    values = stats.to_host(rows[:2], sink) + stats.to_host(rows[2:])
    assert [math.copysign(1.0, row[1]) for row in values] == [1.0] * 4, values


def test_sink_rows_of_interleaved_dtypes_read_back_in_the_pass_s_order(monkeypatch):
    """Under autocast a pass writes float32, bfloat16 and float16 rows turn about into their
    own blocks; read at once, or a few at a time as sync=True reads, each handle gets its own
    tensor's row, with one transfer per read (not the one-by-one fallback after an error)."""
    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    tensors = [torch.tensor([i + 1.0, -2.0 * (i + 1)], dtype=dtypes[i % 3] if i % 7 else torch.float32)
               for i in range(2 * row_sink.ROWS_PER_BLOCK + 50)]
    expected = [(i + 1.0, 2.0 * (i + 1)) for i in range(len(tensors))]
    monkeypatch.setattr(stats, "_one_to_host", lambda *_: pytest.fail("read one by one"))
    for piece in (len(tensors), 5, 97):
        sink = stats.RowSink()
        rows = _rows_through_sink(tensors, sink)
        read = []
        for start in range(0, len(rows), piece):
            read += stats.to_host(rows[start:start + piece], sink)
        got = [stats.decode(values)[:2] for values in read]
        assert got == [(float(torch.tensor(lo, dtype=t.dtype)), float(torch.tensor(hi, dtype=t.dtype)))
                       for (lo, hi), t in zip(expected, tensors)], piece
        sink.release()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_lean_sink_writes_one_reduction_a_row_and_reads_as_a_full_one_but_abs_min(
        monkeypatch, dtype, device):
    """A sink without abs_min (full mode's passes on a GPU, each reduction a launch) writes only
    the min and max of each tensor. Its rows read as a full sink's in everything detection
    uses (abs max, nan, the infinities and their signs); abs min is exact for a tensor of one
    sign (zeros, -0.0 and masks of zeros and -inf included) and None for one of both."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    cases = special_tensors(dtype, 300)
    cases["mask"] = torch.tensor([0.0, -INF, 0.0, -INF], dtype=dtype)
    cases["negative zeros"] = torch.tensor([-0.0, -0.0], dtype=dtype)
    tensors = [t.to(device) for t in cases.values()]
    lean, full = stats.RowSink(abs_min=False), stats.RowSink()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        lean_rows = _rows_through_sink(tensors, lean)
    names = collections.Counter(event.name for event in prof.events())
    assert names["aten::linalg_vector_norm"] == 0 and names["aten::aminmax"] == len(tensors), names
    got = [stats.decode(values) for values in stats.to_host(lean_rows, lean)]
    expected = [stats.decode(values) for values in stats.to_host(_rows_through_sink(tensors, full), full)]
    for name, t, (abs_min, *rest), (full_min, *full_rest) in zip(cases, tensors, got, expected):
        assert str(rest) == str(full_rest), name  # (nan == nan as text)
        numbers = t[~t.isnan()]
        if math.isnan(full_min) or (numbers >= 0).all() or (numbers <= 0).all():
            assert str(abs_min) == str(full_min), name
            assert abs_min is None or math.copysign(1.0, abs_min) == 1.0, name  # never -0.0
        else:
            assert abs_min is None, name


def test_abs_min_left_unmeasured_is_measured_for_the_tensors_given(monkeypatch):
    """What a report asks for its rows a lean pass left unmeasured: (abs min, abs max) per
    tensor, exact, in order, over several dtypes, under autocast as outside it; None for a
    tensor without values to read."""
    tensors = [torch.tensor([-3.0, 0.5, 2.0]), torch.tensor([1.0, -0.25], dtype=torch.bfloat16),
               torch.tensor([-2.0, 0.0, 4.0], dtype=torch.float16)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert stats.smallest_magnitudes(tensors) == [(0.5, 3.0), (0.25, 1.0), (0.0, 4.0)]
    assert torch.is_autocast_enabled("cpu") is False
    assert stats.smallest_magnitudes([torch.ones(2), torch.empty(2, device="meta")]) == [(1.0, 1.0), None]


@pytest.mark.parametrize("abs_min", [True, False])
def test_negative_zeros_read_back_as_zeros_a_report_prints_without_a_sign(deferred_on_host, abs_min):
    sink = row_sink.RowSink(abs_min)
    handles = [stats.device_stats(t, sink=sink) for t in (torch.tensor([-0.0, -0.0]), torch.tensor([-0.0, 2.0]))]
    rows = stats.to_host(handles, sink)
    for row in rows:
        assert math.copysign(1.0, stats.decode(row)[0]) == 1.0, row  # abs min
    assert math.copysign(1.0, stats.decode(rows[0])[1]) == 1.0, rows[0]  # abs max
    assert stats.decode(rows[1])[1] == 2.0
