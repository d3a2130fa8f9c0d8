"""Parity with `transformers.debug_utils`: our drop-ins print what transformers prints.

Both detectors run on the same seeded models and inputs (each on its own copy: transformers'
detector never removes its hooks). Stdout is compared frame by frame: every frame transformers
prints must appear in ours, in the same order, with the same header (module name and class) and
every one of its lines (abs min, abs max, metadata). Ours may add lines (keyword inputs) and
expands containers that transformers prints as `not a tensor X` into rows `X[...]`.

Known, documented difference: for an in-place module (nn.ReLU(inplace=True)) we summarise its
inputs before it runs, transformers after it ran (by then the input was overwritten). The parity
models avoid in-place modules; `test_inplace_module_inputs_are_the_one_known_difference` pins the
difference down.

On models with positional inputs only, no buffers and no in-place modules, the two print the same
stdout line for line (`assert_same_output`): detections within one batch and across several (with
transformers' "*** Starting batch number=N ***" separators), a tensor holding both nan and inf,
traced batches, `abort_after_batch_num` (also when the loop goes on after the error), a nan made
by the model's own code. Two behaviours of transformers' are not copied: after a traced batch in
which some value held inf/nan, transformers keeps its detection flag and raises at the first module
of the next untraced batch, showing that finite frame (tracing "turns detection off", as it
documents); and after any traced batch its frame buffer loses its `max_frames_to_save` bound.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import re

import pytest
import torch
import transformers
from torch import nn
from transformers import debug_utils as hf

import numguard_nb as ng
from numguard_nb.demo import build_overflowing_t5

transformers.logging.set_verbosity_error()

HF_ERROR = ("DebugUnderflowOverflow: inf/nan detected, aborting as there is no point running "
            "further. Please scroll up above this traceback to see the activation values prior "
            "to this event.")
_NOT_FRAME = re.compile(r"^(Detected inf/nan during|Last \d+ forward frames:|abs min  abs max)"
                        r"|\*\*\*| has (nans|infs)$")


# ---- parsing and comparing printed frames -------------------------------------------------
def parse_frames(text):
    """[(header, [row lines])] from DebugUnderflowOverflow output, in printed order."""
    frames = []
    for line in text.splitlines():
        if not line.strip() or _NOT_FRAME.search(line):
            continue
        if line.startswith(" " * 18):  # "<17 spaces> <name> <Class>" (the model: empty name)
            frames.append((line, []))
        else:
            assert frames, f"row before any frame header: {line!r}"
            frames[-1][1].append(line)
    return frames


def _row_covered(hf_row, our_rows):
    if hf_row in our_rows:
        return True
    match = re.fullmatch(r"\s*not a tensor (\S+)", hf_row)
    return bool(match) and any(row.split()[-1].startswith(match.group(1) + "[") for row in our_rows)


def assert_frames_contained(hf_text, our_text, allow=lambda header, row: False):
    """Every frame HF printed appears in ours, in order, with every HF line."""
    hf_frames, our_frames = parse_frames(hf_text), parse_frames(our_text)
    assert hf_frames, "transformers printed no frame"
    position = 0
    for header, rows in hf_frames:
        for index in range(position, len(our_frames)):
            if our_frames[index][0] == header:
                break
        else:
            pytest.fail(f"frame {header.strip()!r} printed by transformers is missing from ours "
                        f"(after our frame {position})\n--- transformers:\n{hf_text}\n--- ours:\n{our_text}")
        our_rows = our_frames[index][1]
        for row in rows:
            assert _row_covered(row, our_rows) or allow(header, row), (
                f"frame {header.strip()!r}: transformers' line {row!r} is not among ours {our_rows}")
        position = index + 1
    return hf_frames, our_frames


def run_printing(make_detector, model, batches):
    """Run `batches` through a detector on `model`; (stdout, ValueError message or None, batches done)."""
    detector = make_detector(model)
    buffer = io.StringIO()
    done, message = 0, None
    with contextlib.redirect_stdout(buffer):
        try:
            for batch in batches:
                model(**batch) if isinstance(batch, dict) else model(batch)
                done += 1
        except ValueError as error:
            message = str(error)
        finally:
            if isinstance(detector, ng.DebugUnderflowOverflow):
                detector.remove()
    return buffer.getvalue(), message, done


def lines_matching(text, pattern):
    return [line for line in text.splitlines() if re.search(pattern, line)]


def assert_same_output(make_model, batches, keep_going=False, **options):
    """Both detectors, each on a fresh `make_model()`, print the same stdout line for line and
    raise the same errors after as many batches; returns that stdout. `keep_going`: the loop
    catches each ValueError and goes on with the next batch."""
    results = []
    for cls in (hf.DebugUnderflowOverflow, ng.DebugUnderflowOverflow):
        if keep_going:
            results.append(_run_catching(cls, make_model(), batches, options))
        else:
            results.append(run_printing(lambda m, cls=cls: cls(m, **options), make_model(), batches))
    (hf_text, *hf_rest), (our_text, *our_rest) = results
    diff = "".join(difflib.unified_diff(hf_text.splitlines(True), our_text.splitlines(True),
                                        "transformers", "numguard_nb", n=2))
    assert our_text.splitlines() == hf_text.splitlines(), f"stdout differs:\n{diff}"
    assert our_rest == hf_rest
    return hf_text, hf_rest


def _run_catching(cls, model, batches, options):
    detector = cls(model, **options)
    buffer, errors = io.StringIO(), []
    with contextlib.redirect_stdout(buffer):
        for batch in batches:
            try:
                model(batch)
            except ValueError as error:
                errors.append(str(error))
    if isinstance(detector, ng.DebugUnderflowOverflow):
        detector.remove()
    return buffer.getvalue(), errors


# ---- models ---------------------------------------------------------------------------------
class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


class NanAndInf(nn.Module):
    """nan where its input is below -40, +inf where it is above 40: both in one tensor."""

    def forward(self, x):
        nan, inf = torch.full_like(x, float("nan")), torch.full_like(x, float("inf"))
        return torch.where(x < -40, nan, torch.where(x > 40, inf, x))


class OwnCodeNan(nn.Module):
    """Two submodules, then 0/0 in its own code when its input is large."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        y = self.second(self.first(x))
        return y / (y - y) if x.abs().max() > 10 else y


# ---- detection parity -----------------------------------------------------------------------
def test_t5_fp16_overflow_prints_the_same_frames_and_raises_the_same_error():
    hf_model, batch = build_overflowing_t5()
    hf_text, hf_error, hf_done = run_printing(hf.DebugUnderflowOverflow, hf_model, [batch])
    our_model, batch = build_overflowing_t5()
    our_text, our_error, our_done = run_printing(ng.DebugUnderflowOverflow, our_model, [batch])

    assert hf_error == HF_ERROR and our_error == hf_error
    assert hf_done == our_done == 0
    for pattern in (r"^Detected inf/nan during batch_number=", r"^Last \d+ forward frames:$",
                    r" has (nans|infs)$"):
        assert lines_matching(our_text, pattern) == lines_matching(hf_text, pattern), pattern
    hf_frames, our_frames = assert_frames_contained(hf_text, our_text)
    # both stop at the same module: the fp16 feed-forward output projection
    assert hf_frames[-1][0] == our_frames[-1][0]
    assert hf_frames[-1][0].split() == ["encoder.block.1.layer.1.DenseReluDense.wo", "Linear"]
    assert len(hf_frames) == len(our_frames) == 21
    # ours adds the keyword inputs transformers cannot see
    assert any("input[position_bias]" in row for _, rows in our_frames for row in rows)


def _exp_model():
    """No in-place module; exp overflows (beyond 88.7) only when tanh saturates."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), Exp(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.fill_(1.0)  # |bias| <= 0.5: tanh within +-0.5 for small inputs
        model[2].weight.fill_(12.0)  # 8 * 12 * tanh: <= 48 normally, 96 when saturated
        model[2].bias.zero_()
    return model


def _exp_batches():
    torch.manual_seed(1)
    batches = [torch.randn(3, 4) * 0.05 for _ in range(5)]  # small: tanh ~ 0, exp finite
    batches.append(torch.full((3, 4), 50.0))  # tanh saturates at 1: exp(96) overflows
    return batches


def test_sequential_exp_overflow_after_clean_batches_prints_the_same_frames():
    # Five clean batches, then one that overflows: transformers' 21 saved frames reach back
    # across several earlier batches, and ours must show the same ones.
    hf_model = _exp_model()
    hf_text, hf_error, hf_done = run_printing(hf.DebugUnderflowOverflow, hf_model, _exp_batches())
    our_model = _exp_model()
    our_text, our_error, our_done = run_printing(ng.DebugUnderflowOverflow, our_model,
                                                 _exp_batches())
    assert hf_error == HF_ERROR and our_error == HF_ERROR
    assert hf_done == our_done == 5
    assert lines_matching(hf_text, r"^Detected inf/nan") == ["Detected inf/nan during batch_number=5"]
    for pattern in (r"^Detected inf/nan during batch_number=", r"^Last \d+ forward frames:$",
                    r" has (nans|infs)$"):
        assert lines_matching(our_text, pattern) == lines_matching(hf_text, pattern), pattern
    hf_frames, our_frames = assert_frames_contained(hf_text, our_text)
    assert len(hf_frames) == len(our_frames) == 21
    assert hf_frames[-1][0].split() == ["3", "Exp"] == our_frames[-1][0].split()


def test_a_detection_in_the_first_batch_prints_the_same_lines():
    text, (error, done) = assert_same_output(_exp_model, _exp_batches()[-1:])
    assert error == HF_ERROR and done == 0
    assert text.count("*** Starting batch number=0 ***") == 1  # above the first saved frame


@pytest.mark.parametrize("max_frames", [3, 21, 100, None])  # None: every frame
def test_a_detection_after_several_batches_prints_the_same_lines(max_frames):
    text, (error, done) = assert_same_output(_exp_model, _exp_batches(),
                                             max_frames_to_save=max_frames)
    assert error == HF_ERROR and done == 5
    # the saved frames reach back over batch boundaries: each batch's first frame says so
    separators = re.findall(r"\*\*\* Starting batch number=(\d) \*\*\*", text)
    everything = ["0", "1", "2", "3", "4", "5"]
    expected = {3: [], 21: ["3", "4", "5"], 100: everything, None: everything}[max_frames]
    assert separators == expected


def test_a_tensor_with_nan_and_inf_prints_both_lines():
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), NanAndInf(), nn.Linear(4, 2))

    torch.manual_seed(1)
    batches = [torch.randn(3, 4), torch.tensor([[100.0] * 4, [-100.0] * 4, [1.0] * 4])]
    text, (error, done) = assert_same_output(model, batches)
    assert error == HF_ERROR and done == 1
    assert lines_matching(text, r" has (nans|infs)$") == ["output has nans", "output has infs"]


def test_a_nan_made_by_the_models_own_code_prints_the_same_lines():
    def model():
        torch.manual_seed(0)
        return OwnCodeNan()

    batches = _exp_batches()[:2] + [torch.full((3, 4), 50.0)]
    text, (error, done) = assert_same_output(model, batches)
    assert error == HF_ERROR and done == 2
    # transformers has counted the batch by then: its model's frame closes the batch
    assert lines_matching(text, r"^Detected") == ["Detected inf/nan during batch_number=3"]


class OwnCodeInfBetween(nn.Module):
    """Its own code divides by 0 between its two submodules, when its input is large."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.first(x)
        return self.second(h / 0 if x.abs().max() > 10 else h)


def _nan_in_the_data():
    batches = _exp_batches()[:2]
    bad = batches[1].clone()
    bad[0, 0] = float("nan")
    return batches + [bad]


@pytest.mark.parametrize("case", ["nan in the data", "inf handed to a submodule"])
def test_a_value_a_submodule_is_given_prints_the_batch_transformers_prints(case):
    # transformers stops at the submodule's frame, before the model's own frame counts the batch
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)) if case == "nan in the data" \
            else OwnCodeInfBetween()

    batches = _nan_in_the_data() if case == "nan in the data" else (
        _exp_batches()[:2] + [torch.full((3, 4), 50.0)])
    text, _ = assert_same_output(model, batches)
    assert lines_matching(text, r"^Detected") == ["Detected inf/nan during batch_number=2"]


def test_trace_batch_nums_changed_on_the_live_detector_prints_what_transformers_prints():
    # transformers reads the list at every call (its hooks cannot be removed, so a notebook
    # re-targets tracing by changing it)
    texts = []
    for cls in (hf.DebugUnderflowOverflow, ng.DebugUnderflowOverflow):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            detector = cls(model)
            model(torch.ones(2, 4))
            detector.trace_batch_nums.append(1)
            model(torch.ones(2, 4))
            model(torch.ones(2, 4))
        texts.append(buffer.getvalue())
        if isinstance(detector, ng.DebugUnderflowOverflow):
            detector.remove()
    assert texts[1] == texts[0] and "*** Starting batch number=1 ***" in texts[0]


def test_no_frames_saved_prints_what_transformers_prints():
    text, (error, done) = assert_same_output(_exp_model, _exp_batches(), max_frames_to_save=0)
    assert error == HF_ERROR


def test_detected_overflow_says_what_transformers_says():
    for cls in (hf.DebugUnderflowOverflow, ng.DebugUnderflowOverflow):
        model = _exp_model()
        detector = cls(model)
        with contextlib.redirect_stdout(io.StringIO()):
            model(_exp_batches()[0])
            assert detector.detected_overflow is False, cls
            with pytest.raises(ValueError):
                model(_exp_batches()[-1])
        assert detector.detected_overflow is True, cls
        if cls is ng.DebugUnderflowOverflow:
            detector.remove()


def test_the_detectors_report_holds_the_frames_it_printed():
    model = _exp_model()
    detector = ng.DebugUnderflowOverflow(model, max_frames_to_save=4)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            for batch in _exp_batches()[:2]:
                model(batch)
            assert len(detector.report.frames) == 4  # the frames transformers keeps
            with pytest.raises(ValueError):
                model(_exp_batches()[-1])
    finally:
        detector.remove()
    report = detector.report
    assert not report.ok and len(report.frames) == 4
    assert [f.label for f in report.frames] == ["0", "1", "2", "3"]  # batch 2, up to Exp


@pytest.mark.parametrize("traced", [[0], [1, 2], [1, 3]])
def test_traced_batches_print_the_same_lines(traced):
    text, (error, done) = assert_same_output(_exp_model, _exp_batches()[:5],
                                             trace_batch_nums=traced)
    assert error is None and done == 5
    assert re.findall(r"Starting batch number=(\d)", text) == [str(b) for b in traced]


def test_a_traced_batch_with_inf_and_nan_prints_the_same_lines():
    # the run ends with the traced batch: transformers' raise at the next batch is not copied
    text, (error, done) = assert_same_output(_exp_model, _exp_batches()[:1] + _exp_batches()[-1:],
                                             trace_batch_nums=[1])
    assert error is None and done == 2
    assert "input[0] has infs" in text and "output has nans" in text


def test_a_detection_after_a_traced_batch_prints_the_same_lines():
    batches = _exp_batches()[:4] + _exp_batches()[-1:]
    text, (error, done) = assert_same_output(_exp_model, batches, trace_batch_nums=[1])
    assert error == HF_ERROR and done == 4
    # transformers' saved frames start after the traced batch
    assert re.findall(r"Starting batch number=(\d)", text) == ["1", "2", "3", "4"]


@pytest.mark.parametrize("traced", [[], [1, 2]])
def test_abort_after_batch_num_prints_the_same_lines(traced):
    text, (error, done) = assert_same_output(_exp_model, _exp_batches()[:5],
                                             abort_after_batch_num=2, trace_batch_nums=traced)
    assert (error, done) == ("DebugUnderflowOverflow: aborting after 3 batches due to "
                             "`abort_after_batch_num=2` arg", 2)


def test_abort_after_batch_num_says_the_same_number_every_time_after():
    _, (errors,) = assert_same_output(_exp_model, _exp_batches(), keep_going=True,
                                      abort_after_batch_num=1)
    assert errors == ["DebugUnderflowOverflow: aborting after 2 batches due to "
                      "`abort_after_batch_num=1` arg"] * 5


def test_inplace_module_inputs_are_the_one_known_difference():
    def model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 4), Exp())
        with torch.no_grad():
            m[2].weight.fill_(30.0)
        return m

    x = torch.randn(3, 4)
    hf_text, hf_error, _ = run_printing(hf.DebugUnderflowOverflow, model(), [x])
    our_text, our_error, _ = run_printing(ng.DebugUnderflowOverflow, model(), [x])
    assert hf_error == our_error == HF_ERROR
    relu = " " * 18 + "1 ReLU"
    differences = []
    assert_frames_contained(hf_text, our_text,
                            allow=lambda header, row: header == relu and differences.append(row) is None)
    # the only line of transformers' we do not print: the ReLU's input, which transformers reads
    # after the ReLU overwrote it (so it equals the ReLU's output); ours is the Linear's output.
    assert [row.split()[-1] for row in differences] == ["input[0]"]
    ours = dict(parse_frames(our_text))
    hf_frames = dict(parse_frames(hf_text))
    assert hf_frames[relu][0].split()[:2] == hf_frames[relu][1].split()[:2]  # input == output
    linear_output = next(r for r in ours[" " * 18 + "0 Linear"] if r.endswith(" output"))
    assert ours[relu][0].split()[:2] == linear_output.split()[:2]


# ---- tracing and aborting -------------------------------------------------------------------
def _fp32_t5():
    model, batch = build_overflowing_t5()
    return model.float(), batch


def test_trace_batch_nums_prints_every_frame_transformers_prints():
    hf_model, batch = _fp32_t5()
    hf_text, hf_error, hf_done = run_printing(
        lambda m: hf.DebugUnderflowOverflow(m, trace_batch_nums=[1]), hf_model, [batch] * 3)
    our_model, batch = _fp32_t5()
    our_text, our_error, our_done = run_printing(
        lambda m: ng.DebugUnderflowOverflow(m, trace_batch_nums=[1]), our_model, [batch] * 3)
    assert hf_error is None and our_error is None and hf_done == our_done == 3
    hf_frames, our_frames = assert_frames_contained(hf_text, our_text)
    assert len(hf_frames) > 50  # the whole batch: every module call of a T5 forward
    assert len(our_frames) == len(hf_frames)  # one printed frame per call, no more
    assert lines_matching(our_text, r"Starting batch number") == [
        " " * 17 + " *** Starting batch number=1 ***"]
    assert lines_matching(hf_text, r"Starting batch number=1 \*\*\*$")


@pytest.mark.parametrize("abort_after", [0, 1, 3])
def test_abort_after_batch_num_raises_the_same_error_at_the_same_batch(abort_after):
    batches = _exp_batches()[:5]
    results = []
    for cls in (hf.DebugUnderflowOverflow, ng.DebugUnderflowOverflow):
        _text, error, done = run_printing(
            lambda m, cls=cls: cls(m, abort_after_batch_num=abort_after), _exp_model(), batches)
        results.append((error, done))
    assert results[0] == results[1]
    error, done = results[0]
    assert done == abort_after  # the forward of batch `abort_after` raised at its end
    assert error == (f"DebugUnderflowOverflow: aborting after {abort_after + 1} batches due to "
                     f"`abort_after_batch_num={abort_after}` arg")


# ---- detect_overflow -----------------------------------------------------------------------
_INF, _NAN = float("inf"), float("nan")
TENSORS = {
    "finite": torch.tensor([1.0, -2.0, 3.0]),
    "nan": torch.tensor([1.0, _NAN]),
    "inf": torch.tensor([1.0, _INF]),
    "-inf": torch.tensor([-_INF, 1.0]),
    "nan and inf": torch.tensor([_NAN, -_INF, 1.0, _INF]),
    "all nan": torch.full((4,), _NAN),
    "fp16 overflow": torch.tensor([70000.0, 1.0]).half(),
    "bf16 nan and inf": torch.tensor([_NAN, _INF]).bfloat16(),
    "0-dim nan": torch.tensor(_NAN),
    "int": torch.arange(5),
    "bool": torch.tensor([True, False]),
    "empty": torch.empty(0, 3),
    "complex inf": torch.tensor([complex(_INF, 0.0), 1j]),
}


@pytest.mark.parametrize("name", list(TENSORS))
def test_detect_overflow_prints_the_same_lines_and_returns_the_same_bool(name):
    tensor = TENSORS[name]
    results = []
    for function in (hf.detect_overflow, ng.detect_overflow):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            detected = function(tensor, "ctx")
        results.append((detected, buffer.getvalue()))
    assert results[1] == results[0]
    assert isinstance(results[1][0], bool)


def test_detect_overflow_finds_both_kinds_in_one_tensor():
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert ng.detect_overflow(TENSORS["nan and inf"], "x") is True
    assert buffer.getvalue() == "x has nans\nx has infs\n"


def test_on_a_device_the_drop_in_prints_every_abs_min_as_transformers_does(deferred_on_host):
    """On a GPU full mode measures abs min only where a report shows it (`stats.RowSink`); the
    drop-in prints every saved frame, so it measures every row and prints transformers' lines."""
    text, (error, done) = assert_same_output(_exp_model, _exp_batches(), max_frames_to_save=21)
    assert error == HF_ERROR and done == 5
