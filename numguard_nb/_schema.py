"""The vocabulary shared by the engine, the report and the views: one definition of each word.

Plain string constants (they travel in reports, DataFrames, pickles and bundles), grouped by
what they name. Each group has its own word: a row's *category*, a value's *value kind*, a
frame's *phase*, a report's *report kind*, a detection's *cause*, a problem's *problem kind*.
"""

from __future__ import annotations

# ---- phases: when a frame's values were seen -------------------------------------------------
FORWARD = "forward"
BACKWARD = "backward"

# ---- row categories: what a tensor is to the module call it belongs to ----------------------
PARAM = "param"
BUFFER = "buffer"  # floating-point buffers: running statistics, stored masks
INPUT = "input"
OUTPUT = "output"
GRAD_OUTPUT = "grad_output"
GRAD_INPUT = "grad_input"
GRAD_PARAM = "grad_param"
GRADIENT_CATEGORIES = frozenset((GRAD_OUTPUT, GRAD_INPUT, GRAD_PARAM))
# The role of a buffer as a call's forward left it, after changing it in place (an output row):
# "embed (after forward)".
WRITTEN_IN_FORWARD = " (after forward)"

# ---- value kinds: what a row's value is (TensorRow.kind) ------------------------------------
VALUE_TENSOR = "tensor"
VALUE_NONE = "none"
VALUE_OTHER = "not a tensor"
VALUE_EMPTY = "empty"
VALUE_UNSUPPORTED = "unsupported"  # a tensor whose numbers cannot be read (meta, fake, ...)

# ---- report kinds: why a report was made (Report.kind) ---------------------------------------
DETECTION = "detection"  # a non-finite value was produced (or predicted) and the run stopped
TRACE = "trace"  # every frame of a traced batch
LATEST = "latest"  # the last frames seen, nothing wrong found

# ---- causes: who made the first non-finite value (Report.cause) ------------------------------
CAUSE_FORWARD = "forward"  # a module's forward
CAUSE_BACKWARD = "backward"  # a module's backward
CAUSE_BACKWARD_INLINE = "backward-inline"  # a module's own code between its submodules, in backward
CAUSE_FORWARD_INLINE = "forward-inline"  # a module's own code between its submodules, in forward
CAUSE_WEIGHTS = "weights"  # parameters or floating buffers already non-finite
CAUSE_DATA = "data"  # the values fed to the model
CAUSE_LOSS_GRADIENT = "loss-gradient"  # the gradient entering the model from outside
CAUSE_UNATTRIBUTED = "unattributed"  # a nan no rule could attribute
CAUSES = (CAUSE_FORWARD, CAUSE_FORWARD_INLINE, CAUSE_BACKWARD, CAUSE_BACKWARD_INLINE, CAUSE_WEIGHTS,
          CAUSE_DATA, CAUSE_LOSS_GRADIENT, CAUSE_UNATTRIBUTED)
# causes that name a module's own code, where op localisation can look for the op
CODE_CAUSES = frozenset((CAUSE_FORWARD, CAUSE_FORWARD_INLINE, CAUSE_BACKWARD, CAUSE_BACKWARD_INLINE))
FORWARD_CAUSES = frozenset((CAUSE_FORWARD, CAUSE_FORWARD_INLINE))  # op localisation re-runs a forward

# ---- problem kinds: what is wrong with one value ---------------------------------------------
PROBLEM_NAN = "nan"
PROBLEM_POSINF = "+inf"
PROBLEM_NEGINF = "-inf"
PROBLEM_OVERFLOW = "overflow"  # finite, but beyond limit_dtype's largest value
PROBLEM_UNDERFLOW = "underflow"  # non-zero, but below limit_dtype's smallest value: would be 0

# ---- weights origins: how weights found non-finite got that way (Report.weights_origin) -------
ORIGIN_OPTIMIZER_STEP = "optimizer step"  # a step the guard saw since the forward before wrote them
ORIGIN_OUTSIDE_FORWARD = "outside the forward"  # no step since a forward that found them finite
ORIGIN_SINCE_ATTACH = "since attach"  # no step, no forward since an attach that found them finite
ORIGIN_BEFORE_ATTACH = "before attach"  # non-finite in the guard's first forward of the model
# buffers: finite when the forward before began; written since, by that forward or code after it
ORIGIN_SINCE_FORWARD = "since the forward before"

# ---- history cells: what a module's cell of the numerics history holds (codes in int8 arrays) --
CELL_VALUE = 0  # a finite abs max (zero included)
CELL_MISSING = 1  # nothing of the module was recorded in that sampled batch
CELL_NAN = 2
CELL_INF = 3

# ---- causes a sentinel's re-run adds (mode="sentinel") ----------------------------------------
CAUSE_TRANSIENT = "transient"  # non-finite once, finite when the same call was run again
CAUSE_COMPILED = "compiled-code"  # non-finite when run compiled, finite when run eagerly
CAUSE_STALE_GRADIENTS = "stale-gradients"  # a .grad non-finite before the guard attached, added to
CAUSE_OTHER_RANK = "other-rank"  # made on another rank, received through the gradient all-reduce

# ---- guard modes: how much a Guard watches (GuardOptions.mode) -------------------------------
MODE_FULL = "full"  # hooks on every module call, forward and backward
MODE_SENTINEL = "sentinel"  # cheap checks per step; the full hooks only to re-run a failing call
MODES = (MODE_FULL, MODE_SENTINEL)

# ---- what the loop ran when the values were made (Report.stage), unless its caller said -------
STAGE_EVALUATION = "an evaluation (the model was in eval mode)"  # a Trainer's evaluate(), say

# The end of a detection's reason where a model's -inf mask made its loss non-finite
MASK_REACHED_LOSS = "and the -inf reaches the model's output"

# ---- who found a detection (Report.found_by) -------------------------------------------------
FOUND_BY_HOOKS = ""  # the full guard's hooks, as the values were made
FOUND_BY_RERUN = "re-run"  # a sentinel's re-run of the failing call with the full guard

# ---- code outside the guarded modules (a loss in the training loop) ------------------------
CAUSE_OUTSIDE = "outside"  # code outside the guarded modules, or an autograd node it created
CAUSES = CAUSES + (CAUSE_OUTSIDE,)
OUTSIDE_MODULE = "<outside>"  # the module name of that code's frames

# ---- ops and modules, by what goes wrong in them (the hints' and the rules' vocabulary) --------
# ATen ops (without "aten.", the overload and an in-place "_") by what goes wrong in them.
MATMUL_OPS = frozenset((
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "matmul", "linear", "addmv", "mv", "dot", "einsum",
    "convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "mkldnn_convolution", "cudnn_convolution", "convolution_overrideable",
))
EXP_OPS = frozenset(("exp", "exp2", "expm1", "sinh", "cosh"))
# From finite inputs these make inf (and nan further on) only by overflowing.
ARITHMETIC_OPS = MATMUL_OPS | EXP_OPS | frozenset((
    "mul", "add", "sub", "pow", "square", "sum", "mean", "cumsum", "prod", "addcmul", "var",
    "linalg_vector_norm", "norm",
))
DIVISION_OPS = frozenset(("div", "reciprocal", "true_divide", "remainder", "fmod", "addcdiv"))
LOG_OPS = frozenset(("log", "log2", "log10", "log1p", "xlogy"))
CTC_OPS = frozenset(("ctc_loss",))  # aten._ctc_loss, aten.ctc_loss
SOFTMAX_OPS = frozenset(("softmax", "safe_softmax", "log_softmax"))
NLL_OPS = frozenset(("nll_loss_forward", "nll_loss", "nll_loss2d_forward", "nll_loss_nd",
                     "cross_entropy_loss"))
# Modules whose forward is one matmul or convolution: a non-finite output from finite inputs
# and weights is an overflow.
MATMUL_MODULES = frozenset((
    "Linear", "LazyLinear", "NonDynamicallyQuantizableLinear", "Bilinear", "Conv1D", "Conv1d",
    "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "LazyConv1d",
    "LazyConv2d", "LazyConv3d", "Linear8bitLt", "Linear4bit", "ColumnParallelLinear",
    "RowParallelLinear",
))
# Recurrent modules: their backward multiplies by the recurrent weights once per time step.
RECURRENT_MODULES = frozenset(("RNN", "LSTM", "GRU", "RNNCell", "LSTMCell", "GRUCell"))
# Autograd nodes (names without "Backward<n>"): a matmul's gradient overflows; a norm's or a
# distance's is not finite at 0.
MATMUL_NODES = frozenset(("Mm", "Bmm", "Addmm", "Addbmm", "Baddbmm", "Convolution", "Linear",
                          "Mv", "Addmv", "Dot", "Matmul"))
NORM_NODES = frozenset(("Norm", "LinalgVectorNorm", "Cdist", "Dist"))
