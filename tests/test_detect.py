"""The producer-vs-carrier rules (numguard_nb.guard.detect) on hand-made slots: no model runs.

A pass is built the way the Guard records one: host statistics rows in `pass_.values`, calls in
closing order, slots as plain tuples pointing at their row. The rules object is a GuardOptions.
"""

import itertools
import math

import pytest
import torch

from numguard_nb._schema import (
    BACKWARD, BUFFER, CAUSE_BACKWARD, CAUSE_BACKWARD_INLINE, CAUSE_DATA, CAUSE_FORWARD,
    CAUSE_LOSS_GRADIENT, CAUSE_UNATTRIBUTED, CAUSE_WEIGHTS, FORWARD, GRAD_INPUT, GRAD_OUTPUT,
    GRAD_PARAM, INPUT, OUTPUT, PARAM, VALUE_NONE, VALUE_TENSOR,
)
from numguard_nb.guard import GuardOptions, detect
from numguard_nb.guard.passes import CallRecord, PassRecord

# Host statistics rows: (abs min, abs max, signs), as stats.to_host gives them.
FINITE = [0.5, 2.0, 0.0]
POSINF = [0.5, math.inf, math.inf]
NEGINF = [0.0, math.inf, -math.inf]
NAN = [math.nan, math.nan, math.nan]
NEGINF_DATA = [1.0, math.inf, -math.inf]  # -inf next to finite values: no zeros, so no mask
BEYOND_FP16 = [0.5, 1e5, 0.0]  # finite in float32, an overflow in float16

RULES = GuardOptions()
_module_ids = itertools.count(1)


class Recording:
    """A pass being recorded by hand."""

    def __init__(self):
        self.pass_ = PassRecord()

    def slot(self, role, category, row, dtype=torch.float32):
        index = len(self.pass_.values)
        self.pass_.values.append(row)
        return (role, category, VALUE_TENSOR, dtype, (2, 2), index, next(self.pass_.seq))

    def forward_call(self, name, slots, parent=None, module_class="Module"):
        """A forward call, closed now (children close before their parent)."""
        call = CallRecord(next(_module_ids), name, module_class, FORWARD, 0, 0, parent is None)
        call.slots.extend(slots)
        if parent is not None:
            call.parent = parent
            call.root_id = parent.root_id
        self.pass_.close(call)
        return call

    def same(self, slot, role, category):
        """A slot of the very value `slot` holds, seen again (as the Guard's cache does)."""
        return (role, category, VALUE_TENSOR, slot[3], slot[4], slot[5], next(self.pass_.seq))

    def gradient(self, forward_call, role, category, row):
        """A gradient arriving in backward for `forward_call` (arrival order = call order)."""
        call = self.pass_.backward_call(forward_call)
        slot = self.slot(role, category, row)
        call.slots.append(slot)
        return call, slot


def close(rec, call, slots):
    """Close a call whose inputs were recorded already: add its outputs, after its children."""
    call.slots.extend(slots)
    rec.pass_.close(call)


def forward_calls(names_and_parents):
    """Forward calls recorded in a pass of their own (for a backward pass to refer to)."""
    recording = Recording()
    calls = {}
    for name, parent in names_and_parents:
        calls[name] = recording.forward_call(name, [], calls.get(parent))
    return calls


# ---- what is wrong with one value ---------------------------------------------------------------
def test_value_kinds_name_nan_each_infinity_and_an_overflow_beyond_the_limit():
    rec = Recording()
    kinds = [detect.value_kinds(rec.pass_, rec.slot("x", OUTPUT, row), 65504.0)
             for row in (FINITE, POSINF, NEGINF, NAN, BEYOND_FP16)]
    assert kinds == [frozenset(), {"+inf"}, {"-inf"}, {"nan"}, {"overflow"}]
    assert detect.value_kinds(rec.pass_, rec.slot("x", OUTPUT, BEYOND_FP16), None) == frozenset()
    no_stats = ("x", OUTPUT, VALUE_NONE, None, None, None, 0)
    assert detect.value_kinds(rec.pass_, no_stats, 65504.0) == frozenset()


def test_has_problem_sees_nan_inf_and_with_a_limit_values_beyond_it():
    for row, limit, expected in [(FINITE, None, False), (NAN, None, True), (NEGINF, None, True),
                                 (BEYOND_FP16, None, False), (BEYOND_FP16, 65504.0, True)]:
        rec = Recording()
        rec.slot("x", OUTPUT, row)
        assert detect.has_problem(rec.pass_, limit) is expected, (row, limit)


# ---- forward ------------------------------------------------------------------------------------
def test_a_call_whose_output_holds_what_its_inputs_and_weights_did_not_is_the_producer():
    rec = Recording()
    fine = rec.forward_call("0", [rec.slot("input[0]", INPUT, FINITE),
                                  rec.slot("output", OUTPUT, FINITE)])
    exp = rec.forward_call("1", [rec.slot("input[0]", INPUT, FINITE),
                                 rec.slot("output", OUTPUT, POSINF)])
    call, bad, cause = detect.find_in_forward(rec.pass_, RULES)
    assert (call, cause) == (exp, CAUSE_FORWARD) and call is not fine
    assert [slot[0] for slot in bad] == ["output"]


def test_a_carrier_passing_a_minus_inf_mask_through_is_no_culprit_but_a_new_plus_inf_is():
    rec = Recording()
    root = CallRecord(next(_module_ids), "", "Model", FORWARD, 0, 0, True)
    root.slots.append(rec.slot("input[0]", INPUT, FINITE))
    build = rec.forward_call("build_mask", [rec.slot("input[0]", INPUT, FINITE),
                                            rec.slot("output", OUTPUT, NEGINF)], parent=root)
    add_mask = rec.forward_call("add_mask", [rec.slot("input[0]", INPUT, FINITE),
                                             rec.same(build.slots[1], "input[1]", INPUT),
                                             rec.slot("output", OUTPUT, NEGINF)], parent=root)
    close(rec, root, [rec.slot("output", OUTPUT, FINITE)])  # the mask did its job inside
    assert detect.find_in_forward(rec.pass_, RULES) is None

    add_mask.slots.append(rec.slot("output[1]", OUTPUT, POSINF))  # news next to the mask
    call, bad, cause = detect.forward_culprit(rec.pass_, rec.pass_.calls, RULES)
    assert (call, cause) == (add_mask, CAUSE_FORWARD) and [s[0] for s in bad] == ["output[1]"]
    assert detect.mask_maker(rec.pass_, add_mask, None) is build


def test_a_minus_inf_made_by_a_linear_map_is_an_overflow_never_a_mask():
    # float16 T5 feed-forward: `wo` overflows to -inf only; the Dropout after it scales the values
    # near 65504 past it (+inf). The first producer is the matmul's, whatever the -inf's sign.
    rec = Recording()
    root = CallRecord(next(_module_ids), "", "T5", FORWARD, 0, 0, True)
    root.slots.append(rec.slot("input[0]", INPUT, FINITE))
    wo = rec.forward_call("ff.wo", [rec.slot("weight", PARAM, FINITE), rec.slot("input[0]", INPUT, FINITE),
                                    rec.slot("output", OUTPUT, NEGINF_DATA)], parent=root, module_class="Linear")
    rec.forward_call("ff.dropout", [rec.same(wo.slots[2], "input[0]", INPUT),
                                    rec.slot("output", OUTPUT, [0.0, math.inf, math.inf])], parent=root,
                     module_class="Dropout")
    close(rec, root, [rec.slot("output", OUTPUT, POSINF)])
    call, bad, cause = detect.find_in_forward(rec.pass_, RULES)
    assert (call, cause) == (wo, CAUSE_FORWARD) and [slot[0] for slot in bad] == ["output"]
    # the same -inf made by a module that is no linear map is a mask, as before (the search
    # changed no record: the pass is searched again as it is)
    wo.module_class = "BuildMask"
    assert detect.find_in_forward(rec.pass_, RULES)[0] is not wo


def test_an_fp16_t5_whose_feed_forward_overflows_to_minus_inf_names_wo():
    from numguard_nb import Guard, NonFiniteError
    from numguard_nb.demo import build_overflowing_t5

    model, batch = build_overflowing_t5(seed=7)  # wo's matmul overflows to -inf only here
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(**batch).loss.backward()
    report = caught.value.report
    assert report.first_nonfinite.module_name == "encoder.block.1.layer.1.DenseReluDense.wo"
    assert report.first_nonfinite.flagged_rows[0].nonfinite_words == "-inf"
    assert "reaches the model's output" not in report.reason and "passed float16's largest value" in report.hint


def test_the_mask_maker_is_found_through_the_calls_that_carried_its_minus_inf():
    rec = Recording()
    root = CallRecord(next(_module_ids), "", "Model", FORWARD, 0, 0, True)
    build = rec.forward_call("build", [rec.slot("input[0]", INPUT, FINITE),
                                       rec.slot("output", OUTPUT, NEGINF)], parent=root)
    carry = rec.forward_call("unsqueeze", [rec.same(build.slots[1], "input[0]", INPUT),
                                           rec.slot("output", OUTPUT, NEGINF)], parent=root)
    rec.forward_call("other_mask", [rec.slot("input[0]", INPUT, FINITE),
                                    rec.slot("output", OUTPUT, NEGINF)], parent=root)
    softmax = rec.forward_call("softmax", [rec.same(carry.slots[1], "input[1]", INPUT),
                                           rec.slot("output", OUTPUT, NAN)], parent=root)
    assert detect.mask_maker(rec.pass_, softmax, None) is build


def test_a_minus_inf_mask_reaching_the_models_output_is_its_makers_doing():
    rec = Recording()
    root = CallRecord(next(_module_ids), "", "Model", FORWARD, 0, 0, True)
    root.slots.append(rec.slot("input[0]", INPUT, FINITE))
    build = rec.forward_call("build_mask", [rec.slot("input[0]", INPUT, FINITE),
                                            rec.slot("output", OUTPUT, NEGINF)], parent=root)
    close(rec, root, [rec.same(build.slots[1], "output", OUTPUT)])
    call, bad, cause = detect.find_in_forward(rec.pass_, RULES)
    assert (call, cause) == (build, CAUSE_FORWARD) and bad == [build.slots[1]]
    assert detect.find_in_forward(rec.pass_, GuardOptions(allow_inf="build*")) is None


@pytest.mark.parametrize("row", [POSINF, NEGINF_DATA])
def test_an_inf_in_the_data_is_the_datas_once_it_turns_into_something_new(row):
    rec = Recording()
    root = CallRecord(next(_module_ids), "", "Model", FORWARD, 0, 0, True)
    data = rec.slot("input[0]", INPUT, row)
    root.slots.append(data)
    linear = rec.forward_call("0", [rec.same(data, "input[0]", INPUT),
                                    rec.slot("output", OUTPUT, NAN)], parent=root)
    assert detect.forward_culprit(rec.pass_, [linear], RULES) == (root, [data], CAUSE_DATA)


def test_a_mask_passed_in_that_turns_into_nan_names_the_call_that_made_the_nan():
    rec = Recording()
    root = CallRecord(next(_module_ids), "", "Model", FORWARD, 0, 0, True)
    mask = rec.slot("input[1]", INPUT, NEGINF)  # zeros and -inf: a mask
    root.slots.extend([rec.slot("input[0]", INPUT, FINITE), mask])
    softmax = rec.forward_call("softmax", [rec.same(mask, "input[1]", INPUT),
                                           rec.slot("output", OUTPUT, NAN)], parent=root)
    call, bad, cause = detect.forward_culprit(rec.pass_, [softmax], RULES)
    assert (call, cause) == (softmax, CAUSE_FORWARD) and [s[0] for s in bad] == ["output"]


def test_a_minus_inf_in_the_data_that_only_masks_is_no_detection_but_reaching_the_output_is():
    rec = Recording()
    root = CallRecord(next(_module_ids), "", "Model", FORWARD, 0, 0, True)
    mask = rec.slot("input[1]", INPUT, NEGINF)
    root.slots.extend([rec.slot("input[0]", INPUT, FINITE), mask])
    rec.forward_call("attn", [rec.same(mask, "input[1]", INPUT),
                              rec.slot("output", OUTPUT, FINITE)], parent=root)
    close(rec, root, [rec.slot("output", OUTPUT, FINITE)])
    assert detect.find_in_forward(rec.pass_, RULES) is None

    root.slots[-1] = rec.same(mask, "output", OUTPUT)  # the -inf goes on to the loss
    assert detect.find_in_forward(rec.pass_, RULES) == (root, [mask], CAUSE_DATA)


def test_a_stored_minus_inf_mask_buffer_is_received_not_produced():
    rec = Recording()
    rec.forward_call("mask", [rec.slot("mask", BUFFER, NEGINF), rec.slot("input[0]", INPUT, FINITE),
                              rec.slot("output", OUTPUT, NEGINF)])
    assert detect.find_in_forward(rec.pass_, RULES) is None


@pytest.mark.parametrize("category,row", [(PARAM, NAN), (PARAM, POSINF), (BUFFER, NAN)])
def test_non_finite_weights_or_a_nan_buffer_are_the_weights_cause(category, row):
    rec = Recording()
    linear = rec.forward_call("0", [rec.slot("weight", category, row),
                                    rec.slot("input[0]", INPUT, FINITE),
                                    rec.slot("output", OUTPUT, NAN)])
    call, bad, cause = detect.find_in_forward(rec.pass_, RULES)
    assert (call, cause) == (linear, CAUSE_WEIGHTS) and [s[0] for s in bad] == ["weight"]


def test_nan_fed_to_a_top_level_call_is_the_data_cause_but_not_when_a_parent_handed_it():
    rec = Recording()
    root = rec.forward_call("", [rec.slot("input[0]", INPUT, NAN), rec.slot("output", OUTPUT, NAN)])
    assert detect.find_in_forward(rec.pass_, RULES)[::2] == (root, CAUSE_DATA)

    rec = Recording()
    parent = CallRecord(next(_module_ids), "", "Model", FORWARD, 0, 0, True)
    rec.forward_call("child", [rec.slot("input[0]", INPUT, NAN), rec.slot("output", OUTPUT, NAN)],
                     parent=parent)
    assert detect.forward_culprit(rec.pass_, rec.pass_.calls, RULES) is None


def test_a_nan_no_rule_attributes_is_named_where_it_first_appears():
    # The parent made nan in its own code before calling the child, then masked it out.
    rec = Recording()
    parent = CallRecord(next(_module_ids), "", "Model", FORWARD, 0, 0, True)
    child = rec.forward_call("child", [rec.slot("input[0]", INPUT, NAN),
                                       rec.slot("output", OUTPUT, NAN)], parent=parent)
    parent.slots.extend([rec.slot("input[0]", INPUT, FINITE), rec.slot("output", OUTPUT, FINITE)])
    rec.pass_.close(parent)
    assert detect.forward_culprit(rec.pass_, rec.pass_.calls, RULES) is None
    call, bad, cause = detect.find_in_forward(rec.pass_, RULES)
    assert (call, cause) == (child, CAUSE_UNATTRIBUTED) and len(bad) == 2


def test_an_allowed_inf_is_no_culprit_in_its_module_nor_in_the_parent_passing_it_on():
    rec = Recording()
    parent = CallRecord(next(_module_ids), "", "Model", FORWARD, 0, 0, True)
    rec.forward_call("attn", [rec.slot("input[0]", INPUT, FINITE),
                              rec.slot("output", OUTPUT, POSINF)], parent=parent)
    parent.slots.extend([rec.slot("input[0]", INPUT, FINITE), rec.slot("output", OUTPUT, POSINF)])
    rec.pass_.close(parent)
    assert detect.find_in_forward(rec.pass_, GuardOptions(allow_inf="att*")) is None
    call, _, cause = detect.find_in_forward(rec.pass_, RULES)
    assert (call.module_name, cause) == ("attn", CAUSE_FORWARD)


def test_an_allowed_module_still_produces_nan():
    rec = Recording()
    attn = rec.forward_call("attn", [rec.slot("input[0]", INPUT, FINITE),
                                     rec.slot("output", OUTPUT, NAN)])
    assert detect.find_in_forward(rec.pass_, GuardOptions(allow_inf=True))[::2] == (attn, CAUSE_FORWARD)


def test_an_overflow_beyond_limit_max_is_produced_only_with_a_limit():
    rec = Recording()
    up = rec.forward_call("up", [rec.slot("input[0]", INPUT, FINITE),
                                 rec.slot("output", OUTPUT, BEYOND_FP16)])
    assert detect.find_in_forward(rec.pass_, RULES) is None
    call, bad, cause = detect.find_in_forward(rec.pass_, GuardOptions(limit_dtype=torch.float16))
    assert (call, cause) == (up, CAUSE_FORWARD) and [s[0] for s in bad] == ["output"]


# ---- backward -----------------------------------------------------------------------------------
def test_a_non_finite_gradient_entering_the_model_is_the_loss_gradient_cause():
    calls = forward_calls([("", None), ("0", "")])
    rec = Recording()
    root_call, slot = rec.gradient(calls[""], "grad_output", GRAD_OUTPUT, POSINF)
    call, bad, cause = detect.find_in_backward(rec.pass_, RULES)
    assert (call, bad, cause) == (root_call, [slot], CAUSE_LOSS_GRADIENT)


def test_an_input_gradient_holding_what_the_output_gradient_did_not_is_made_in_backward():
    calls = forward_calls([("", None), ("sqrt", "")])
    rec = Recording()
    rec.gradient(calls[""], "grad_output", GRAD_OUTPUT, FINITE)
    rec.gradient(calls["sqrt"], "grad_output", GRAD_OUTPUT, FINITE)
    sqrt, slot = rec.gradient(calls["sqrt"], "grad_input[0]", GRAD_INPUT, POSINF)
    call, bad, cause = detect.find_in_backward(rec.pass_, RULES)
    assert (call, bad, cause) == (sqrt, [slot], CAUSE_BACKWARD)
    assert call.phase == BACKWARD and call.forward is calls["sqrt"]


def test_gradients_passed_on_are_carried_not_made():
    # mask may make -inf; a, before it in forward, receives the -inf and passes it on.
    calls = forward_calls([("", None), ("a", ""), ("mask", "")])
    rec = Recording()
    rec.gradient(calls[""], "grad_output", GRAD_OUTPUT, FINITE)
    rec.gradient(calls["mask"], "grad_output", GRAD_OUTPUT, FINITE)
    rec.gradient(calls["mask"], "grad_input[0]", GRAD_INPUT, NEGINF)
    rec.gradient(calls["a"], "grad_output", GRAD_OUTPUT, NEGINF)
    rec.gradient(calls["a"], "grad_input[0]", GRAD_INPUT, NEGINF)
    rec.gradient(calls["a"], "weight.grad", GRAD_PARAM, NEGINF)
    assert detect.find_in_backward(rec.pass_, GuardOptions(allow_inf=["mask"])) is None


def test_an_output_gradient_the_parent_did_not_receive_was_made_in_the_parents_own_code():
    calls = forward_calls([("", None), ("block", ""), ("block.inner", "block")])
    rec = Recording()
    rec.gradient(calls[""], "grad_output", GRAD_OUTPUT, FINITE)
    rec.gradient(calls["block"], "grad_output", GRAD_OUTPUT, FINITE)
    _, slot = rec.gradient(calls["block.inner"], "grad_output", GRAD_OUTPUT, NAN)
    call, bad, cause = detect.find_in_backward(rec.pass_, RULES)
    assert cause == CAUSE_BACKWARD_INLINE and bad == [slot]
    assert call.forward is calls["block"] and call is rec.pass_.backward_call(calls["block"])


def test_an_allowed_module_may_make_an_inf_gradient():
    calls = forward_calls([("", None), ("mask", "")])
    rec = Recording()
    rec.gradient(calls[""], "grad_output", GRAD_OUTPUT, FINITE)
    rec.gradient(calls["mask"], "grad_output", GRAD_OUTPUT, FINITE)
    rec.gradient(calls["mask"], "grad_input[0]", GRAD_INPUT, NEGINF)
    assert detect.find_in_backward(rec.pass_, GuardOptions(allow_inf=["mask"])) is None
    fresh = Recording()
    fresh.gradient(calls[""], "grad_output", GRAD_OUTPUT, FINITE)
    fresh.gradient(calls["mask"], "grad_output", GRAD_OUTPUT, FINITE)
    fresh.gradient(calls["mask"], "grad_input[0]", GRAD_INPUT, NEGINF)
    assert detect.find_in_backward(fresh.pass_, RULES)[2] == CAUSE_BACKWARD


def test_slots_fed_one_at_a_time_find_what_the_whole_pass_finds():
    calls = forward_calls([("", None), ("a", ""), ("b", "")])
    rec = Recording()
    arrivals = [rec.gradient(calls[""], "grad_output", GRAD_OUTPUT, FINITE),
                rec.gradient(calls["b"], "grad_output", GRAD_OUTPUT, FINITE),
                rec.gradient(calls["b"], "grad_input[0]", GRAD_INPUT, NAN),
                rec.gradient(calls["a"], "grad_output", GRAD_OUTPUT, NAN)]
    found = None
    for call, slot in arrivals:  # sync mode
        found = found or detect.backward_culprit(rec.pass_, [slot], {id(slot): call}, RULES)
    assert found is not None and found[0] is arrivals[2][0] and found[2] == CAUSE_BACKWARD
