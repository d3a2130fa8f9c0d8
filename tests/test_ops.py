"""Op localisation (numguard_nb.ops): the exact ATen op and Python line, forward and backward."""

import os
import random
import sys

import pytest
import torch
from torch import nn

from numguard_nb import ops
from numguard_nb.ops import OpLocation, localise_backward, localise_forward, rng_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models as M  # noqa: E402

MODELS_FILE = os.path.abspath(M.__file__)


def assert_at(loc: OpLocation, op: str, marker: str, node=None):
    assert loc.reproduced, loc.note
    assert loc.op == op, loc
    assert loc.node == node, loc
    assert os.path.abspath(loc.filename) == MODELS_FILE, loc
    assert loc.lineno == M.line_of(marker), loc
    assert loc.line.endswith(f"# OP:{marker}")
    assert loc.source == f"{loc.filename}:{loc.lineno}: {loc.line}"
    assert op in loc.note


def nonfinite(t):
    return not torch.isfinite(t).all()


# ---- forward ---------------------------------------------------------------------------------
FORWARD_CASES = {
    "exp-fp32": (M.NaiveSoftmax, torch.float32, lambda: torch.full((2, 8), 100.0),
                 "aten.exp.default", "exp"),
    "exp-fp16": (M.NaiveSoftmax, torch.float16, lambda: torch.full((2, 8), 12.0),
                 "aten.exp.default", "exp"),
    "sqrt-negative": (M.Sqrt, torch.float32, lambda: -torch.rand(2, 8) - 0.5,
                      "aten.sqrt.default", "sqrt"),
    "zero-row-sum": (M.Normalise, torch.float32,
                     lambda: torch.cat([torch.rand(1, 8) + 0.1, torch.zeros(1, 8)]),
                     "aten.div.Tensor", "div"),
    "log-zero": (M.Log, torch.float32,
                 lambda: torch.cat([torch.rand(1, 8) + 0.1, -torch.ones(1, 8)]),
                 "aten.log.default", "log"),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_names_the_op_and_line(case):
    block_cls, dtype, make_input, op, marker = FORWARD_CASES[case]
    net = M.Net(block_cls()).to(dtype)
    x = make_input().to(dtype)
    rng = rng_state()
    with torch.no_grad():
        assert nonfinite(net(x))  # the failing step really fails
        # and the values before the culprit were finite
        assert torch.isfinite(net.pre(x)).all()
    loc = localise_forward(net, (x,), {}, rng, net.block, 0)
    assert_at(loc, op, marker)
    assert loc.node is None


class _BucketsThenZeroMean(nn.Module):
    """T5's relative-position buckets take log(0) = -inf and drop it with `where`; then this
    call's real fault: a mean over no element (0/0)."""

    def forward(self, x, keep):
        distance = torch.arange(4.0)
        buckets = torch.where(distance < 1, distance, torch.log(distance))  # log(0): dropped
        return (x + buckets)[keep].mean()  # keep all False: nan


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_op_named_made_what_the_call_returned_not_an_inf_it_dropped(mode):
    from numguard_nb import Guard, NonFiniteError

    model = _BucketsThenZeroMean()
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, ops=mode == "full", mode=mode):
            model(torch.randn(2, 4), torch.zeros(2, 4, dtype=torch.bool))
    first = caught.value.report.first_nonfinite
    assert first.op == "aten.mean.default" and "mean()" in first.source


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_op_on_a_nested_tensor_is_named(mode):
    from numguard_nb import Guard, NonFiniteError

    class NestedLog(nn.Module):
        def forward(self, x):
            return x.log()  # log of negatives: nan, on a jagged nested tensor

    class Ragged(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 8)
            self.log = NestedLog()

        def forward(self, x):
            y = self.layer(x)
            return self.log(torch.nested.as_nested_tensor([y[:2], y[2:3]], layout=torch.jagged))

    torch.manual_seed(0)
    model = Ragged()
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, ops=mode == "full", mode=mode):
            model(torch.randn(4, 8))
    first = caught.value.report.first_nonfinite
    assert (first.module_name, first.op) == ("log", "aten.log.default")


def test_deliberate_minus_inf_is_not_blamed_softmax_of_a_masked_row_is():
    # torch.full(-inf), triu_ on it and mask[row] = -inf all hold -inf on purpose; the softmax
    # over a row that is -inf everywhere is what turns them into nan.
    model = M.MaskedAttention()
    loc = localise_forward(model, (torch.randn(4, 4), 2), {}, rng_state(), model, 0)
    assert_at(loc, "aten._softmax.default", "softmax")
    # without a fully masked row, nothing is produced: not reproduced
    loc = localise_forward(model, (torch.randn(4, 4), slice(0, 0)), {}, rng_state(), model, 0)
    assert not loc.reproduced and loc.op is None


def test_allow_inf_looks_past_a_deliberate_inf_to_the_nan():
    model = M.LogMask()
    keep = torch.ones(3, 3)
    keep[1] = 0.0  # row 1 fully masked
    args = (torch.randn(3, 3), keep)
    loc = localise_forward(model, args, {}, rng_state(), model, 0)
    assert_at(loc, "aten.log.default", "log_mask")
    loc = localise_forward(model, args, {}, rng_state(), model, 0, allow_inf=True)
    assert_at(loc, "aten._softmax.default", "log_mask_softmax")


def test_ops_outside_the_culprit_call_are_not_blamed():
    # HiddenLog computes log(-1) = nan in a branch torch.where drops: its output is finite
    model = nn.Sequential(M.HiddenLog(), M.Sqrt())
    x = torch.tensor([[-1.0, 2.0]])
    loc = localise_forward(model, (x,), {}, rng_state(), model[1], 0)
    assert_at(loc, "aten.sqrt.default", "sqrt")
    # backward: MaskedPow's gradient is inf before relu's backward masks it; the culprit's own
    # SqrtBackward0 runs later
    model = nn.Sequential(M.SqrtOfZeroPlusInput(), M.MaskedPow())
    x = torch.tensor([[-1.0, 2.0]], requires_grad=True)
    (grad,) = torch.autograd.grad(model(x).sum(), x)
    assert nonfinite(grad)
    loc = localise_backward(model, (x,), {}, rng_state(), [torch.ones(1, 2)], model[0], 0)
    assert_at(loc, "aten.div.Tensor", "sqrt_backward", node="SqrtBackward0")


# ---- backward --------------------------------------------------------------------------------
BACKWARD_CASES = {
    "sqrt-of-zero": (M.SqrtOfZeroPlusInput, lambda: torch.randn(2, 8), "SqrtBackward0",
                     "aten.div.Tensor", "sqrt_backward"),
    "pow-half-at-zero": (M.PowHalf, lambda: torch.cat([torch.zeros(1, 8), torch.rand(1, 8) + 1]),
                         "PowBackward0", "aten.pow.Tensor_Scalar", "pow_backward"),
    "where-hides-log": (M.HiddenLog, lambda: torch.cat([torch.zeros(1, 8), torch.rand(1, 8) + 1]),
                        "LogBackward0", "aten.div.Tensor", "where_log"),
}


@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_backward_names_the_node_op_and_forward_line(case):
    block_cls, make_input, node, op, marker = BACKWARD_CASES[case]
    net = M.Net(block_cls())
    x = make_input()
    rng = rng_state()
    out = net(x)
    assert torch.isfinite(out).all()  # forward is clean
    grad = torch.ones_like(out)
    (weight_grad,) = torch.autograd.grad(out, [net.pre.weight], grad)
    assert nonfinite(weight_grad)  # backward is not
    loc = localise_backward(net, (x,), {}, rng, [grad], net.block, 0)
    assert_at(loc, op, marker, node=node)
    assert node in loc.note
    # the forward of the same step is finite: a forward localisation does not reproduce it
    forward = localise_forward(net, (x,), {}, rng, net.block, 0)
    assert not forward.reproduced and forward.op is None and "finite" in forward.note


def test_backward_of_dict_outputs_with_missing_gradients_and_batchnorm():
    net = M.DictNet(M.SqrtOfZeroPlusInput())
    x = torch.randn(4, 8)
    rng = rng_state()
    output = net(x)
    # walk order: output[aux], output[count] (not a tensor), output[out]
    grads = [None, torch.ones_like(output["out"])]
    loc = localise_backward(net, (x,), {}, rng, grads, net.block, 0)
    assert_at(loc, "aten.div.Tensor", "sqrt_backward", node="SqrtBackward0")
    # misaligned gradients are refused, not guessed at
    loc = localise_backward(net, (x,), {}, rng, grads[1:], net.block, 0)
    assert not loc.reproduced and "1 gradient(s) for the 2 output tensor(s)" in loc.note


# ---- dropout: the re-run draws the same mask --------------------------------------------------
def test_dropout_mask_is_reproduced_from_the_rng_snapshot():
    n = 64
    net = M.DropNet(n).train()
    x = torch.ones(n)
    torch.manual_seed(1234)
    rng = rng_state()
    expected_mask = nn.functional.dropout(torch.ones(n), 0.5, True)  # what the model will draw
    net.block.target.copy_(expected_mask)
    rng.restore()
    assert nonfinite(net(x))  # only this mask gives a zero distance (2**-64 otherwise)
    torch.rand(100)  # the user's stream moves on
    after = torch.get_rng_state()

    loc = localise_forward(net, (x,), {}, rng, net.block, 0)
    assert_at(loc, "aten.div.Tensor", "mask_div")
    loc = localise_backward(net, (x,), {}, rng, [torch.ones(n)], net.block, 0)
    assert_at(loc, "aten.div.Tensor", "mask_div", node="DivBackward0")
    assert torch.equal(torch.get_rng_state(), after)  # the user's RNG stream is untouched

    # another RNG state draws another mask: honestly not reproduced
    loc = localise_forward(net, (x,), {}, rng_state(), net.block, 0)
    assert not loc.reproduced and loc.op is None and "finite" in loc.note
    # no snapshot at all, and the forward draws random numbers: refused
    loc = localise_forward(net, (x,), {}, None, net.block, 0)
    assert not loc.reproduced and "RNG" in loc.note


# ---- a shared module -------------------------------------------------------------------------
def test_call_index_picks_the_call_of_a_shared_module():
    model = M.Twice()
    x = torch.ones(3)  # call 0: exp(10) is finite; call 1: exp(22026) is inf
    rng = rng_state()
    with torch.no_grad():
        assert torch.isfinite(model.shared(x)).all() and nonfinite(model(x))
    second = localise_forward(model, (x,), {}, rng, model.shared, 1)
    assert_at(second, "aten.exp.default", "shared_exp")
    first = localise_forward(model, (x,), {}, rng, model.shared, 0)
    assert not first.reproduced and first.op is None and "call 0 of Amplify" in first.note
    third = localise_forward(model, (x,), {}, rng, model.shared, 2)
    assert not third.reproduced and "called Amplify 2 time(s)" in third.note


# ---- limit_dtype predictions -----------------------------------------------------------------
def test_limit_names_the_first_op_beyond_it_on_an_fp32_model():
    model = M.Widen()
    x = torch.full((4,), 100.0)  # x * 1000 = 1e5: fine in fp32, beyond float16's 65504
    rng = rng_state()
    loc = localise_forward(model, (x,), {}, rng, model, 0, limit=65504.0)
    assert_at(loc, "aten.mul.Tensor", "limit_mul")
    assert "65504" in loc.note
    plain = localise_forward(model, (x,), {}, rng, model, 0)
    assert not plain.reproduced and plain.op is None


# ---- the user's state ------------------------------------------------------------------------
def test_rng_grads_training_flags_buffers_and_inputs_are_left_as_they_were():
    net = M.DictNet(M.SqrtOfZeroPlusInput())
    net.train()
    net.block.eval()  # mixed flags must come back exactly
    x = torch.randn(4, 8, requires_grad=True)
    rng = rng_state()
    output = net(x)
    net.pre.weight.grad = torch.full((8,), 7.0)
    grad_object = net.pre.weight.grad
    random.seed(5)
    torch.manual_seed(5)
    cpu_rng, py_rng = torch.get_rng_state(), random.getstate()
    flags = {name: m.training for name, m in net.named_modules()}
    buffers = {name: (b.clone(), b._version) for name, b in net.named_buffers()}
    params = {name: (p.detach().clone(), p._version) for name, p in net.named_parameters()}
    x_value, x_version = x.detach().clone(), x._version
    grad_enabled = torch.is_grad_enabled()

    forward = localise_forward(net, (x,), {}, rng, net.block, 0)
    backward = localise_backward(net, (x,), {}, rng, [None, torch.ones_like(output["out"])],
                                 net.block, 0)
    assert backward.reproduced and backward.node == "SqrtBackward0"
    assert not forward.reproduced  # this one is backward-only

    assert torch.equal(torch.get_rng_state(), cpu_rng) and random.getstate() == py_rng
    assert net.pre.weight.grad is grad_object and torch.equal(grad_object, torch.full((8,), 7.0))
    assert x.grad is None
    assert all(p.grad is None for name, p in net.named_parameters() if name != "pre.weight")
    assert {name: m.training for name, m in net.named_modules()} == flags
    for name, b in net.named_buffers():  # BatchNorm ran in training mode twice more
        assert torch.equal(b, buffers[name][0]) and b._version == buffers[name][1], name
    for name, p in net.named_parameters():
        assert torch.equal(p, params[name][0]) and p._version == params[name][1], name
    assert torch.equal(x, x_value) and x._version == x_version
    assert torch.is_grad_enabled() == grad_enabled
    # the original graph is still usable after the re-runs
    output["out"].sum().backward()
    assert x.grad is not None


# ---- cannot be reproduced --------------------------------------------------------------------
def test_a_step_that_does_not_happen_again_is_reported_not_reproduced():
    model = M.FirstCallOnly()
    x = torch.ones(3)
    rng = rng_state()
    assert nonfinite(model(x))
    loc = localise_forward(model, (x,), {}, rng, model, 0)
    assert loc == OpLocation(reproduced=False, note=loc.note)
    assert "returned only finite values" in loc.note


def test_a_model_that_overwrites_its_input_is_refused_and_the_input_restored():
    model = M.EatsInput()
    x = torch.tensor([1.0, 2.0, 3.0])
    rng = rng_state()
    assert torch.isfinite(model(x)).all()
    assert torch.equal(x, torch.zeros(3))  # what the guard's reference now holds
    version = x._version
    loc = localise_forward(model, (x,), {}, rng, model, 0)  # log(0) would be -inf: a guess
    assert not loc.reproduced and loc.op is None
    assert "modifies its input[0] in place" in loc.note
    assert torch.equal(x, torch.zeros(3)) and x._version == version


def test_autocast_in_force_at_the_failing_call_is_replayed():
    class BF16Only(nn.Module):
        def forward(self, x):
            h = x @ torch.eye(2)
            return h / (h.dtype != torch.bfloat16)  # h / False: inf

    model = BF16Only()
    x = torch.ones(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rng = rng_state()
        assert nonfinite(model(x))
    assert rng.autocast == (("cpu", torch.bfloat16),)
    loc = localise_forward(model, (x,), {}, rng, model, 0)
    assert loc.reproduced and loc.op == "aten.div.Tensor", loc
    assert not localise_forward(model, (x,), {}, rng_state(), model, 0).reproduced


# ---- called the way the guard calls it ---------------------------------------------------------
def test_from_a_forward_hook_and_from_an_autograd_engine_callback():
    net = M.Net(M.Sqrt())
    found, busy = [], []

    def pre(module, args, kwargs):
        if not busy:
            found.append(rng_state())

    def post(module, args, kwargs, output):
        if not busy:
            busy.append(True)
            found.append(localise_forward(module, args, kwargs, found[0], module.block, 0))
            busy.clear()

    handles = [net.register_forward_pre_hook(pre, with_kwargs=True),
               net.register_forward_hook(post, with_kwargs=True)]
    try:
        x = -torch.ones(2, 8)
        out = net(x)
    finally:
        for h in handles:
            h.remove()
    assert nonfinite(out)
    assert_at(found[1], "aten.sqrt.default", "sqrt")

    net = M.Net(M.PowHalf())
    x = torch.zeros(2, 8)
    rng = rng_state()
    out = net(x)
    results = []

    def on_output_grad(grad):
        def at_end():
            results.append(localise_backward(net, (x,), {}, rng, [grad], net.block, 0))
        torch.autograd.Variable._execution_engine.queue_callback(at_end)

    out.register_hook(on_output_grad)
    out.sum().backward()
    assert_at(results[0], "aten.pow.Tensor_Scalar", "pow_backward", node="PowBackward0")
    assert nonfinite(net.pre.weight.grad)  # the user's own backward went on as usual


# ---- never raises ----------------------------------------------------------------------------
def test_failures_come_back_as_notes():
    net = M.Net(M.Sqrt())
    rng = rng_state()
    bad_shape = localise_forward(net, (torch.ones(3, 5),), {}, rng, net.block, 0)
    assert not bad_shape.reproduced and "raised RuntimeError" in bad_shape.note
    not_a_module = localise_forward(net, (torch.ones(2, 8),), {}, rng, "block", 0)
    assert not not_a_module.reproduced and "not a torch.nn.Module" in not_a_module.note
    wrong_rng = localise_backward(net, (torch.ones(2, 8),), {}, torch.get_rng_state(), [None],
                                  net.block, 0)
    assert not wrong_rng.reproduced and "rng_state()" in wrong_rng.note
    assert localise_forward(net, None, None, rng, net.block, -1).note.startswith(
        "could not localise the op: call_index")


def test_rng_state_restores_the_streams():
    snapshot = rng_state()
    first = (torch.rand(3), random.random())
    snapshot.restore()
    assert torch.equal(torch.rand(3), first[0]) and random.random() == first[1]
    assert isinstance(snapshot, ops.CallState) and snapshot.autocast == ()
