"""The CPU replay of the code outside the guarded modules: a loss computed in the loop with a bad
label, after a (simulated) asynchronous device error, is replayed to its real exception and line.

On a GPU, `F.cross_entropy` with a label past the number of classes does not raise where it is
called: its kernel's assert is reported later, at `loss.backward()` or the next synchronisation,
as "CUDA error: device-side assert triggered". `SimulatedGPU` does the same on CPU: entered
before the guard (as the CUDA runtime is), it lets the call go on with a clamped label and
reports the error at `sync()`. The replay runs the real CPU code on the captured values.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from numguard_nb import Guard
from numguard_nb.replay import load_capture, replay_after_error
from numguard_nb.replay import outside as replay_outside

DEVICE_ERROR = "CUDA error: device-side assert triggered"


class SimulatedGPU(TorchFunctionMode):
    """Index errors of the loss code reported late, as a GPU reports its kernels' asserts, for
    tensors `on_gpu` marked as on the simulated GPU (the replay's host copies are not)."""

    def __init__(self):
        super().__init__()
        self.pending = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.cross_entropy, F.nll_loss) and getattr(args[1], "on_gpu", False):
            logits, target = args[0], args[1]
            if bool(((target < 0) | (target >= logits.shape[-1])).any()):
                self.pending.append(DEVICE_ERROR)
                args = (logits, target.clamp(0, logits.shape[-1] - 1)) + tuple(args[2:])
        if func is torch.Tensor.gather and getattr(args[2], "on_gpu", False):
            source, dim, index = args[0], args[1], args[2]
            if bool((index >= source.shape[dim]).any()):
                self.pending.append(DEVICE_ERROR)
                args = (source, dim, index.clamp(max=source.shape[dim] - 1))
        return func(*args, **kwargs)

    def sync(self):
        """`loss.item()` on a GPU: where the asynchronous error is reported."""
        if self.pending:
            raise RuntimeError(self.pending.pop())


def classifier():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def on_gpu(t: torch.Tensor) -> torch.Tensor:
    t.on_gpu = True
    return t


X = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
GOOD = on_gpu(torch.tensor([0, 1, 2, 0, 1, 2]))
BAD = on_gpu(torch.tensor([0, 1, 7, 0, 1, 2]))  # label 7 of 3 classes


def train(model, guard, steps, loss_of, late=False):
    """Run `steps` (label tensors) under a simulated GPU; the device error it raises."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gpu = SimulatedGPU()
    with pytest.raises(RuntimeError, match=DEVICE_ERROR) as caught, gpu, guard:
        for labels in steps:
            logits = model(X)
            loss = loss_of(logits, labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if not late:
                gpu.sync()
        gpu.sync()
    return caught.value


def cross_entropy_inline(logits, labels):
    return F.cross_entropy(logits, labels)  # the line the replay must name


LOSS_LINE = "return F.cross_entropy(logits, labels)  # the line the replay must name"


def test_a_bad_label_in_an_inline_cross_entropy_replays_to_its_index_error_and_line(tmp_path):
    model = classifier()
    guard = Guard(model, capture=True)
    error = train(model, guard, (GOOD, GOOD, BAD), cross_entropy_inline)
    outcome = replay_after_error(guard, error, save_dir=tmp_path)
    result = outcome.result
    assert isinstance(result.exception, IndexError) and "Target 7 is out of bounds" in str(result.exception)
    assert result.function.name == "torch.nn.functional.cross_entropy"
    assert result.location.filename == __file__ and result.location.line == LOSS_LINE
    text = repr(outcome)
    # the real exception and line first, then the original error, then the bundle
    assert text.index("IndexError: Target 7") < text.index(LOSS_LINE) < text.index(DEVICE_ERROR) \
        < text.index("Replay bundle")
    assert "raised in torch.nn.functional.cross_entropy, run outside the guarded modules" in text


def test_an_error_reported_one_step_late_replays_the_step_that_made_it(tmp_path):
    model = classifier()
    guard = Guard(model, capture=True)
    error = train(model, guard, (GOOD, BAD, GOOD), cross_entropy_inline, late=True)
    outcome = replay_after_error(guard, error, save_dir=tmp_path)
    assert isinstance(outcome.result.exception, IndexError)
    assert outcome.result.call.index == 1  # the second step's call, not the latest
    assert any("reported one call late" in note for note in outcome.searched)


@pytest.mark.parametrize("loss_of, message", [
    (lambda logits, labels: -F.log_softmax(logits, -1).gather(1, on_gpu(labels[:, None])).mean(),
     "index 7 is out of bounds"),
    (lambda logits, labels: F.nll_loss(F.log_softmax(logits.float(), dim=-1), labels), "Target 7 is out of bounds"),
])
def test_gather_and_nll_loss_after_other_functions_replay_to_their_errors(tmp_path, loss_of, message):
    model = classifier()
    guard = Guard(model, capture=True)
    error = train(model, guard, (GOOD, BAD), loss_of)
    result = replay_after_error(guard, error, save_dir=tmp_path).result
    assert result.exception is not None and message in str(result.exception), result
    assert result.location.filename == __file__


def test_an_embedding_index_error_inside_the_model_still_replays_in_the_model(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 3))
    guard = Guard(model, capture=True)
    ids = torch.tensor([[1, 2], [3, 4]])
    with guard:
        F.cross_entropy(model(ids), torch.tensor([0, 1])).backward()
        bad = ids.clone()
        bad[1, 1] = 12  # past the vocabulary
        with pytest.raises(IndexError):
            model(bad)
    result = replay_after_error(guard, RuntimeError(DEVICE_ERROR), save_dir=tmp_path).result
    assert isinstance(result.exception, IndexError) and result.function is None
    assert result.module == "0 (Embedding)"


def test_a_clean_replay_names_the_last_recorded_function(tmp_path):
    model = classifier()
    guard = Guard(model, capture=True)
    with guard:
        F.cross_entropy(model(X), GOOD).backward()
    outcome = replay_after_error(guard, RuntimeError(DEVICE_ERROR), save_dir=tmp_path)
    assert outcome.result.exception is None
    text = repr(outcome)
    assert ("torch functions recorded after it ran clean too, the last "
            "torch.nn.functional.cross_entropy at") in text
    assert "the problem is beyond what was recorded" in text


def test_the_bundle_replays_the_loss_code_in_a_fresh_process(tmp_path):
    model = classifier()
    guard = Guard(model, capture=True)
    error = train(model, guard, (GOOD, BAD), cross_entropy_inline)
    path = replay_after_error(guard, error, save_dir=tmp_path).path
    script = (
        "import torch\nfrom torch import nn\nfrom numguard_nb.replay import load_capture\n"
        "model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))\n"
        f"result = load_capture({path!r}, model).replay()\n"
        "print(type(result.exception).__name__, result.function.name)\n"
        "print(result.location.line)\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["IndexError torch.nn.functional.cross_entropy", LOSS_LINE]


def test_what_is_recorded_stays_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(replay_outside, "MAX_RECORDS", 3)
    model = classifier()
    guard = Guard(model, capture=True)
    with guard:
        for _ in range(3):
            out = model(X)
            loss = (out * 2).sum() + out.mean() + out.abs().sum()  # 5 functions
            loss.backward()
    calls = guard._capture.calls
    assert len(calls) == 2  # the last two steps only
    assert all(len(call.outside) == 3 and "only the first 3 functions" in call.outside_full for call in calls)


class _Reads:
    """Counts host reads of tensor values (item, tolist, bool, numpy, a copy to the host) made
    by the capture's own code."""

    def __init__(self, monkeypatch):
        self.count = 0
        replay_dir = os.path.dirname(replay_outside.__file__)
        for name in ("item", "tolist", "__bool__", "numpy", "cpu"):
            real = getattr(torch.Tensor, name)

            def counted(self_, *args, _real=real, **kwargs):
                frame = sys._getframe(1)
                if frame.f_code.co_filename.startswith(replay_dir):
                    self.count += 1
                return _real(self_, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_the_capture_of_the_loss_code_reads_no_value_back(monkeypatch):
    model = classifier()
    guard = Guard(model, capture=True)
    reads = _Reads(monkeypatch)
    with guard:
        for labels in (GOOD, GOOD):
            logits = model(X)
            weights = torch.tensor([1.0, 2.0, 1.0])
            loss = F.cross_entropy(logits, labels, weight=weights) + logits.gather(1, labels[:, None]).mean()
            loss.backward()
    assert len(guard._capture.latest.outside) >= 4
    assert reads.count == 0


def test_a_numguard_cell_with_the_loss_inline_replays_to_the_cells_line(shell, tmp_path, monkeypatch):
    from IPython.utils.capture import capture_output

    monkeypatch.chdir(tmp_path)  # where the magic writes the bundle
    shell.user_ns.update(SimulatedGPU=SimulatedGPU, classifier=classifier, X=X, GOOD=GOOD, BAD=BAD)
    assert shell.run_cell("import torch\nimport torch.nn.functional as F\nmodel = classifier()\n"
                          "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                          "gpu = SimulatedGPU()\ngpu.__enter__()\n").success
    try:
        cell_number = shell.execution_count
        with capture_output() as shown:
            result = shell.run_cell(
                "%%numguard --capture model\n"
                "for labels in (GOOD, GOOD, BAD):\n"
                "    logits = model(X)\n"
                "    loss = F.cross_entropy(logits, labels)\n"
                "    loss.backward()\n"
                "    opt.step(); opt.zero_grad()\n"
                "    gpu.sync()\n", store_history=True)
    finally:
        shell.user_ns["gpu"].__exit__(None, None, None)
    assert isinstance(result.error_in_exec, RuntimeError)
    outcome = shell.user_ns["_numguard_replay"]
    assert isinstance(outcome.result.exception, IndexError)
    assert outcome.result.location.where == f"Cell In[{cell_number}], line 4"
    text = "".join(out.data.get("text/plain", "") for out in shown.outputs)
    assert f"in the call made at Cell In[{cell_number}], line 4" in text
    assert "loss = F.cross_entropy(logits, labels)" in text


def loss_with_plain_values(logits, labels):
    # What loss code passes besides tensors: a numpy scalar (a temperature from a config), a
    # memory format, a device
    logits = logits.contiguous(memory_format=torch.contiguous_format).to(torch.device("cpu"))
    return F.cross_entropy(logits / np.float32(2.0), labels)


def test_a_bundle_keeps_loss_code_that_passes_numpy_scalars_formats_and_devices(tmp_path):
    model = classifier()
    guard = Guard(model, capture=True)
    error = train(model, guard, (GOOD, BAD), loss_with_plain_values)
    path = replay_after_error(guard, error, save_dir=tmp_path).path
    result = load_capture(path, classifier()).replay()
    assert isinstance(result.exception, IndexError)
    assert result.location.line == "return F.cross_entropy(logits / np.float32(2.0), labels)"


def loss_with_seeded_noise(logits, labels):
    noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))  # a Generator
    return F.cross_entropy(logits + 0 * noise, labels)


def test_a_bundle_that_cannot_hold_the_loss_code_says_so_when_it_replays_clean(tmp_path):
    model = classifier()
    guard = Guard(model, capture=True)
    error = train(model, guard, (GOOD, BAD), loss_with_seeded_noise)
    path = replay_after_error(guard, error, save_dir=tmp_path).path
    text = repr(load_capture(path, classifier()).replay())
    assert "recorded in part: the bundle holds the functions before torch.randn at" in text
    assert "is a Generator, which a bundle cannot hold" in text
