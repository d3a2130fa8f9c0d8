"""Edge cases of the Guard engine found in review, locked in after their fixes.

Each test builds a tiny model in the test (CPU only, no download) and checks one promise:
the module *producing* the first inf/nan is named (parents whose own code makes it, shared and
recursive modules, weights used without calling their module, checkpointed blocks), the guard
never breaks a forward it cannot summarise (sparse, nested, float8, meta, tensor subclasses),
its bookkeeping stays bounded (leaf-tensor hooks, huge python lists as inputs), batches are
counted once per top-level call (recursion, activation checkpointing, `begin_batch()`), and
bad options fail at construction.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from numguard_nb import BatchLimitReached, Guard, NonFiniteError
from models import Exp, SqrtOfZero
from numguard_nb import stats as ng_stats

INF = float("inf")
NAN = float("nan")


# ---- helpers --------------------------------------------------------------------------------
def rows_of(frame):
    return {row.role: row for row in frame.rows}


def culprit_of(caught):
    report = caught.value.report
    return report, report.first_nonfinite


class Fn(nn.Module):
    """A module running a given function (with a Linear so it has weights)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return self.fn(x)


# ---- 1. a parent makes the nan in its own code and hands it to a child ---------------------
class AttnParent(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        scores = self.q(x) * 1e39  # overflows float32 to +-inf in AttnParent's own code
        weights = torch.softmax(scores, -1)  # inf - inf: nan
        return self.drop(weights)  # the child only receives the nan


class AttnModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = AttnParent()
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.attn(x))


@pytest.mark.parametrize("backward", [False, True])
def test_parent_whose_own_code_makes_nan_before_a_child_is_named_in_forward(backward):
    torch.manual_seed(0)
    model = AttnModel()
    x = torch.randn(3, 4)
    with pytest.raises(NonFiniteError) as caught, Guard(model, backward=backward):
        y = model(x)
        if backward:
            y.sum().backward()
    report, culprit = culprit_of(caught)
    assert culprit.module_name == "attn"
    assert culprit.module_class == "AttnParent"
    assert culprit.phase == "forward"
    assert report.cause == "forward"
    assert [row.role for row in culprit.flagged_rows] == ["output"]
    assert culprit.flagged_rows[0].nan
    # the child that merely received the nan is in the report, but not blamed
    drop = [f for f in report.frames if f.module_name == "attn.drop"]
    assert drop and rows_of(drop[-1])["input[0]"].nan and not drop[-1].flagged_rows
    assert "attn (AttnParent)" in report.summary()


# ---- 2. a parent makes a nan gradient between its submodules -------------------------------
class InlineSqrt(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        # finite forward, nan backward, in the root's own code between emb and head
        return self.head(torch.sqrt(self.emb(x) * 0))


@pytest.mark.parametrize("sync", [False, True])
def test_parent_whose_own_code_makes_a_nan_gradient_is_named_backward_inline(sync):
    torch.manual_seed(0)
    model = InlineSqrt()
    x = torch.randn(3, 4)  # data that does not require grad
    with pytest.raises(NonFiniteError) as caught, Guard(model, sync=sync):
        y = model(x)
        assert torch.isfinite(y).all()
        y.sum().backward()
    report, culprit = culprit_of(caught)
    assert culprit.module_name == ""
    assert culprit.module_class == "InlineSqrt"
    assert culprit.phase == "backward"
    assert report.cause == "backward-inline"
    # the reason names the child whose output gradient holds the nan
    assert "grad_output of emb holds nan" in report.reason
    assert "own code" in report.reason
    # emb (which only received it) and head (upstream, finite) are not blamed
    assert culprit.module_name not in ("emb", "head")


class InlineSqrtBesideSkip(nn.Module):
    """The emb output feeds a skip module and the root's own sqrt: its gradient is the sum of
    both uses, and the skip, whose backward makes no nan from finite values (a matmul, a norm,
    an activation, dropout), must not be blamed for the sum."""

    def __init__(self, skip=None):
        super().__init__()
        self.emb = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.skip = nn.Linear(4, 1) if skip is None else skip

    def forward(self, x):
        h = self.emb(x)
        gate = torch.where(h > 100, torch.sqrt(h * 0), torch.zeros_like(h))  # 0 forward, nan back
        return self.head(gate) + self.skip(h).sum(-1, keepdim=True)


SKIPS = {"Linear": lambda: nn.Linear(4, 1), "BatchNorm1d": lambda: nn.BatchNorm1d(4),
         "LayerNorm": lambda: nn.LayerNorm(4), "GELU": nn.GELU, "Dropout": lambda: nn.Dropout(0.1)}


@pytest.mark.parametrize("skip", list(SKIPS))
@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("sync", [False, True])
def test_a_nan_gradient_made_beside_a_module_that_shares_the_input_is_not_the_modules(sync, mode, skip):
    # pytorch/pytorch#68425: `h` feeds a BatchNorm and `torch.where(h > 0, sqrt(h), 0)`
    torch.manual_seed(0)
    model = InlineSqrtBesideSkip(SKIPS[skip]())
    with pytest.raises(NonFiniteError) as caught, Guard(model, sync=sync, mode=mode):
        model(torch.randn(3, 4)).sum().backward()
    report, culprit = culprit_of(caught)
    assert (culprit.module_name, culprit.phase, report.cause) == ("", "backward", "backward-inline")
    assert "grad_output of emb holds nan" in report.reason


class GatedSqrt(nn.Module):
    """A user's module whose own backward makes the nan (sqrt's gradient at 0)."""

    def forward(self, h):
        return torch.where(h > 100, torch.sqrt(h * 0), torch.zeros_like(h))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_module_whose_own_backward_makes_the_nan_beside_another_use_is_still_named(mode):
    torch.manual_seed(0)
    model = InlineSqrtBesideSkip(GatedSqrt())
    with pytest.raises(NonFiniteError) as caught, Guard(model, mode=mode):
        model(torch.randn(3, 4)).sum().backward()
    report, culprit = culprit_of(caught)
    assert (culprit.module_name, culprit.phase, report.cause) == ("skip", "backward", "backward")


class RMSNorm(nn.Module):
    """A user's RMSNorm, named as torch's, with its eps outside the sqrt: on an all-zero row
    its own backward makes nan (sqrt's gradient at 0)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return self.weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)


class HugeGradientsIntoANorm(nn.Module):
    """torch's LayerNorm given finite gradients of 1e35: its backward's sum over 4096 features
    overflows, and inf - inf is nan."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4096, 4096)
        self.norm = nn.LayerNorm(4096)

    def forward(self, x):
        return self.norm(self.emb(x)) * 1e35


@pytest.mark.parametrize("case", ["a user's class named as torch's", "gradients near overflow"])
def test_a_module_whose_own_backward_makes_the_nan_is_named_though_its_class_usually_makes_none(case):
    torch.manual_seed(0)
    if case == "gradients near overflow":
        model, x = HugeGradientsIntoANorm(), torch.randn(2, 4096)
    else:
        model, x = nn.Sequential(nn.Linear(4, 4), RMSNorm(4), nn.Linear(4, 1)), torch.randn(3, 4)
        with torch.no_grad():
            model[0].weight.zero_()
            model[0].bias.zero_()  # all-zero rows into the norm
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x).sum().backward()
    report, culprit = culprit_of(caught)
    assert (culprit.module_class, culprit.phase, report.cause) == (
        "LayerNorm" if case == "gradients near overflow" else "RMSNorm", "backward", "backward")


class InfGradient(nn.Module):
    def forward(self, y):
        return torch.sqrt(y - y.detach())  # 0 forward, +inf gradient back


class FrozenLinearBeforeAnAllowedInf(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 4)
        self.skip = nn.Linear(4, 2)
        self.infg = InfGradient()
        with torch.no_grad():
            self.skip.weight.copy_(torch.tensor([[1.0] * 4, [-1.0] * 4]))
        self.skip.requires_grad_(False)  # frozen: no weight gradient arrives first

    def forward(self, x):
        return self.infg(self.skip(self.emb(x))).sum()


@pytest.mark.parametrize("sync", [False, True])
def test_a_linear_map_that_receives_an_allowed_inf_is_named_for_the_nan_it_makes(sync):
    # inf - inf in the matmul: the Linear makes this nan itself, it is no other use's
    torch.manual_seed(0)
    model = FrozenLinearBeforeAnAllowedInf()
    with pytest.raises(NonFiniteError) as caught, Guard(model, allow_inf="infg", sync=sync):
        model(torch.randn(3, 4)).backward()
    report, culprit = culprit_of(caught)
    assert (culprit.module_name, culprit.phase, report.cause) == ("skip", "backward", "backward")
    assert report.reason.endswith("while the gradient it received held only +inf")


# ---- 3. a shared module that produces nan in backward on its second call -------------------
class SqrtScaled(nn.Module):
    """sqrt(x * scale): with scale 0, finite forward and nan backward."""

    def forward(self, x, scale):
        return torch.sqrt(x * scale)


class SharedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = SqrtScaled()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        h = self.shared(x, 1.0)  # call 0: x > 0, clean both ways
        h = self.lin(h)
        return self.head(self.shared(h, 0.0))  # call 1: nan gradient made here


@pytest.mark.parametrize("sync", [False, True])
def test_shared_module_making_nan_in_backward_on_its_second_call_is_named(sync):
    torch.manual_seed(0)
    model = SharedTwice()
    x = (torch.rand(3, 4) + 0.5).requires_grad_()
    with pytest.raises(NonFiniteError) as caught, Guard(model, sync=sync, max_frames=50):
        y = model(x)
        assert torch.isfinite(y).all()
        y.sum().backward()
    report, culprit = culprit_of(caught)
    assert (culprit.module_name, culprit.phase, culprit.call_index) == ("shared", "backward", 1)
    assert report.cause == "backward"
    assert [row.role for row in culprit.flagged_rows] == ["grad_input[0]"]
    assert culprit.flagged_rows[0].nan


# ---- 4. leaf tensors (a Parameter) fed to a submodule: hooks stay bounded ------------------
class Perceiver(nn.Module):
    def __init__(self):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(4, 8))
        self.cross = nn.Linear(8, 8)
        self.sq = SqrtOfZero()

    def forward(self, x, bad=False):
        h = self.cross(self.latents)  # a leaf Parameter as a submodule's input
        if bad:
            h = self.sq(h)
        return h + x


def test_leaf_parameter_used_as_an_input_gets_a_bounded_number_of_hooks():
    torch.manual_seed(0)
    model = Perceiver()
    assert not model.latents._backward_hooks
    counts = []
    with Guard(model, max_frames=20) as guard:
        for _ in range(200):
            model(torch.randn(4, 8)).sum().backward()
            counts.append(len(model.latents._backward_hooks))
        assert counts[0] >= 1
        assert counts == [counts[0]] * 200, f"hooks on the leaf grew: {sorted(set(counts))}"
        # the leaf's hook still delivers its gradient to cross's backward frame
        cross = [f for f in guard.report.frames
                 if f.module_name == "cross" and f.phase == "backward"]
        assert cross and "grad_input[0]" in rows_of(cross[-1])
        # and a nan gradient produced later, in the same attached guard, is still found
        with pytest.raises(NonFiniteError) as caught:
            model(torch.randn(4, 8), bad=True).sum().backward()
        report, culprit = culprit_of(caught)
        assert (culprit.module_name, culprit.phase, report.cause) == ("sq", "backward", "backward")
        assert report.batch_number == 200
        assert len(model.latents._backward_hooks) == counts[0]
    assert not model.latents._backward_hooks  # detach removed every hook on the leaf


# ---- 5. a root that calls itself -----------------------------------------------------------
class Recursive(nn.Module):
    def __init__(self, overflow_outer):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.overflow_outer = overflow_outer

    def forward(self, x, depth=1):
        if depth:
            x = self(x, depth - 1)
            out = self.lin(x)
            return out * 1e39 if self.overflow_outer else out  # only the outer call overflows
        return self.lin(x)


@pytest.mark.parametrize("backward", [False, True])
def test_overflow_in_the_outer_call_of_a_recursive_root_is_detected(backward):
    torch.manual_seed(0)
    model = Recursive(overflow_outer=True)
    with pytest.raises(NonFiniteError) as caught, Guard(model, backward=backward) as guard:
        model(torch.ones(1, 2))
    report, culprit = culprit_of(caught)
    assert (culprit.module_name, culprit.phase, report.cause) == ("", "forward", "forward")
    assert culprit.call_index == 0  # the outer call (the inner one is call 1)
    assert report.batch_number == 0
    assert guard.batch_number == 0


def test_a_recursive_root_counts_one_batch_per_top_level_call():
    torch.manual_seed(0)
    model = Recursive(overflow_outer=False)
    numbers = []
    with Guard(model) as guard:
        for _ in range(3):
            model(torch.ones(1, 2)).sum().backward()
            numbers.append(guard.batch_number)
    assert numbers == [0, 1, 2]
    assert guard.detection is None


# ---- 6. inference_mode must not poison the CPU scratch buffer ------------------------------
def test_overflow_after_a_large_forward_under_inference_mode_is_still_detected():
    ng_stats.release_workspace()  # the buffer must be created inside inference_mode below
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), Exp())
    x = torch.randn(256, 512)  # 131072 elements: above the scratch-buffer threshold
    assert x.numel() >= 65536
    with Guard(model) as guard:
        with torch.inference_mode():
            model(x)
        assert guard.detection is None
        with pytest.raises(NonFiniteError) as caught:
            model(x * 1000)
    report, culprit = culprit_of(caught)
    assert (culprit.module_name, culprit.module_class, report.cause) == ("1", "Exp", "forward")
    assert report.batch_number == 1
    assert rows_of(culprit)["output"].posinf
    # every row of that frame was summarised (none fell back to 'unsupported')
    assert all(row.kind == "tensor" for row in culprit.rows)


# ---- 7. tensors the guard cannot or can only partly read -----------------------------------
def _sparse_coo():
    return torch.eye(3).to_sparse()


def _sparse_csr():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.eye(3).to_sparse_csr()


def _jagged():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor(
            [torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)


LAYOUTS = {"sparse_coo": _sparse_coo, "sparse_csr": _sparse_csr, "nested_jagged": _jagged}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sparse_and_nested_tensors_pass_clean_and_their_inf_nan_is_detected(layout):
    torch.manual_seed(0)
    x = LAYOUTS[layout]()
    clean = Fn(lambda t: t * 2)
    with Guard(clean) as guard:
        y = clean(x)
    assert guard.detection is None
    assert y.layout == x.layout and y.is_nested == x.is_nested
    rows = [row for frame in guard.report.frames for row in frame.rows]
    assert {row.role for row in rows} >= {"input[0]", "output"}
    assert all(row.kind == "tensor" and not row.nonfinite for row in rows
               if row.role in ("input[0]", "output"))
    for bad, word in ((INF, "inf"), (NAN, "nan")):
        model = Fn(lambda t, bad=bad: t * bad)
        with pytest.raises(NonFiniteError) as caught, Guard(model):
            model(x)
        report, culprit = culprit_of(caught)
        assert (culprit.module_name, report.cause) == ("", "forward")
        assert [row.role for row in culprit.flagged_rows] == ["output"]
        assert word in culprit.flagged_rows[0].problems


def test_float8_e5m2_output_overflowing_to_inf_is_detected():
    model = Fn(lambda t: (t * 1e6).to(torch.float8_e5m2))  # beyond e5m2's 57344: inf
    x = torch.tensor([1.0, -2.0, 3.0, 0.5])
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x)
    report, culprit = culprit_of(caught)
    assert report.cause == "forward"
    row = culprit.flagged_rows[0]
    assert (row.role, row.dtype) == ("output", "float8_e5m2")
    assert row.posinf and row.neginf


def test_clean_float8_output_is_summarised():
    model = Fn(lambda t: t.to(torch.float8_e5m2))
    with Guard(model) as guard:
        model(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    row = rows_of(guard.report.frames[-1])["output"]
    assert (row.kind, row.dtype, row.abs_max, row.nonfinite) == ("tensor", "float8_e5m2", 3.0, False)


def test_meta_tensors_are_reported_as_unsupported_without_raising():
    model = Fn(lambda t: t * 2)
    with Guard(model) as guard:
        y = model(torch.empty(3, 2, device="meta"))
    assert y.is_meta and guard.detection is None
    rows = rows_of(guard.report.frames[-1])
    assert rows["input[0]"].kind == "unsupported"
    assert rows["output"].kind == "unsupported"
    assert rows["output"].shape == (3, 2)


# the ops nn.Linear needs (and the attribute reads the guard makes)
STRICT_ALLOWED = frozenset({
    "__get__", "mul", "__mul__", "linear", "shape", "dtype", "numel", "requires_grad",
    "_version", "is_inference", "device", "is_floating_point", "is_complex", "dim", "size",
    "__repr__", "grad_fn", "register_hook", "element_size", "is_contiguous",
})


class Strict(torch.Tensor):
    """A subclass allowing only a few ops, raising ValueError on the rest (like tracing or
    masked-tensor libraries)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in STRICT_ALLOWED:
            raise ValueError(f"Strict does not support {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_tensor_subclass_whose_torch_function_raises_never_breaks_the_forward():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4).as_subclass(Strict)
    with torch.no_grad():
        expected = model(x)  # the subclass itself works without the guard
    with pytest.raises(ValueError):
        x.abs()  # and really refuses what it does not allow
    with Guard(model) as guard, torch.no_grad():
        y = model(x)
    assert type(y) is type(expected)
    assert torch.equal(y.as_subclass(torch.Tensor), expected.as_subclass(torch.Tensor))
    assert guard.detection is None
    rows = rows_of(guard.report.frames[-1])
    # its numbers were still read (around its __torch_function__), not skipped
    assert rows["input[0]"].kind == "tensor" and rows["output"].kind == "tensor"
    plain = x.as_subclass(torch.Tensor)
    assert rows["input[0]"].abs_max == pytest.approx(plain.abs().max().item())
    # and a nan in such a tensor is still caught
    bad = plain.clone()
    bad[0, 0] = NAN
    with pytest.raises(NonFiniteError) as caught, Guard(model), torch.no_grad():
        model(bad.as_subclass(Strict))
    report, culprit = culprit_of(caught)
    assert (culprit.module_name, report.cause) == ("", "data")


# ---- 8. big python containers and deep nesting ---------------------------------------------
class TakesLengths(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, lengths):
        return self.lin(x)


def test_a_list_of_20000_ints_is_one_row():
    model = TakesLengths()
    with Guard(model) as guard:
        model(torch.randn(2, 4), list(range(20000)))
    root = [f for f in guard.report.frames if f.module_name == ""][-1]
    roles = [row.role for row in root.rows]
    assert len(roles) < 10, f"{len(roles)} rows for one call"
    assert roles.count("input[1]") == 1
    assert not any(role.startswith("input[1][") for role in roles)
    assert rows_of(root)["input[1]"].kind == "not a tensor"


class Deep(nn.Module):
    def forward(self, x):
        return [[[[[[x / 0 * 0]]]]]]  # nan, six lists deep


class DeepRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.deep = Deep()
        self.tail = nn.Identity()

    def forward(self, x):
        return self.tail(self.deep(x)[0][0][0][0][0][0])


def test_a_nan_nested_six_levels_deep_is_summarised_and_detected():
    model = DeepRoot()
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(torch.ones(3))
    report, culprit = culprit_of(caught)
    assert (culprit.module_name, report.cause) == ("deep", "forward")
    assert [row.role for row in culprit.flagged_rows] == ["output[0][0][0][0][0][0]"]
    assert culprit.flagged_rows[0].kind == "tensor" and culprit.flagged_rows[0].nan


def test_a_clean_input_nested_six_levels_deep_gets_a_tensor_row():
    model = Fn(lambda t: t[0][0][0][0][0][0] * 2)
    with Guard(model) as guard:
        model([[[[[[torch.ones(3)]]]]]])
    rows = rows_of(guard.report.frames[-1])
    row = rows["input[0][0][0][0][0][0][0]"]
    assert (row.kind, row.shape, row.abs_max) == ("tensor", (3,), 1.0)


# ---- 9. weights used without calling their module ------------------------------------------
class UsesSubWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.sub = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 1, bias=False)

    def forward(self, x):
        return self.head(F.linear(x, self.sub.weight))  # sub itself is never called


def test_inf_in_the_gradient_of_a_weight_whose_module_is_never_called_is_named():
    model = UsesSubWeight()
    with torch.no_grad():
        model.sub.weight.fill_(0.1)
        model.head.weight.fill_(1.0)
    x = torch.full((8, 4), 1e38)  # forward finite; sub.weight.grad = 8 * 1e38 = inf
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        y = model(x)
        assert torch.isfinite(y).all()
        y.backward(torch.ones_like(y))  # y.sum() itself would overflow, outside the model
    report, culprit = culprit_of(caught)
    assert (culprit.module_name, culprit.phase, report.cause) == ("sub", "backward", "backward")
    assert [row.role for row in culprit.flagged_rows] == ["weight.grad"]
    assert culprit.flagged_rows[0].posinf
    assert not torch.isfinite(model.sub.weight.grad).all()  # it really was inf


# ---- 10. activation checkpointing ----------------------------------------------------------
class CheckpointedClean(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


class NanBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.sq = SqrtOfZero()

    def forward(self, x):
        return self.sq(self.lin(x))


class CheckpointedNan(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.block = NanBlock()
        self.head = nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_block_counts_one_batch_per_top_level_call(reentrant):
    torch.manual_seed(0)
    model = CheckpointedClean(reentrant)
    numbers = []
    with Guard(model, max_frames=200) as guard:
        for _ in range(3):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
            numbers.append(guard.batch_number)
    assert numbers == [0, 1, 2]
    assert guard.detection is None
    frames = guard.report.frames
    assert {f.batch_number for f in frames} == {0, 1, 2}
    forward = [(f.module_name, f.batch_number, f.call_index) for f in frames if f.phase == "forward"]
    # one root call per batch; the block's recomputation is call 1 of the same batch
    assert [x for x in forward if x[0] == ""] == [("", 0, 0), ("", 1, 0), ("", 2, 0)]
    assert [x for x in forward if x[0] == "block"] == [
        ("block", b, i) for b in range(3) for i in (0, 1)]
    # the recomputed block was watched in backward too
    assert {(f.batch_number, f.call_index) for f in frames
            if f.module_name == "block.0" and f.phase == "backward"} == {
        (b, i) for b in range(3) for i in (0, 1)}


@pytest.mark.parametrize("reentrant", [False, True])
def test_nan_made_in_backward_inside_a_checkpointed_block_names_the_module(reentrant):
    torch.manual_seed(0)
    model = CheckpointedNan(reentrant)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(NonFiniteError) as caught, Guard(model) as guard:
        y = model(x)
        assert torch.isfinite(y).all()
        y.sum().backward()
    report, culprit = culprit_of(caught)
    assert (culprit.module_name, culprit.phase, report.cause) == ("block.sq", "backward", "backward")
    assert [row.role for row in culprit.flagged_rows] == ["grad_input[0]"]
    assert report.batch_number == 0 and guard.batch_number == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_root_does_not_start_a_batch_in_its_own_backward(reentrant):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with Guard(model, abort_after_batch=0) as guard:
        y = checkpoint(model, torch.randn(2, 4, requires_grad=True), use_reentrant=reentrant)
        y.sum().backward()  # recomputes the root: must not count as batch 1
        assert guard.batch_number == 0
        assert guard.detection is None
        with pytest.raises(BatchLimitReached):  # a real second call still stops
            checkpoint(model, torch.randn(2, 4, requires_grad=True), use_reentrant=reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_root_counts_one_batch_per_call(reentrant):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    numbers = []
    with Guard(model) as guard:
        for _ in range(3):
            y = checkpoint(model, torch.randn(2, 4, requires_grad=True), use_reentrant=reentrant)
            y.sum().backward()
            numbers.append(guard.batch_number)
    assert numbers == [0, 1, 2]
    assert guard.detection is None


# ---- 11. begin_batch(): the caller counts batches (Lightning style) ------------------------
class LitLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))

    def forward(self, x):
        return self.net(x)


def test_begin_batch_alone_advances_batches_and_honours_abort_and_trace():
    torch.manual_seed(0)
    model = LitLike()
    x = torch.randn(3, 4)
    with Guard(model, abort_after_batch=1, trace_batches=[1], max_frames=50) as guard:
        guard.begin_batch()
        assert guard.batch_number == 0
        for _ in range(2):  # submodule called directly, several times: still batch 0
            model.net(x).sum().backward()
        model(x).sum().backward()  # calling the root no longer starts a batch either
        assert guard.batch_number == 0
        assert guard.traces == {}
        guard.begin_batch()
        assert guard.batch_number == 1
        model.net(x).sum().backward()
        model.net(x).sum().backward()
        assert guard.batch_number == 1
        with pytest.raises(BatchLimitReached):
            guard.begin_batch()
    assert set(guard.traces) == {1}
    trace = guard.traces[1]
    assert trace.batch_number == 1
    assert trace.frames and all(f.batch_number == 1 for f in trace.frames)
    forward = [(f.module_name, f.call_index) for f in trace.frames if f.phase == "forward"]
    assert forward == [("net.0", 0), ("net.1", 0), ("net.2", 0), ("net", 0),
                       ("net.0", 1), ("net.1", 1), ("net.2", 1), ("net", 1)]
    assert {f.module_name for f in trace.frames if f.phase == "backward"} >= {"net", "net.0"}


def test_detection_after_begin_batch_reports_the_callers_batch():
    model = LitLike()
    with Guard(model) as guard:
        for _ in range(3):
            guard.begin_batch()
            model.net(torch.randn(3, 4)).sum().backward()
        guard.begin_batch()
        bad = torch.randn(3, 4)
        bad[0, 0] = NAN
        with pytest.raises(NonFiniteError) as caught:
            model.net(bad)
    report, culprit = culprit_of(caught)
    assert report.batch_number == 3 and culprit.batch_number == 3
    assert (culprit.module_name, report.cause) == ("net", "data")


# ---- 12. bad options ------------------------------------------------------------------------
def exp_model():
    """exp(x + 0): its second module overflows to +inf for x = 1e4, deterministically."""
    model = nn.Sequential(nn.Linear(2, 2), Exp())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2))
        model[0].bias.zero_()
    return model


def test_non_callable_on_detect_is_a_type_error_at_construction():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="on_detect"):
        Guard(model, on_detect=1)
    assert not model._forward_hooks and not model._forward_pre_hooks


@pytest.mark.parametrize("batches", [[1.5], [True], ["1"], 1])
def test_trace_batches_that_are_not_batch_numbers_are_a_value_error(batches):
    with pytest.raises(ValueError, match="trace_batches"):
        Guard(nn.Linear(2, 2), trace_batches=batches)


@pytest.mark.parametrize("returned", [None, 1, "text", "report", ValueError])
def test_on_detect_returning_a_non_exception_still_raises_non_finite_error(returned):
    seen = []

    def on_detect(report):
        seen.append(report)
        return report if returned == "report" else returned

    model = exp_model()
    with pytest.raises(NonFiniteError) as caught, Guard(model, on_detect=on_detect):
        model(torch.full((1, 2), 1e4))
    assert len(seen) == 1 and seen[0] is caught.value.report
    assert caught.value.report.first_nonfinite.module_name == "1"


def test_on_detect_returning_an_exception_raises_it():
    class Stop(Exception):
        pass

    model = exp_model()
    with pytest.raises(Stop), Guard(model, on_detect=lambda report: Stop(report.summary())):
        model(torch.full((1, 2), 1e4))


@pytest.mark.parametrize("name", ["float64", "fp64", "double", "torch.float64", torch.float64, torch.float32])
def test_limit_dtype_as_wide_as_float32_is_refused(name):
    model = exp_model()
    with pytest.raises(ValueError, match="^limit_dtype is the narrower format"):
        Guard(model, limit_dtype=name)
    assert not model._forward_hooks and not model._forward_pre_hooks


# ---- 13. only pass-through -inf: the summary says so ---------------------------------------
class AddMask(nn.Module):
    def forward(self, scores, mask):
        return scores + mask  # -inf where masked: passes the mask's -inf through


class MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.add_mask = AddMask()

    def forward(self, x, mask):
        return torch.softmax(self.add_mask(self.proj(x), mask), dim=-1)


def test_a_report_with_only_pass_through_minus_inf_says_nothing_was_produced():
    torch.manual_seed(0)
    model = MaskedAttention()
    mask = torch.zeros(3, 4)
    mask[:, 2:] = -INF  # every row keeps two positions
    with Guard(model, max_frames=50) as guard:
        model(torch.randn(3, 4), mask).sum().backward()
    report = guard.report
    assert guard.detection is None and report.ok
    assert any(frame.nonfinite for frame in report.frames)
    masked = [f for f in report.frames if f.module_name == "add_mask" and f.phase == "forward"]
    assert masked and rows_of(masked[-1])["output"].neginf and not rows_of(masked[-1])["output"].posinf
    summary = report.summary()
    assert summary.startswith("no inf/nan produced")
    assert "passed through" in summary


def test_non_finite_running_statistics_are_named_as_buffers():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).eval()
    with torch.no_grad():
        model[1].running_var[0] = float("nan")
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model):
            model(torch.randn(3, 4))
    report = caught.value.report
    assert (report.first_nonfinite.module_name, report.cause) == ("1", "weights")
    assert [row.role for row in report.first_nonfinite.flagged_rows] == ["running_var"]
    assert "buffers of 1 (BatchNorm1d)" in report.reason


def test_a_stored_minus_inf_mask_buffer_passing_through_is_not_a_detection():
    class StoredMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", torch.triu(torch.full((4, 4), float("-inf")), diagonal=1))

        def forward(self, scores):
            return scores + self.mask  # -inf where masked: received from the buffer, not produced

    model = nn.Sequential(nn.Linear(4, 4), StoredMask())
    with Guard(model) as guard:
        model(torch.randn(4, 4))
    assert guard.report.ok


# ---- a forward that raises an error of its own after a nan ------------------------------------
class GaussianPolicy(nn.Module):
    """A policy whose own code makes nan (log of a negative), then hands it to a distribution
    that refuses it: the user sees a ValueError, not a nan."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.mu = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.log(self.body(x) - 10)  # <- the nan's line
        return torch.distributions.Normal(self.mu(h), 1.0, validate_args=True)


class RefusesNan(nn.Module):
    def forward(self, x):
        assert not torch.isnan(x).any(), "nan in activations"
        return x


class LogOfShifted(nn.Module):
    def forward(self, x):
        return torch.log(x - 10)


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="exception notes: Python 3.11+")
def test_a_nan_made_before_the_forward_raises_an_error_of_its_own_is_named_on_that_error():
    torch.manual_seed(0)
    policy = GaussianPolicy()
    with pytest.raises(ValueError, match="Expected parameter loc") as caught:
        with Guard(policy, ops=True) as guard:
            policy(torch.randn(3, 4))
    note = " ".join(caught.value.__notes__)
    assert note.startswith("numguard found, before this error: GaussianPolicy produced"), note
    report = guard.detection  # the user's error stays the one raised; the culprit is kept
    assert (report.first_nonfinite.module_name, report.cause) == ("", "forward-inline")
    assert report.first_nonfinite.op == "aten.log.default"
    assert report.first_nonfinite.source.endswith("h = torch.log(self.body(x) - 10)  # <- the nan's line")
    assert "overflow" not in report.reason  # a nan handed on, not an inf turned into nan
    model = nn.Sequential(nn.Linear(4, 4), LogOfShifted(), RefusesNan(), nn.Linear(4, 1))
    with pytest.raises(AssertionError, match="nan in activations") as caught:
        with Guard(model) as guard:
            model(torch.randn(3, 4))
    assert "1 (LogOfShifted) produced a non-finite value in forward" in caught.value.__notes__[0]
    assert guard.report.first_nonfinite.module_name == "1"


def test_a_report_of_frames_that_only_carry_a_nan_does_not_call_it_a_mask():
    from numguard_nb.report import Frame, Report, TensorRow

    row = TensorRow(role="output", category="output", kind="tensor", dtype="float32", shape=(2,),
                    abs_min=float("nan"), abs_max=float("nan"), nan=True)
    frame = Frame(module_name="head", module_class="Linear", phase="forward", batch_number=0,
                  call_index=0, rows=[row])
    assert "carry nan or inf they were given" in Report(frames=[frame]).summary()


# ---- parameters that change while the guard is attached --------------------------------------
def _overflowing_weight_gradient() -> nn.Sequential:
    """Layer 0's weight gradient overflows: its input 1e30 times the gradient it gets, 1e30."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(1e-31), model[0].bias.zero_(), model[1].weight.fill_(1.0)
        model[1].bias.zero_()
    return model


@pytest.mark.parametrize("change", ["unfrozen", "a new parameter", "load_state_dict(assign=True)"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_parameter_that_trains_from_a_change_made_while_attached_has_its_gradient_watched(
        change, mode):
    model = _overflowing_weight_gradient()
    if change == "unfrozen":
        model[0].requires_grad_(False)  # gradual unfreezing: frozen as the guard attaches
    with pytest.raises(NonFiniteError) as caught, Guard(model, mode=mode):
        if change == "unfrozen":
            model[0].requires_grad_(True)
        elif change == "a new parameter":
            model[0].weight = nn.Parameter(model[0].weight.detach().clone())
        else:
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        (model(torch.full((2, 4), 1e30)).sum() * 1e30).backward()
    report = caught.value.report
    assert (report.first_nonfinite.module_name, report.phase) == ("0", "backward"), report.reason
    assert "weight.grad holds +inf" in report.reason


def test_a_replaced_parameter_is_let_go_while_attached():
    import gc
    import weakref

    model = _overflowing_weight_gradient()
    with Guard(model):
        old = weakref.ref(model[0].weight)
        model[0].weight = nn.Parameter(torch.zeros(4, 4))
        model(torch.ones(2, 4)).sum().backward()  # (let go as the next pass starts)
        gc.collect()
        assert old() is None


@pytest.mark.parametrize("options", [{}, {"ops": True}])
def test_submodules_replaced_while_attached_are_let_go_and_the_new_ones_watched(options):
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    model[0].weight.requires_grad_(False)  # (a frozen one too: nothing of it kept)
    replaced = []
    with Guard(model, **options):
        for _ in range(5):  # a new head per fold, in one attached session
            replaced += [weakref.ref(model[2]), weakref.ref(model[2].weight)]
            model[2] = nn.Linear(4, 1)
            model(torch.randn(2, 4)).sum().backward()
        gc.collect()
        assert all(gone() is None for gone in replaced)  # heads and their weights
        with torch.no_grad():
            model[2].weight.fill_(float("inf"))
        with pytest.raises(NonFiniteError, match=r"^the weights of 2 \(Linear\)"):
            model(torch.randn(2, 4))


class ReturnsItsLogVariance(nn.Module):
    """A learned log-variance returned as it is, beside the prediction (a leaf as an output)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.log_var = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return self.fc(x), self.log_var


@pytest.mark.parametrize("options", [{}, {"ops": True}, {"mode": "sentinel"}])
def test_a_parameter_returned_as_an_output_gets_no_hook_per_call(options):
    model = ReturnsItsLogVariance()
    with Guard(model, **options):
        for _ in range(20):
            mean, log_var = model(torch.randn(2, 4))
            (torch.exp(-log_var) * mean ** 2 + log_var).mean().backward()
        assert len(model.log_var._backward_hooks or {}) <= 2  # its gradient's, the op recorder's
    assert not model.log_var._backward_hooks


class CheckpointedBlockThenWhereSqrt(nn.Module):
    """A checkpointed block, then the model's own `where(h > 0, sqrt(h), 0)`: its backward makes
    nan (0 * the sqrt's gradient of a negative) and hands it to the block."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x):
        h = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(torch.where(h > 0, torch.sqrt(h), 0.0)).sum()


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_the_model_makes_after_a_checkpointed_block_is_the_model_s(reentrant, mode):
    # reentrant checkpointing runs the block's backward as a backward of its own: still the
    # step's, its gradient made by the model's own code, not by the loss
    torch.manual_seed(0)
    model = CheckpointedBlockThenWhereSqrt(reentrant)
    with pytest.raises(NonFiniteError) as caught, Guard(model, mode=mode):
        model(torch.randn(8, 4, requires_grad=True)).backward()
    report = caught.value.report
    assert (report.cause, report.first_nonfinite.module_name) == ("backward-inline", ""), report.reason


class CheckpointedWide(nn.Module):
    """A checkpointed block handed values past float16's range (headroom in the recompute)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x):
        return self.head(checkpoint(self.block, x * 1e5, use_reentrant=self.reentrant)).sum()


class MarksNoLimit(nn.Module):
    """Writes +inf as a "no limit" marker (allowed) that a min-pool then drops."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(3, 3)

    def forward(self, x, pad):
        h = self.lin(x).masked_fill(pad, float("inf")).min(-1).values
        return self.out(torch.tanh(h).unsqueeze(0).expand(3, 3))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_recomputations_change_no_verdict(reentrant):
    # headroom over a recomputed call; allow_inf in a recomputation torch stops early (its own
    # exception inside the block): no crash, no detection
    torch.manual_seed(0)
    model = CheckpointedWide(reentrant)
    with Guard(model, limit_dtype=torch.float16) as guard:
        model(torch.randn(8, 4, requires_grad=True)).backward()
    assert guard.detection is None and len(guard.headroom) > 0
    block, head = MarksNoLimit(), nn.Linear(3, 1)
    pad = torch.zeros(3, 4, dtype=torch.bool)
    pad[:, -1] = True
    seen = []
    with Guard(block, allow_inf=True, on_detect=seen.append) as guard:
        for _ in range(2):
            head(checkpoint(block, torch.randn(3, 4), pad, use_reentrant=reentrant)).sum().backward()
    assert guard.detection is None and seen == []


def test_a_parameter_held_under_a_second_name_stays_watched_when_the_first_is_replaced():
    class NanGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            return w.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * float("nan")

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(3))
            self.w2 = self.w1

        def forward(self, x):
            return (x * self.w2.detach()).sum()

    model = Twice()
    with pytest.raises(NonFiniteError, match=r"w1\.grad holds nan"), Guard(model):
        model.w1 = nn.Parameter(torch.randn(3))  # w2 (the old w1) still trains
        (model(torch.randn(3)) + NanGradient.apply(model.w2).sum()).backward()
