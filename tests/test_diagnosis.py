"""The diagnosis suite (benchmarks/diagnosis*.py): its ground truth and its scorer.

Every case's declared truth must be what the independent tracer finds, every trap must be
healthy while really carrying inf, and the scorer must produce a verdict from each detector.
Detectors' scores are not asserted: they are what the suite measures.
"""

import inspect
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import diagnosis  # noqa: E402
import diagnosis_models as models  # noqa: E402
from diagnosis_cases import (  # noqa: E402
    BACKWARD, CASES, CASES_BY_NAME, FORWARD, IN_LOOP, Truth, run_steps,
)
from diagnosis_tracer import trace  # noqa: E402

BUGS = [case for case in CASES if not case.trap]
TRAPS = [case for case in CASES if case.trap]


def test_the_suite_has_enough_cases_with_citations():
    assert len(BUGS) >= 12 and len(TRAPS) >= 2
    assert len(CASES_BY_NAME) == len(CASES)
    for case in CASES:
        assert case.sources, case.name


@pytest.mark.parametrize("case", BUGS, ids=lambda case: case.name)
def test_declared_truth_is_what_the_tracer_finds(case):
    traced = trace(case)
    assert not traced.healthy
    assert traced.truth == case.truth
    # the batches before the bug run clean: the bug is in the declared batch, not earlier
    assert all(traced.first_producers.get(b) is None for b in range(case.truth.batch))


@pytest.mark.parametrize("case", TRAPS, ids=lambda case: case.name)
def test_traps_are_healthy_though_inf_passes_through(case):
    traced = trace(case)
    assert traced.healthy and traced.culprit is None and traced.crash is None
    assert traced.nonfinite_seen  # a trap that never carried an inf would test nothing
    assert all(math.isfinite(loss) for loss in traced.losses)


def test_grad_scaler_trap_really_skips_steps():
    run = CASES_BY_NAME["trap_grad_scaler_warmup"].build()
    run_steps(run)
    assert run.scaler.get_scale() < 2.0 ** 16  # found inf gradients and backed off


def test_a_scaler_the_loop_makes_is_handed_to_no_detector_and_skips_its_warm_up():
    run = CASES_BY_NAME["trap_grad_scaler_in_loop"].build()
    assert run.scaler is None and run.make_scaler is not None  # what the harness can pass: nothing
    run_steps(run)
    assert run.scaler.get_scale() <= 2.0 ** 20  # 20 and more skipped steps from 2**40


def test_scorer_gives_every_detector_a_row():
    names = ["masked_mean_empty", "distance_at_zero", "trap_padding_mask"]
    results = diagnosis.evaluate([CASES_BY_NAME[name] for name in names])
    assert [entry["case"] for entry in results] == names
    for entry in results:
        assert entry["tracer_agrees"]
        assert set(entry["detectors"]) == set(diagnosis.DETECTORS)
        for scored in entry["detectors"].values():
            expected = {"healthy"} if entry["trap"] else set(diagnosis.ANSWERS)
            assert set(scored["score"]) == expected
            assert isinstance(scored["verdict"]["alarm"], bool)
    table = diagnosis.markdown(results)
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    for name in names:
        assert sum(row.startswith(f"| {name} |") for row in rows) == 2  # score and what it named
    assert any(row.startswith("| **total**") for row in rows)


# ---- scoring rules ----------------------------------------------------------------------------
FORWARD_BUG = next(case for case in BUGS
                   if case.truth.phase == FORWARD and not case.truth.module.startswith("("))
BACKWARD_BUG = next(case for case in BUGS if case.truth.phase == BACKWARD)


def _verdict_of(truth: Truth, **changes):
    fields = dict(alarm=True, module=truth.module, phase=truth.phase, op=truth.op,
                  node=truth.node, batch=truth.batch)
    fields.update(changes)
    return diagnosis.Verdict(**fields)


def test_score_of_an_exact_answer_and_of_silence():
    truth = FORWARD_BUG.truth
    assert diagnosis.score(FORWARD_BUG, _verdict_of(truth)) == dict.fromkeys(diagnosis.ANSWERS, True)
    assert diagnosis.score(FORWARD_BUG, diagnosis.Verdict(alarm=False)) == dict.fromkeys(
        diagnosis.ANSWERS, False)
    wrong_batch = diagnosis.score(FORWARD_BUG, _verdict_of(truth, batch=truth.batch + 1))
    assert wrong_batch == {"module": True, "phase": True, "op": True, "batch": False}


def test_score_of_backward_ops_needs_the_node():
    truth = BACKWARD_BUG.truth
    node_only = diagnosis.score(BACKWARD_BUG, _verdict_of(truth, op=None))
    assert node_only["op"]
    assert not diagnosis.score(BACKWARD_BUG, _verdict_of(truth, node=None))["op"]
    assert not diagnosis.score(BACKWARD_BUG, _verdict_of(truth, op="aten.other.default"))["op"]


def test_score_of_traps_is_whether_the_detector_kept_quiet():
    trap = TRAPS[0]
    assert diagnosis.score(trap, diagnosis.Verdict(alarm=False)) == {"healthy": True}
    assert diagnosis.score(trap, diagnosis.Verdict(alarm=True, module="x")) == {"healthy": False}
    assert diagnosis.score(trap, diagnosis.Verdict(alarm=False, crash="ValueError")) == {
        "healthy": False}


# ---- reading the detectors' output ------------------------------------------------------------
def test_hf_dump_is_read_at_its_last_frame():
    printed = "\n".join([
        "output has infs",
        "",
        "Detected inf/nan during batch_number=3",
        "Last 2 forward frames:",
        "abs min  abs max  metadata",
        "                  block.0.wi Linear",
        "1.00e+00 2.00e+00 weight",
        "                  block.0.wo Linear",
        "             None input[1]",
        "0.00e+00      inf output",
    ])
    assert diagnosis._hf_parse(printed) == ("block.0.wo", 3)
    root = printed.replace("                  block.0.wo Linear", "                   TinyT5")
    assert diagnosis._hf_parse(root) == ("", 3)
    assert diagnosis._hf_parse("no detection here") == (None, None)


def _frame(function, code):
    """One frame of a printed traceback: the line of `function` that starts with `code`."""
    lines, first = inspect.getsourcelines(function)
    offset = next(i for i, line in enumerate(lines) if line.strip().startswith(code))
    return (f'  File "{inspect.getsourcefile(function)}", line {first + offset}, in forward\n'
            f"    {lines[offset].strip()}\n")


def test_anomaly_traceback_is_mapped_to_the_module_that_made_the_node():
    run = CASES_BY_NAME["t5_ff_fp16_overflow"].build()
    model = run.models[""]
    linear_forward = type(model.lm_head).forward
    stack = ("Traceback of forward call that caused the error:\n"
             + _frame(models.TinyT5.forward, "hidden_states = block(")
             + _frame(models.T5Block.forward, "return self.layer[0](")
             + _frame(models.T5LayerFF.forward, "forwarded = self.DenseReluDense(")
             + _frame(models.T5DenseReluDense.forward, "h = self.wo(")
             + _frame(linear_forward, "return F.linear("))
    # a loop over a ModuleList cannot tell block 0 from block 1: their common ancestor
    assert diagnosis.module_from_stack(stack, run.models) == "block"
    # the attribute the calling line names tells wi from wo
    feed_forward = {"": model.block[1].layer[0].DenseReluDense}
    inner = (_frame(models.T5DenseReluDense.forward, "h = self.wo(")
             + _frame(linear_forward, "return F.linear("))
    assert diagnosis.module_from_stack(inner, feed_forward) == "wo"
    # code in no module's forward: the training loop's own
    outside = '  File "/elsewhere/train.py", line 3, in step\n    loss = f(x)\n'
    assert diagnosis.module_from_stack(outside, run.models) == IN_LOOP


# ---- the GPU's statistics path, run on the host ------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}], ids=["full", "sentinel"])
def test_the_gpu_statistics_path_names_what_the_host_path_names(options, monkeypatch):
    """A GPU summarises each tensor as a device row (the smallest |t| and the signed min and max,
    stacked and read once per pass); the host reads |t| at once. Run on the host, the two must
    give the same verdict in every case. (What they say may differ: beside a nan a device row
    does not tell the infinities.)"""
    import dataclasses

    from numguard_nb import stats

    def verdicts():
        return {case.name: dataclasses.replace(diagnosis.run_numguard(case, **options), said="")
                for case in CASES}

    read_at_once = verdicts()
    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    assert verdicts() == read_at_once
