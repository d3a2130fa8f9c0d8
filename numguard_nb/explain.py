"""Why a detection happened and what to try, in a sentence or two: `hint_for(report)`.

Hugging Face's debugging guide explains its report by hand: the abs max reached 6.27e4, near
float16's 65504, so keep that part in float32. `hint_for` writes that explanation for any
detection from what the report holds: its cause, the culprit frame's module and phase, the
numbers of its rows, and the op and source line that op localisation named. A hint states the
numbers (the dtype's largest value, what the values reached) and what to try, with a short piece
of code where one helps. A situation no rule recognises gets a general hint (which value, what to
check) rather than a specific one that could be wrong.

Pure: it reads a `Report` and returns text; the engine stores the text in `Report.hint`.
"""

from __future__ import annotations

import math
import re

from ._schema import (
    ARITHMETIC_OPS, BUFFER, CAUSE_DATA, CAUSE_LOSS_GRADIENT, CAUSE_OUTSIDE, CAUSE_UNATTRIBUTED,
    CAUSE_WEIGHTS, CODE_CAUSES, CTC_OPS, DIVISION_OPS, EXP_OPS, FORWARD, INPUT, LOG_OPS,
    MASK_REACHED_LOSS, MATMUL_MODULES, MATMUL_NODES, MATMUL_OPS, NLL_OPS, NORM_NODES,
    ORIGIN_BEFORE_ATTACH,
    ORIGIN_OPTIMIZER_STEP, ORIGIN_OUTSIDE_FORWARD, ORIGIN_SINCE_ATTACH, ORIGIN_SINCE_FORWARD, PARAM,
    RECURRENT_MODULES, SOFTMAX_OPS, VALUE_TENSOR, WRITTEN_IN_FORWARD,
)
from .hint_facts import (
    MASK_FILLS, OPS_ADVICE, Facts, facts_of, format_number, is_operand, kinds_of, largest,
    limit_text, roles_of,
)
from .report import Report, TensorRow, dtype_max

__all__ = ["hint_for", "format_number", "limit_text", "OPS_ADVICE"]

# float16's smallest positive (subnormal) value: below half of it a value rounds to 0, as Adam's
# default eps of 1e-8 does.
FLOAT16_SMALLEST = 2.0 ** -24

CLIP = "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"
FROM_LOGITS = "`F.log_softmax`, `F.logsigmoid` or `nn.BCEWithLogitsLoss`"

BFLOAT16 = f"bfloat16 (largest value {format_number(dtype_max('bfloat16'))})"


# ---- code to suggest -----------------------------------------------------------------------
def _module_path(name: str, model: str = "model") -> str:
    """'model.block[1].wo' for 'block.1.wo' (`model`: what the guarded model is called)."""
    path = model
    for part in name.split(".") if name else ():
        path += f"[{part}]" if part.isdigit() else f".{part}"
    return path


def _float32_call(facts: Facts) -> str:
    """The culprit layer's call with its input in float32: 'h = self.wo(h.float())'."""
    attribute = facts.frame.module_name.rpartition(".")[2]
    if not attribute.isidentifier():
        return ""
    name = re.escape(attribute)
    call = re.search(rf"self\.{name}\(([\w.]+)\)", facts.line)
    if call is None:
        return f"x = self.{attribute}(x.float())"
    whole = re.fullmatch(rf"(\w+)\s*=\s*self\.{name}\(([\w.]+)\)", facts.line)
    target = whole.group(1) if whole else "out"
    return f"{target} = self.{attribute}({call.group(1)}.float())"


def _autocast_off(facts: Facts) -> str:
    """The line that turns autocast off, for the device it ran on (CUDA where it was off)."""
    return f'with torch.autocast("{facts.report.autocast_device or "cuda"}", enabled=False):'


def _in_float32(facts: Facts) -> str:
    """How to run the culprit's computation in float32, as a clause ('keep this layer ...').
    A layer with weights (Linear, a norm) is kept in float32 as a whole; for a module's own code,
    the line op localisation named is."""
    frame = facts.frame
    params = facts.rows_of(PARAM)
    off = _autocast_off(facts)
    if params and frame.module_name:
        path = _module_path(frame.module_name, facts.report.model_variable)
        call = _float32_call(facts)
        if not call:
            return (f"keep `{path}` in float32 (in `{off}`, with `{path}.float()` for a "
                    "model made with `.half()`, and its input `.float()`)")
        fix = f"keep this layer in float32 (under autocast `{off} {call}`"
        if any(row.dtype == "float16" for row in params):
            fix += f"; in a model made with `.half()` also `{path}.float()`"
        return fix + ")"
    if not facts.report.autocast_device:  # a model made with `.half()`: no autocast to turn off
        what = f"`{facts.line}`" if facts.line else facts.where
        return (f"run {what} in float32 (its operands `.float()`, and what it gives `.half()` "
                "again for the float16 layers after it)")
    if facts.line:
        return f"run `{facts.line}` in float32 (in `{off}`, its operands `.float()`)"
    return f"run {facts.where} in float32 (in `{off}`, its inputs `.float()`)"


# ---- causes outside a module's code ----------------------------------------------------------
def _pronoun(rows, object_: bool = False) -> str:
    if len(rows) == 1:
        return "it"
    return "them" if object_ else "they"


def _subject(rows, where: str, adjective: str = "") -> str:
    """'The weight of fc (Linear) holds' / 'The weight, bias of fc (Linear) hold'."""
    verb = "holds" if len(rows) == 1 else "hold"
    return f"The {adjective}{roles_of(rows)} of {where} {verb}"


def _weights_hint(facts: Facts) -> str:
    frame, rows = facts.frame, facts.flagged
    where, batch = facts.where, facts.report.batch_number
    if facts.predicted:
        pronoun = "it" if len(rows) == 1 else "they"
        return (f"The {roles_of(rows)} of {where} reached {facts.found}, beyond "
                f"{limit_text(facts.dtype)}: cast to {facts.dtype} (by `.half()` or autocast) "
                f"{pronoun} would be inf. Keep {where} in float32 or train in {BFLOAT16}, and "
                "check what let the weights grow this large (the learning rate, no weight decay).")
    subject = f"{_subject(rows, where)} {facts.found} in batch {batch}"
    origin, step = facts.report.weights_origin, facts.report.optimizer_step
    if all(row.category == BUFFER for row in rows):
        reset = (f"reset them with `{_module_path(frame.module_name, facts.report.model_variable)}.reset_running_stats()` or "
                 "reload a checkpoint" if "Norm" in frame.module_class
                 else "reload them from a checkpoint")
        if origin == ORIGIN_SINCE_FORWARD:
            them = _pronoun(rows, object_=True)
            held = f"{subject}, and {_pronoun(rows)} held none when the model's previous forward began"
            if "Norm" in frame.module_class:
                return (f"{held}: that forward updated {them} in training mode from a batch holding "
                        f"inf/nan (or values whose variance overflows), or code run after that "
                        f"forward wrote {them}. Find that batch, then {reset}.")
            return (f"{held}: the forward of {where} updated {them} where "
                    "autograd does not see it (in place through `.data`, as an EMA of statistics "
                    "or a codebook does: look for a division by a count that can be 0, such as a "
                    "code no input chose), or code after that forward did. An update made under "
                    "`torch.no_grad()` without `.data` is named by the guard as it is written.")
        attached = (", the guard's first forward of the model: they were already non-finite when "
                    "it attached, e.g. because" if origin == ORIGIN_BEFORE_ATTACH else ":")
        return (f"{subject}{attached} an earlier batch holding inf/nan went through it in "
                f"training mode, and its running statistics kept it. Find that batch, then "
                f"{reset}.")
    if origin == ORIGIN_BEFORE_ATTACH:
        since = f" (or {step.words} wrote them)" if step is not None else ""
        return (f"{subject}: they were already non-finite when the guard attached{since}. "
                "Check where they came from: the checkpoint "
                "(`all(t.isfinite().all() for t in state_dict.values())` before "
                "`load_state_dict`) or a custom initialisation (a division by a zero fan-in or "
                "std). If the model trained before, guard it from its first step to have the "
                "step that wrote them named.")
    if origin in (ORIGIN_OUTSIDE_FORWARD, ORIGIN_SINCE_ATTACH):
        before, between = (("the guard attached", "the guard's attach and this forward")
                           if origin == ORIGIN_SINCE_ATTACH
                           else ("the model's previous forward", "those two forwards"))
        return (f"{subject}, and no optimizer step ran since {before}, which "
                "found them finite: code outside the model's forward wrote them, e.g. an in-place "
                "update under `torch.no_grad()` (a hand-written optimizer, weight clipping, an "
                "EMA) or `load_state_dict` from a checkpoint holding inf/nan. Check the code that "
                f"runs between {between}.")
    if origin != ORIGIN_OPTIMIZER_STEP or step is None:
        return (f"{subject}: an optimizer step whose update was not finite (a learning rate that "
                "makes training diverge; in float16, Adam's eps=1e-8, which rounds to 0) or code "
                "outside the model's forward (an in-place update under `torch.no_grad()`, a "
                "checkpoint load) wrote them. Attach the guard before the first step to have the "
                "step named.")
    if step.stale_gradients:  # (a step stopped before zero_grad, then a run added to its .grad)
        return (f"{subject}: the optimizer step that wrote them, {step.words}, applied gradients "
                "whose .grad already held inf/nan when the guard attached. Zero them "
                "(`optimizer.zero_grad()`) and reload the weights and optimizer state first.")
    if step.eps == 0:
        return (f"{subject}: the optimizer step that wrote them, {step.words}, has eps=0, so a "
                "weight whose gradients were all exactly 0 (an embedding row no batch used) gets "
                "0/0. Give it an eps above 0 (1e-8, the default; `adam_epsilon` of a Trainer).")
    if any(row.dtype == "float16" for row in rows) and "Adam" in step.optimizer:
        return (f"{_subject(rows, where, 'float16 ')} {facts.found} in batch {batch}: the "
                f"optimizer step that wrote them was {step.words}. Adam's default eps=1e-8 rounds "
                f"to 0 in float16 (its smallest value is {format_number(FLOAT16_SMALLEST)}), so a "
                "weight with a zero gradient gets 0/0. Keep the weights in float32 and train under "
                "`torch.autocast` with `torch.amp.GradScaler`, or pass `eps=1e-4`.")
    if step.cannot_have_made({row.dtype for row in rows}):
        return (f"{subject}: the optimizer step before it, {step.words}, moves a weight by about "
                "its learning rate at most from finite gradients, and the backward's were finite. "
                "So either code changed the gradients between the backward and the step (a `.grad` "
                "divided by a count that was 0), or code run after the step wrote the weights (a "
                "callback or hook writing under `torch.no_grad()`, weight clipping, an EMA copied "
                "back), or its state (`exp_avg_sq`) was loaded holding inf/nan. Check the code "
                "around `optimizer.step()`.")
    return (f"{subject}: the optimizer step that wrote them, {step.words}, made a non-finite "
            "update, typically from a learning rate that makes training diverge. Lower the "
            f"learning rate and clip gradients with `{CLIP}` before `optimizer.step()` (under "
            "float16 autocast, step through `torch.amp.GradScaler`, which skips steps whose "
            "gradients hold inf).")


def _shape(shape) -> str:
    return "\u00d7".join(str(n) for n in shape) if shape else "scalar"


def _data_hint(facts: Facts) -> str:
    row = facts.flagged[0] if facts.flagged else TensorRow("x", INPUT)
    if row.predicted_overflow and not row.nonfinite:  # (stop_at_limit)
        return (f"The batch fed to {facts.where} reaches {facts.found}, beyond "
                f"{limit_text(facts.dtype)}: cast to {facts.dtype} (autocast, `.half()`) it is inf "
                "before any module runs. Scale the inputs to a small range (standardise them), or "
                "keep the first layer in float32.")
    test = "torch.isnan(x)" if facts.nan and not facts.inf else "(~torch.isfinite(x))"
    if row.shape is None or len(row.shape) > 1:
        search = (f"`{test}.flatten(1).any(1).nonzero()` (x: {row.role}, shape "
                  f"{_shape(row.shape)})")
        which = "samples"
    else:
        search, which = f"`{test}.nonzero()` (x: {row.role})", "entries"
    features = row.nonfinite_features
    if features and row.shape and row.nonfinite_feature_count <= 3 and \
            row.nonfinite_sample_count == row.samples_in_batch and row.samples_in_batch > 1:
        # every sample, the same few columns: a feature broken upstream, not bad samples
        names = " and ".join(map(str, features))
        column = f"{'column' if len(row.shape) == 2 else 'channel'}{'s' if len(features) > 1 else ''}"
        return (f"The batch fed to {facts.where} already holds {facts.found} in {column} {names} of "
                f"{row.role} (dim 1 of shape {_shape(row.shape)}) for every one of its "
                f"{row.samples_in_batch} samples, before any module ran: a feature the data pipeline "
                f"broke, e.g. normalised by a std (or range) of 0 because it is constant, or "
                f"missing everywhere. Guard the normalisation, `(x - mean) / std.clamp_min(1e-8)`, "
                f"or drop the constant {column} ({names}).")
    if row.shape and row.shape[0] == 1:
        find = (f"It is in the batch's only sample ({row.role} has shape {_shape(row.shape)}): "
                "fix or drop it")
    elif row.samples_words:
        one = row.nonfinite_sample_count == 1
        find = (f"In {row.role}, {row.samples_words} {'holds' if one else 'hold'} it: fix or "
                f"drop {'it' if one else 'them'}, and find such {which} in other batches with "
                f"{search}")
    else:
        find = f"Find the {which} with {search} and fix or drop them"
    if facts.inf and not facts.nan:
        made = ("e.g. log(0) of a zero-width box or a zero count, a division by zero, or a value "
                "too large for the data's dtype")
        fix = "guard the log or division, e.g. `torch.log(w.clamp_min(1e-6))`"
    else:
        made = ("e.g. a normalisation dividing by a zero range or std (a blank image) or missing "
                "values read as nan")
        fix = "guard the division, e.g. `(x - lo) / (hi - lo).clamp_min(1e-8)`"
    return (f"The batch fed to {facts.where} already holds {facts.found} in "
            f"{roles_of(facts.flagged)}, before any module ran: the data pipeline made it, {made}. "
            f"{find}; {fix}.")


def _loss_gradient_hint(facts: Facts) -> str:
    where, found = facts.where, facts.found
    if facts.inf and not facts.nan and facts.dtype == "float16":
        return (f"The gradient entering {where} from outside the guarded modules is already "
                f"{found}: it passed {limit_text('float16')}, as a loss scaled by "
                "`torch.amp.GradScaler` does in its first steps (GradScaler then skips the step "
                "and lowers its scale), or a loss computed in float16. Compute the loss in float32 "
                "(`loss_fn(out.float(), y)`).")
    return (f"The gradient entering {where} from the loss is already {found}: the loss, computed "
            "outside the guarded modules, made it in its backward, e.g. log(0) in a hand-written "
            "cross-entropy (log of a sigmoid or softmax that rounded to 0 or 1), a mean over no "
            f"elements, or sqrt at 0. Compute losses from logits ({FROM_LOGITS}) or clamp "
            "(`torch.log(p.clamp_min(1e-7))`), and guard the loss module too to have it named: "
            '`Guard({"model": model, "loss": loss_fn})`.')


def _unattributed_hint(facts: Facts) -> str:
    return (f"nan first shows in {facts.where} ({facts.frame.phase}, {roles_of(facts.flagged)}), "
            "but none of the values passed between the modules before it holds it, so no module "
            "can be named: code outside the modules' calls made it (a hook, an in-place change of "
            "a tensor two modules share, a custom autograd Function). Check the tensors at that "
            "point with `torch.isnan(t).any()` in the code that runs between those module calls.")


# ---- a module's own code: by the op ------------------------------------------------------------
def _overflow_hint(facts: Facts, what: str) -> str:
    """`what` (e.g. 'The matmul (`aten.mm.default`) of wo (Linear)') passed its dtype's limit."""
    limit = dtype_max(facts.dtype)
    if limit is None:
        return ""
    reached = facts.reached()
    if facts.op in EXP_OPS:
        # (what the module was given is exp's argument only where it passes exp's threshold)
        top = largest(facts.rows_of(INPUT))
        given = f"; {reached}" if reached and top is not None and top.abs_max > math.log(limit) \
            else ""
        # float32 is no wider than bfloat16's range: only float16 gains from it
        wider = (", clamp the argument, or compute it in float32" if facts.dtype == "float16"
                 else " or clamp the argument")
        return (f"{what} passed {limit_text(facts.dtype)}{facts.at_line}{given}: exp overflows "
                f"{facts.dtype} above {math.log(limit):.4g}. Subtract the max first "
                f"(`torch.logsumexp`, `F.softmax`){wider}.")
    if limit >= 1e38:
        return _diverged_hint(facts, what)
    if facts.predicted:
        head = (f"{what} reached {facts.found}, beyond {limit_text(facts.dtype)} (limit_dtype): "
                f"in {facts.dtype} it would overflow to inf")
    else:
        head = f"{what} passed {limit_text(facts.dtype)}{facts.at_line}"
    head += f"; {reached}" if reached else ""
    if not facts.forward:
        return (f"{head}. Under `torch.amp.GradScaler` an inf gradient makes it skip the step and "
                "lower its scale (expected in its first steps); otherwise compute this part in "
                f"float32 or train in {BFLOAT16}.")
    norm = (" Statistics such as a variance are safest in float32, as `nn.LayerNorm` computes "
            "them." if "norm" in facts.frame.module_class.lower() else "")
    fix = _in_float32(facts)
    return f"{head}. {fix[0].upper()}{fix[1:]}, or train in {BFLOAT16}.{norm}"


def _diverged_hint(facts: Facts, what: str) -> str:
    """An overflow of float32 or bfloat16: values grew without bound. '' when the frame shows no
    large value (then something else overflowed, and the general hint says what to check)."""
    top = largest([row for row in facts.frame.rows if is_operand(row)])  # (no mask's fill)
    if top is None or top.abs_max < 1e6:
        return ""
    head = (f"{what} passed {limit_text(facts.dtype)}; values in this frame already reached "
            f"{format_number(top.abs_max)} ({top.role})")
    if facts.report.batch_number == 0:
        return (f"{head}, in the first batch: check the scale of the inputs (normalise them) "
                "and of the initial weights.")
    return (f"{head}: values this large mean training diverged. Lower the learning rate (e.g. "
            f"10x, or add warmup) and clip gradients with `{CLIP}` before `optimizer.step()`.")


def _forward_op_hint(facts: Facts) -> str:
    op, where, at = facts.op, facts.where, facts.at_line
    received = facts.received
    if op in SOFTMAX_OPS and facts.nan and not any(row.nan or row.posinf for row in received):
        return (f"The softmax{facts.named_op} in {where}{at} gave nan: a row whose entries are "
                "all -inf (every key masked, e.g. a sample whose attention mask is all 0) makes "
                "exp(-inf - (-inf)) = nan. Mask with a finite value, "
                "`scores.masked_fill(mask, torch.finfo(scores.dtype).min)`, or drop samples with "
                "no token.")
    if received:
        return ""
    if op in CTC_OPS and facts.inf:
        return _ctc_hint(facts)
    if op in NLL_OPS and facts.nan:
        return (f"The cross-entropy{facts.named_op} in {where} is nan: with reduction='mean' it "
                "divides by the number of labels other than ignore_index (-100), and that number "
                f"was 0{_all_ignored(facts)}: every label of the batch was ignored (e.g. only "
                "prompt tokens left, the answers cut off). Skip such batches "
                "(`if (labels != -100).any():`) or sum the loss and divide by `max(count, 1)`.")
    if op in LOG_OPS:
        return (f"The first non-finite value in {where} came from the log{facts.named_op}{at}: "
                "log(0) = -inf and the log of a negative value is nan, e.g. of a probability from "
                "a sigmoid or softmax that rounded to 0 or 1. Clamp the argument, "
                f"`torch.log(p.clamp_min(1e-7))`, or compute from logits: {FROM_LOGITS}.")
    if op == "sqrt" and facts.nan:
        return (f"The sqrt{facts.named_op} in {where}{at} gave nan: the square root of a "
                "negative value, e.g. a variance computed as E[x²] - E[x]² that rounding made "
                "slightly negative. Clamp it, `torch.sqrt(v.clamp_min(0) + 1e-6)`, or use "
                "`x.var(...)`.")
    if op == "rsqrt" and facts.inf:
        return (f"The rsqrt{facts.named_op} in {where}{at} gave {facts.found}: rsqrt(0) is inf. "
                "Add an eps inside: `torch.rsqrt(v + 1e-6)`.")
    if op in DIVISION_OPS:
        return _division_hint(facts)
    if op in MATMUL_OPS:
        noun = "convolution" if "conv" in op else "matmul"
        return _overflow_hint(facts, f"The {noun}{facts.named_op} in {where}")
    if op in ARITHMETIC_OPS:
        return _overflow_hint(facts, f"`{facts.frame.op}` in {where}")
    return ""


def _all_ignored(facts: Facts) -> str:
    for row in facts.rows_of(INPUT):
        # |label| = 100 throughout, and the count was 0: every one is ignore_index's -100
        if row.dtype and row.dtype.startswith("int") and row.abs_min == 100 == row.abs_max:
            return f" (every value of {row.role} is -100)"
    return ""


def _ctc_hint(facts: Facts) -> str:
    """CTC gives an infinite loss, and a nan gradient, for a target no alignment can fit."""
    return (f"The CTC loss{facts.named_op} in {facts.where}{facts.at_line} is {facts.found}: a "
            "target no alignment fits in its input, longer than the input's frames (each "
            "repeated label needs a blank between, so a target needs its length plus its "
            "repeats), e.g. input_lengths shortened by the model's downsampling or wrong "
            "target_lengths. Check `input_lengths >= target_lengths` per sample, or let such "
            "samples add nothing: `nn.CTCLoss(zero_infinity=True)` (`F.ctc_loss(..., "
            "zero_infinity=True)`) zeroes their loss and gradient.")


def _division_hint(facts: Facts) -> str:
    zeros = [row.role for row in facts.rows_of(INPUT)
             if row.kind == VALUE_TENSOR and row.abs_min == 0]
    evidence = f" ({', '.join(zeros)} holds zeros)" if zeros else ""
    # (what the op made: a softmax after it turns its inf into the module's nan)
    nan = "nan" in facts.frame.op_made if facts.frame.op_made else facts.nan
    what = "0 by 0" if nan else "by 0"
    small = (f", or by a value so small that the quotient passed {limit_text('float16')}"
             if facts.dtype == "float16" and facts.inf else "")
    return (f"{facts.where} divided {what}{facts.in_op}{facts.at_line}{evidence}{small}, e.g. a "
            "temperature that reached 0, a masked mean over a sample whose mask is all zeros, or "
            "a normalisation by a zero sum. "
            "Keep the denominator away from 0: `s / n.clamp_min(1)` for a count, `+ 1e-6` for a "
            "float.")


def _backward_node_hint(facts: Facts) -> str:
    node, where, at = facts.node, facts.where, facts.at_line
    eps = "1e-6" if facts.dtype == "float16" else "1e-12"
    if node in ("Sqrt", "Rsqrt"):
        return (f"The gradient of {node.lower()}{_paren(facts)} in {where}{at} is infinite at 0 "
                "(d sqrt(x)/dx = 1 / (2 sqrt(x)), and 0 * inf = nan), e.g. a distance between "
                f"identical inputs. Put an eps inside: `torch.sqrt(d2 + {eps})`, or use "
                "`torch.linalg.vector_norm(a - b, dim=-1)`, whose gradient at 0 is 0.")
    if node in NORM_NODES:
        instead = ("" if node == "LinalgVectorNorm" else
                   ", or `torch.linalg.vector_norm(a - b, dim=-1)`, whose gradient at 0 is 0")
        return (f"The gradient of a norm or distance{_paren(facts)} in {where}{at} divides by its "
                "value, not finite where it is 0 (identical points, a zero vector). Add an eps: "
                f"`torch.sqrt(((a - b) ** 2).sum(-1) + {eps})`{instead}.")
    if node in ("Std", "StdMean"):
        return (f"The gradient of std{_paren(facts)} in {where}{at} divides by the std, 0 here "
                f"(all values equal). Use `torch.sqrt(x.var(dim) + {eps})` instead of "
                "`x.std(dim)`.")
    if node in ("Softmax", "LogSoftmax"):  # finite outputs and gradients give finite ones
        return (f"The backward of softmax{_paren(facts)} in {where}{at} made nan from a finite "
                "gradient: a row whose scores were all -inf (fully masked) gives nan in forward, "
                "which the code hid (nan_to_num, where, masked_fill on the result) but the "
                "backward still multiplies by. Keep such rows finite before the softmax: mask with "
                "`torch.finfo(scores.dtype).min` instead of -inf, or leave each row one position "
                "unmasked.")
    if node == "Log":
        return (f"The gradient of log{_paren(facts)} in {where}{at} is 1/x, infinite at x = 0. "
                f"Clamp the argument, `torch.log(x.clamp_min(1e-7))`, or compute from logits: "
                f"{FROM_LOGITS}.")
    if node == "Div":
        below = format_number(math.sqrt(FLOAT16_SMALLEST))
        small = (f", or where b² underflows float16 (|b| below {below})"
                 if facts.dtype == "float16" else "")
        return (f"The gradient of a / b{_paren(facts)} in {where}{at} is -a / b² for b: infinite "
                f"where b is 0{small}. Keep the denominator away from 0: `b.clamp_min(eps)` or "
                "`b + eps`.")
    if node == "Pow":
        return (f"The gradient of x ** p{_paren(facts)} in {where}{at} is p x ** (p - 1), "
                "infinite at x = 0 for p < 1 (e.g. x ** 0.5). Add an eps to x first.")
    if node == "Logsumexp":
        return (f"The gradient of logsumexp{_paren(facts)} in {where}{at} is exp(x - "
                "logsumexp(x)): over a row that is all -inf (a log-space recursion's impossible "
                "state, a fully masked row) that is exp(-inf - (-inf)) = nan. Fill with a large "
                "negative finite value instead of -inf (`torch.finfo(x.dtype).min`), or leave such "
                "rows out.")
    if node in ("LinalgEigh", "Symeig", "LinalgEig", "LinalgSvd", "Svd"):
        return (f"The gradient of an eigen- or singular-value decomposition{_paren(facts)} in "
                f"{where}{at} divides by the differences between its values: repeated "
                "(degenerate) ones, such as a covariance of constant or too few samples, give "
                "inf/nan. Break the ties (`A + eps * torch.diag(torch.arange(n))`), use more "
                "samples than dimensions, or take the gradient of the values only "
                "(`torch.linalg.eigvalsh`).")
    if node == "CtcLoss":
        return _ctc_hint(facts)
    if node == "BinaryCrossEntropy" or facts.op == "binary_cross_entropy_backward":
        return _bce_hint(facts)
    if node in MATMUL_NODES and not facts.received:
        return _overflow_hint(facts, f"The gradient of {where}{facts.in_op}")
    return ""


def _paren(facts: Facts) -> str:
    """' (`SqrtBackward0`: `aten.div.Tensor`)' after a noun, or ''."""
    text = facts.frame.op
    return f" (`{text.replace(': ', '`: `')}`)" if text else ""


def _bce_hint(facts: Facts) -> str:
    where = facts.where
    if facts.dtype == "float16":
        return (f"The gradient of nn.BCELoss{_paren(facts)} in {where} divides by p (1 - p), "
                "clamped at 1e-12, which is 0 in float16 (its smallest value is "
                f"{format_number(FLOAT16_SMALLEST)}): once a prediction rounds to exactly 1 or 0 "
                "it divides by 0. Drop the final Sigmoid and use `nn.BCEWithLogitsLoss` on the "
                "logits, or compute the loss in float32 (`loss_fn(p.float(), y.float())`).")
    return (f"The gradient of binary cross-entropy{_paren(facts)} in {where} divides by "
            "p (1 - p), 0 where a prediction is exactly 0 or 1. Drop the final Sigmoid and use "
            "`nn.BCEWithLogitsLoss` on the logits.")


# ---- the code outside the guarded modules ------------------------------------------------------
def _outside_hint(facts: Facts) -> str:
    """A torch function of the loss (forward) or an autograd node it created (backward): the
    op's own hint, as for a module's code, else the general one."""
    specific = _forward_op_hint(facts) if facts.forward else _backward_node_hint(facts)
    if not specific and facts.inf and not facts.nan:  # a loss of outputs grown without bound
        specific = _diverged_hint(facts, f"`{facts.frame.op}` in {facts.where}")
    return specific or _general_hint(facts)


# ---- a module's own code: without a named op ---------------------------------------------------
def _first_of_its_pass(facts: Facts) -> bool:
    """Whether no frame of the culprit's forward pass closed before it (in the report)."""
    frame = facts.frame
    before = next((facts.report.frames[:index] for index, f in enumerate(facts.report.frames)
                   if f is frame), None)
    return before is not None and not any(
        f.batch_number == frame.batch_number and f.phase == FORWARD for f in before)


def _received_hint(facts: Facts) -> str:
    received = facts.received
    kinds = kinds_of(received)
    first = facts.forward and _first_of_its_pass(facts)
    origin = (" It is the first module of the batch to finish, so the value came with the data: "
              "check the batch with `torch.isinf(x).any()`; log(0) in the preprocessing (a "
              "zero-width box, a zero count) is a common source of -inf." if first else
              " Look at the frames before it for where that value was made.")
    return (f"{facts.where} was given {kinds} ({roles_of(received)}) and turned it into "
            f"{facts.found} (-inf times a negative weight is +inf, inf - inf is nan): the "
            f"non-finite value was made before this call.{origin}")


def _module_class_hint(facts: Facts) -> str:
    module_class = facts.frame.module_class
    if module_class in RECURRENT_MODULES and not facts.forward:
        return _exploding_recurrence_hint(facts)
    if module_class not in MATMUL_MODULES or facts.received:
        return ""
    # transformers' Conv1D is a linear layer
    noun = "convolution" if module_class.startswith("Conv") and module_class != "Conv1D" \
        else "matmul"
    if facts.forward:
        return _overflow_hint(facts, f"The {noun} of {facts.where}")
    return _overflow_hint(facts, f"The gradient of {facts.where}")


def _exploding_recurrence_hint(facts: Facts) -> str:
    """Backpropagation through time: a gradient multiplied by the recurrent weights at every
    step grows geometrically where their largest singular value is above 1."""
    return (f"The backward through time of {facts.where}{facts.in_op} made {facts.found} from a "
            "finite incoming gradient: exploding gradients, the gradient multiplied by the "
            "recurrent weights (weight_hh) once per step, growing geometrically where their "
            f"largest singular value is above 1. Clip the gradient norm before each step (`{CLIP}`), "
            "initialise weight_hh orthogonal (`nn.init.orthogonal_`) or smaller, and backpropagate "
            "through fewer steps (truncated BPTT: `.detach()` the hidden state every 64-128 "
            "steps).")


def _general_hint(facts: Facts) -> str:
    where, found = facts.where, facts.found
    limit = limit_text(facts.dtype)
    past = f" past {limit}" if limit else ""
    reached = facts.reached()
    given = f" ({reached})" if reached else ""
    fill = next((row for row in facts.rows_of(INPUT) if row.abs_max in MASK_FILLS), None)
    if facts.forward and facts.inf and fill is not None:  # (a mask's fill, summed)
        return (f"{where} made {found}{facts.in_op}{facts.at_line} from {fill.role}, which holds "
                f"a mask's fill, {format_number(fill.abs_max)} (`torch.finfo(dtype).min`): two "
                f"of them summed pass {limit}. Fill the mask with a large negative finite value "
                "(-1e4: its probability is 0 all the same), or leave the masked entries out of "
                "the loss (label_smoothing sums every class).")
    if not facts.forward:
        return (f"The backward of {where} made {found}{facts.in_op}{facts.at_line} from a "
                f"finite incoming gradient{given}: an op whose derivative is infinite at its "
                "input, e.g. sqrt, norm or std at 0, log or 1/x at 0, x ** p with p < 1 at 0, "
                f"acos/asin at ±1, or an overflow{past}. Add an eps where that op's input can "
                f"reach that point.{facts.sources()}")
    origins = []
    if facts.nan:
        origins.append("nan from finite values comes from 0/0, inf - inf, 0 * inf or sqrt/log of "
                       "a negative value")
    if facts.inf:
        origins.append(f"inf from x/0, log(0), an overflow{past} or a constant such as a -inf "
                       "mask")
    written = [row.role[:-len(WRITTEN_IN_FORWARD)] for row in facts.flagged
               if row.role.endswith(WRITTEN_IN_FORWARD)]
    into = (f" and wrote it into {', '.join(written)}, {'a buffer' if len(written) == 1 else 'buffers'}"
            " its forward updates in place (an EMA of statistics, a codebook: a division by a count"
            " that can be 0, such as a code no input chose, makes nan)" if written else "")
    text = (f"{where} made {found}{facts.in_op}{facts.at_line} from finite inputs and weights"
            f"{given}{into}. {'; '.join(origins) or 'An overflow'}: check that computation's "
            "operands for zeros, negatives and large values (`t.abs().max()`).")
    if facts.inf and not facts.nan and facts.report.reason.endswith(MASK_REACHED_LOSS):
        text += (" Here the -inf reached the loss and made it non-finite: a loss that takes every "
                 "class (cross_entropy with label_smoothing, a KL or entropy term) takes the "
                 "masked ones too. Fill the mask with a large negative finite value (-1e4: its "
                 "probability is 0 all the same; `torch.finfo(dtype).min` overflows once a loss "
                 "sums it), or leave the masked classes out of the loss.")
    elif facts.inf and not facts.nan:
        allowed = f'["{facts.frame.module_name}"]' if facts.frame.module_name else "True"
        text += (" If the inf is a mask on purpose, allow it: "
                 f"`Guard(model, allow_inf={allowed})`.")
    return text + facts.sources()


# ---- the one entry point -----------------------------------------------------------------------
def hint_for(report: Report) -> str:
    """Why the report's culprit produced its inf/nan and what to try, in a sentence or two with
    the numbers; '' for a report without a culprit."""
    if report.first_nonfinite is None:
        return ""
    facts = facts_of(report)
    cause = report.cause
    if cause == CAUSE_WEIGHTS:
        return _weights_hint(facts)
    if cause == CAUSE_DATA:
        return _data_hint(facts)
    if cause == CAUSE_LOSS_GRADIENT:
        return _loss_gradient_hint(facts)
    if cause == CAUSE_OUTSIDE:
        return _outside_hint(facts)
    if cause == CAUSE_UNATTRIBUTED or cause not in CODE_CAUSES:
        return _unattributed_hint(facts)
    specific = _forward_op_hint(facts) if facts.forward else _backward_node_hint(facts)
    if not specific and facts.received:
        specific = _received_hint(facts)
    return specific or _module_class_hint(facts) or _general_hint(facts)
