"""CPU replay of captured calls: the real exception and line, bundles, the device-error path."""

import inspect
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import models as M
from models import line_of
from numguard_nb import Guard
from numguard_nb.replay import (
    Capture,
    CapturedCall,
    ReplayError,
    ReplayOutcome,
    is_device_error,
    load_capture,
    replay_after_error,
)

TESTS = Path(__file__).resolve().parent
REPO_ROOT = TESTS.parent
MODELS_FILE = str(TESTS / "models.py")


def bad_batch():
    """A batch for the course's example: labels 0..2 against a 2-logit head."""
    torch.manual_seed(0)
    return torch.randn(6, 8), torch.tensor([0, 1, 2, 0, 1, 2])


def good_labels():
    return torch.tensor([0, 1, 1, 0, 1, 0])


def subprocess_env():
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), str(TESTS), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


def guarded_loss_step(model, loss_fn, x, labels):
    guard = Guard({"model": model, "loss_fn": loss_fn}, capture=True)
    with pytest.raises(IndexError):
        with guard:
            M.train_step(model, loss_fn, x, labels)
    return guard


# ---- the real exception, at the real line -------------------------------------------------
def test_loss_module_replays_to_index_error_at_the_line_that_called_it():
    x, labels = bad_batch()
    model, loss_fn = M.Classifier(), nn.CrossEntropyLoss()
    guard = guarded_loss_step(model, loss_fn, x, labels)

    call = guard.capture  # still there after the with block
    assert isinstance(call, CapturedCall) and call.root_name == "loss_fn"
    assert [c.root_name for c in call.chain()] == ["model", "loss_fn"]
    result = call.replay()
    assert isinstance(result.exception, IndexError)
    assert "out of bounds" in str(result.exception)
    # nn.CrossEntropyLoss raises inside torch: the location is the user's line that called it.
    assert result.location.filename == MODELS_FILE
    assert result.location.lineno == line_of("loss call line")
    assert result.location.kind == "call site"
    assert "loss_fn(logits, labels)" in result.location.line
    assert result.module == "loss_fn (CrossEntropyLoss)"
    # The loss was fed the replayed model output, its labels from the captured copy.
    assert "input[0] from the replayed model output" in result.replayed
    assert "input[1] from its captured copy" in result.replayed
    assert "IndexError: Target 2 is out of bounds" in result.traceback
    assert "numguard_nb/replay/" not in result.traceback
    text = repr(result)
    assert "IndexError" in text and f"models.py:{line_of('loss call line')}" in text


def test_model_computing_its_own_loss_replays_to_the_line_in_its_forward():
    x, labels = bad_batch()
    model = M.ClassifierWithLoss()
    with pytest.raises(IndexError):
        with Guard(model, capture=True) as guard:
            M.hf_step(model, x, labels)
    result = guard.capture.replay()
    assert isinstance(result.exception, IndexError)
    assert (result.location.filename, result.location.lineno) == (MODELS_FILE, line_of("model loss line"))
    assert result.location.kind == "raised"
    assert "F.cross_entropy(logits, labels)" in result.location.line
    # The call site is the user's line that called the model.
    assert result.call_site.lineno == line_of("hf call line")


def test_hugging_face_model_replays_to_its_loss_line(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, num_labels=2,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    ids = torch.randint(0, 50, (3, 10))
    with pytest.raises(IndexError):
        with Guard(model, capture=True) as guard:
            model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([0, 1, 2]))
    result = guard.capture.replay()
    assert isinstance(result.exception, IndexError)
    source, start = inspect.getsourcelines(transformers.BertForSequenceClassification.forward)
    expected = [start + i for i, line in enumerate(source) if "loss = loss_fct(logits.view(-1, self.num_labels)" in line]
    assert result.location.filename == inspect.getsourcefile(transformers.BertForSequenceClassification)
    assert result.location.lineno in expected


def test_clean_call_replays_clean_with_the_same_output_and_leaves_the_model_alone():
    x, _ = bad_batch()
    model = M.Classifier()
    params_before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    with Guard(model, capture=True) as guard:
        out = model(x)
        out.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    result = guard.capture.replay()
    assert result.ok and result.exception is None and result.location is None
    assert torch.equal(result.output, out)
    assert result.output.device.type == "cpu"
    assert "ran clean" in repr(result)
    for name, param in model.named_parameters():  # same objects, values and gradients
        assert param is params_before[name][0]
        assert torch.equal(param, params_before[name][1])
        assert torch.equal(param.grad, grads[name])
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_dropout_replays_with_the_same_mask():
    x, _ = bad_batch()
    model = M.Classifier(dropout=0.5).train()
    with Guard(model, capture=True) as guard:
        out = model(x)
    again = model(x)  # a different mask: the test can tell masks apart
    assert not torch.equal(again, out)
    result = guard.capture.replay()
    assert torch.equal(result.output, out)
    rng = torch.get_rng_state()
    guard.capture.replay()
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG state is restored


def test_replay_while_the_guard_is_attached_runs_none_of_its_hooks():
    x, _ = bad_batch()
    model = M.Classifier()
    with Guard(model, capture=True) as guard:
        out = model(x)
        first = guard.capture
        result = first.replay()
        assert guard.capture is first  # the replay copy is not guarded: nothing recorded
        assert result.ok and torch.equal(result.output, out)
        assert guard.batch_number == 0


def test_keeps_the_last_two_calls_of_each_module():
    x, _ = bad_batch()
    model, loss_fn = M.Classifier(), nn.CrossEntropyLoss()
    with Guard({"model": model, "loss_fn": loss_fn}, capture=True) as guard:
        for _ in range(3):
            M.train_step(model, loss_fn, x, good_labels())
    calls = guard._capture.calls
    assert [(c.index, c.root_name) for c in calls] == [(2, "model"), (3, "loss_fn"), (4, "model"), (5, "loss_fn")]
    assert guard.capture is calls[-1]


def test_weights_changed_by_an_optimizer_step_are_reported():
    x, _ = bad_batch()
    model, loss_fn = M.Classifier(), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Guard({"model": model, "loss_fn": loss_fn}, capture=True) as guard:
        for _ in range(2):
            M.train_step(model, loss_fn, x, good_labels())
            optimizer.step()
    model_calls = [c for c in guard._capture.calls if c.root_name == "model"]
    assert [c.weights_changed for c in model_calls] == [False, True]
    result = model_calls[-1].replay()
    assert any("weights of model changed" in note for note in result.notes)


# ---- half precision -------------------------------------------------------------------------
def test_float16_model_replays_in_float16_when_cpu_can():
    x, _ = bad_batch()
    model = M.Classifier().half()
    with Guard(model, capture=True) as guard:
        out = model(x.half())
    result = guard.capture.replay()
    assert result.ok and not result.upcast
    assert result.output.dtype == torch.float16 and torch.equal(result.output, out)


def test_float16_call_without_a_cpu_kernel_is_replayed_upcast():
    x, _ = bad_batch()
    model = M.Prototypes().half()  # torch.cdist: a GPU has it in float16, a CPU does not
    with pytest.raises(NotImplementedError):
        with Guard(model, capture=True) as guard:
            model(x.half())
    result = guard.capture.replay()
    assert result.ok and result.upcast
    assert result.output.dtype == torch.float32
    assert "upcast to float32" in result.notes[0] and "cdist" in result.notes[0]
    expected = -torch.cdist(x.half().float(), model.protos.detach().float())
    assert torch.allclose(result.output, expected)


# ---- bundles ----------------------------------------------------------------------------------
def test_bundle_round_trips_through_a_file_in_a_fresh_process(tmp_path):
    x, labels = bad_batch()
    model, loss_fn = M.Classifier(hidden=12), nn.CrossEntropyLoss()
    guard = guarded_loss_step(model, loss_fn, x, labels)
    path = guard.capture.save(tmp_path / "bundle.pt")
    script = textwrap.dedent(f"""
        import json, torch
        import models as M
        from numguard_nb.replay import load_capture
        call = load_capture({str(path)!r}, M.Classifier(hidden=12))  # fresh weights: replaced
        result = call.replay()
        loc = result.location
        print(json.dumps({{"error": type(result.exception).__name__, "file": loc.filename,
                          "line": loc.lineno, "replayed": result.replayed}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["error"] == "IndexError"
    assert (report["file"], report["line"]) == (MODELS_FILE, line_of("loss call line"))
    assert "from the replayed model output" in report["replayed"]


def test_bundle_replays_the_snapshot_weights_not_the_fresh_model(tmp_path):
    x, _ = bad_batch()
    model = M.Classifier(dropout=0.5)
    with Guard(model, capture=True) as guard:
        out = model(x)
    path = guard.capture.save(tmp_path / "clean.pt")
    bundle = torch.load(path, weights_only=True)
    assert bundle["format"] == "numguard_nb.replay" and bundle["torch_version"] == torch.__version__
    assert bundle["models"][""]["dtypes"] == {"float32": 4}
    fresh = M.Classifier(dropout=0.5)
    result = load_capture(path, fresh).replay()
    assert result.ok and torch.equal(result.output, out)
    assert not torch.equal(fresh(x), out)


def test_a_bundle_in_the_format_1_layout_loads_and_replays(tmp_path):
    """The layout bundles have had since format 1, written out key by key: later writers may
    add keys, but a bundle like this one must keep loading (its RNG state and autocast too)."""
    torch.manual_seed(0)
    model, x = M.Classifier(dropout=0.5).train(), torch.randn(6, 8)
    rng = torch.get_rng_state()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    tensors = {n: t.detach().clone() for n, t in model.state_dict().items()}
    bundle = {
        "format": "numguard_nb.replay", "format_version": 1, "torch_version": str(torch.__version__),
        "numguard_version": "0.1.0", "created": "2025-01-01T00:00:00", "roots": [""],
        "models": {"": {
            "class": "models.Classifier", "tensors": tensors,
            "kinds": {n: "param" for n in tensors}, "requires_grad": {n: True for n in tensors},
            "devices": ["cpu"], "dtypes": {"float32": 4}, "settings": {},
        }},
        "calls": [{
            "root": "", "module_class": "Classifier", "index": 0, "args": (x,), "kwargs": {},
            "cpu_rng_state": rng, "cuda_rng_state": None, "cuda_device": None,
            "grad_enabled": True, "training": True, "autocast": {"cpu": [True, "bfloat16"]},
            "weights_changed": False, "input_devices": ["cpu"], "input_dtypes": ["float32"],
            "call_site": {"filename": MODELS_FILE, "lineno": line_of("loss call line"),
                          "function": "train_step", "line": "loss = loss_fn(logits, labels)"},
        }],
        "target": 0,
    }
    path = tmp_path / "format1.pt"
    torch.save(bundle, path)
    call = load_capture(path, M.Classifier(dropout=0.5))
    assert call.cpu_rng_state is not None and call.autocast == {"cpu": (True, "bfloat16")}
    assert call.call_site.lineno == line_of("loss call line")
    result = call.replay()
    assert result.ok and result.output.dtype == torch.bfloat16  # under the call's autocast
    assert torch.equal(result.output, out)  # the same dropout mask: the call's RNG state


def test_record_uses_the_call_state_it_is_given_else_takes_one():
    from numguard_nb import rerun

    torch.manual_seed(0)
    model, x = M.Classifier(dropout=0.5).train(), torch.randn(6, 8)
    capture = Capture(model)
    state = rerun.take()  # the guard takes it once, before the call
    out = model(x)
    call = capture.record("", model, (x,), {}, state=state)  # after the call drew its mask
    assert call.state is state
    assert torch.equal(call.replay().output, out)

    rng = torch.get_rng_state()
    call = capture.record("", model, (x,), {})
    assert torch.equal(call.cpu_rng_state, rng) and call.grad_enabled
    assert torch.equal(call.replay().output, model(x))


def test_a_bundle_holding_a_pickled_object_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "evil.pt"
    torch.save({"format": "numguard_nb.replay", "format_version": 1, "x": Payload()}, path)
    with pytest.raises(ReplayError) as info:
        load_capture(path, M.Classifier())
    assert "weights_only" in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):  # what the refusal guards against is real
        torch.load(path, weights_only=True)


def test_save_refuses_inputs_that_are_not_tensors_naming_them(tmp_path):
    model = M.WithOptions()
    with Guard(model, capture=True) as guard:
        model(torch.randn(2, 4), options=M.Options())
    result = guard.capture.replay()  # in this kernel the object is used by reference
    assert result.ok and any("input[options] (Options)" in note for note in result.notes)
    with pytest.raises(ReplayError) as info:
        guard.capture.save(tmp_path / "b.pt")
    message = str(info.value)
    assert "input[options] (Options)" in message and "\n" not in message
    assert not (tmp_path / "b.pt").exists()


def test_bad_inputs_raise_one_line_errors_that_say_what_to_do(tmp_path):
    errors = []
    with pytest.raises(ReplayError) as info:
        Capture(M.Classifier()).replay()
    errors.append(info.value)
    assert "nothing was captured" in str(info.value)

    model = M.Classifier()
    with Guard(model) as guard:  # capture is off
        model(torch.randn(2, 8))
    assert guard.capture is None
    with pytest.raises(ReplayError) as info:
        replay_after_error(guard, RuntimeError("CUDA error: device-side assert triggered"), save_dir=tmp_path)
    errors.append(info.value)
    assert "capture=True" in str(info.value)

    with pytest.raises(ReplayError) as info:
        load_capture(tmp_path / "missing.pt", model)
    errors.append(info.value)

    torch.save({"weight": torch.zeros(2)}, tmp_path / "state.pt")
    with pytest.raises(ReplayError) as info:
        load_capture(tmp_path / "state.pt", model)
    errors.append(info.value)
    assert "not a numguard replay bundle" in str(info.value)

    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(ReplayError) as info:
        load_capture(tmp_path / "text.pt", model)
    errors.append(info.value)

    with Guard(model, capture=True) as guard:
        model(torch.randn(2, 8))
    path = guard.capture.save(tmp_path / "ok.pt")
    with pytest.raises(ReplayError) as info:
        load_capture(path, M.Classifier(hidden=12))
    errors.append(info.value)
    assert "does not match the bundle" in str(info.value) and "head.weight (2, 12) vs (2, 16)" in str(info.value)
    with pytest.raises(ReplayError) as info:
        load_capture(path, "model")
    errors.append(info.value)

    x, labels = bad_batch()
    loss_fn = nn.Module()  # a custom, non-torch.nn loss cannot be rebuilt from the bundle
    loss_fn.forward = lambda logits, target: nn.functional.cross_entropy(logits, target)
    classifier = M.Classifier()
    with Guard({"model": classifier, "custom": loss_fn}, capture=True) as guard:
        M.train_step(classifier, loss_fn, x, good_labels())
    path = guard.capture.save(tmp_path / "two.pt")
    with pytest.raises(ReplayError) as info:
        load_capture(path, M.Classifier())
    errors.append(info.value)
    assert "'model'" in str(info.value) and "'custom'" in str(info.value)
    assert load_capture(path, {"model": M.Classifier(), "custom": loss_fn}).replay().ok

    good = torch.load(path, weights_only=True)
    for damage in ("roots", "calls"):  # the header right, the body not
        damaged = dict(good)
        if damage == "roots":
            del damaged["roots"]
        else:
            damaged["calls"] = []
        torch.save(damaged, tmp_path / "damaged.pt")
        with pytest.raises(ReplayError, match="is a damaged numguard bundle") as info:
            load_capture(tmp_path / "damaged.pt", {"model": M.Classifier(), "custom": loss_fn})
        errors.append(info.value)
    raw = Path(path).read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) // 2])  # a copy cut short
    with pytest.raises(ReplayError, match="cut short or damaged") as info:
        load_capture(tmp_path / "cut.pt", M.Classifier())
    errors.append(info.value)

    for error in errors:
        assert "\n" not in str(error) and len(str(error)) < 400, str(error)


def test_one_module_given_for_two_roots_of_its_class_is_refused(tmp_path):
    # a GAN's G and D of one class: the module given cannot stand for both
    g, d = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))
    with Guard({"G": g, "D": d}, capture=True) as guard:
        d(g(torch.randn(2, 4)))
    path = guard.capture.save(tmp_path / "gan.pt")
    with pytest.raises(ReplayError, match="replays 'D'"):
        load_capture(path, {"net": nn.Sequential(nn.Linear(4, 4))})
    assert load_capture(path, {"G": nn.Sequential(nn.Linear(4, 4)),
                               "D": nn.Sequential(nn.Linear(4, 4))}).replay().ok


class HoldsALock(M.Classifier):
    """A model holding what cannot be copied (a writer's or a logger's lock)."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


def test_a_model_that_cannot_be_copied_still_gets_its_bundle(tmp_path):
    model = HoldsALock()
    x, labels = bad_batch()
    with pytest.raises(IndexError) as raised, Guard(model, capture=True) as guard:
        nn.functional.cross_entropy(model(x), labels)
    outcome = replay_after_error(guard, raised.value, save_dir=tmp_path)
    assert outcome.result is None and "cannot pickle" in outcome.replay_error  # not here, but:
    assert outcome.path is not None and "%numguard_replay" in repr(outcome)
    replayed = load_capture(outcome.path, M.Classifier()).replay()  # the fresh kernel's model
    assert isinstance(replayed.exception, IndexError)


# ---- after a device error -------------------------------------------------------------------
def test_is_device_error():
    assert is_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert is_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_device_error(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm"))
    assert is_device_error(RuntimeError("cudaErrorAssert"))
    if hasattr(torch, "AcceleratorError"):
        assert is_device_error(torch.AcceleratorError.__new__(torch.AcceleratorError))
    assert not is_device_error(IndexError("Target 2 is out of bounds."))
    assert not is_device_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not is_device_error(ValueError("CUDA error"))


def simulated_device_error(model, loss_fn, batches):
    """Run the batches on the simulated GPU; return (guard, the late CUDA error)."""
    guard = Guard({"model": model, "loss_fn": loss_fn}, capture=True)
    with M.simulated_gpu():
        with pytest.raises(RuntimeError) as info:
            with guard:
                for x, labels in batches:
                    loss = M.train_step(model, loss_fn, x, labels)
                M.sync(loss)
    return guard, info.value


def test_replay_after_a_simulated_device_assert_end_to_end(tmp_path, monkeypatch):
    x, labels = bad_batch()
    model, loss_fn = M.Classifier(), nn.CrossEntropyLoss()
    guard, error = simulated_device_error(model, loss_fn, [(x, labels)])
    assert is_device_error(error)
    assert error.__traceback__.tb_next is not None
    late = [f.lineno for f in __import__("traceback").extract_tb(error.__traceback__)]
    assert line_of("sync line") in late and line_of("loss call line") not in late  # the wrong line

    monkeypatch.chdir(tmp_path)  # default bundle directory: the current one
    outcome = replay_after_error(guard, error)
    assert isinstance(outcome, ReplayOutcome) and outcome.device_error
    assert isinstance(outcome.result.exception, IndexError)
    assert (outcome.location.filename, outcome.location.lineno) == (MODELS_FILE, line_of("loss call line"))
    assert Path(outcome.path).parent == tmp_path and Path(outcome.path).name.startswith("numguard_replay_")
    text = repr(outcome)
    order = [text.index(s) for s in ("IndexError: Target 2", f"models.py:{line_of('loss call line')}",
                                     "RuntimeError: CUDA error", "restart the kernel", outcome.path)]
    assert order == sorted(order)
    assert f"%numguard_replay {outcome.path}" in text
    assert f"load_capture({outcome.path!r}, model)" in text
    html_text = outcome._repr_html_()
    assert "IndexError" in html_text and "restart the kernel" in html_text
    assert "load_capture(&#x27;" in html_text  # escaped
    # The bundle replays without the loss module: nn.CrossEntropyLoss is rebuilt from it.
    result = load_capture(outcome.path, M.Classifier()).replay()
    assert isinstance(result.exception, IndexError)
    assert result.location.lineno == line_of("loss call line")


def test_an_error_reported_one_call_late_is_found_in_the_call_before(tmp_path):
    x, labels = bad_batch()
    model, loss_fn = M.Classifier(), nn.CrossEntropyLoss()
    guard, error = simulated_device_error(model, loss_fn, [(x, labels), (x, good_labels())])
    assert guard.capture.replay().ok  # the latest step is fine on CPU
    outcome = replay_after_error(guard, error, save_dir=tmp_path)
    assert isinstance(outcome.result.exception, IndexError)
    assert outcome.result.call.index == 1  # the loss call of the first batch
    assert "ran clean on CPU; an earlier one raised" in repr(outcome)
    assert Path(outcome.path).parent == tmp_path
    assert load_capture(outcome.path, M.Classifier()).index == 1


def test_html_views_escape_text():
    model = M.WithOptions()
    with Guard(model, capture=True) as guard:
        model(torch.randn(2, 4), options=None)
    result = guard.capture.replay()
    result.notes.append("<script>alert(1)</script>")
    assert "<script>" not in result._repr_html_() and "&lt;script&gt;" in result._repr_html_()
    outcome = ReplayOutcome(error=RuntimeError("CUDA error: <b>x</b>"), result=result, device_error=True)
    assert "<b>x</b>" not in outcome._repr_html_() and "&lt;b&gt;x&lt;/b&gt;" in outcome._repr_html_()


# ---- on a real GPU ----------------------------------------------------------------------------
GPU_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    from torch import nn
    import models as M
    from numguard_nb import Guard
    from numguard_nb.replay import is_device_error, replay_after_error

    torch.manual_seed(0)
    model, loss_fn = M.Classifier().cuda(), nn.CrossEntropyLoss()
    x = torch.randn(6, 8, device="cuda")
    labels = torch.tensor([0, 1, 2, 0, 1, 2], device="cuda")
    guard = Guard({"model": model, "loss_fn": loss_fn}, capture=True)
    try:
        with guard:
            loss = M.train_step(model, loss_fn, x, labels)
            loss.item()
        print(json.dumps({"error": None}))
        sys.exit(0)
    except Exception as error:
        original = error
    outcome = replay_after_error(guard, original, save_dir=sys.argv[1])
    loc = outcome.location
    print(json.dumps({
        "device_error": is_device_error(original), "original": repr(original)[:200],
        "error": type(outcome.result.exception).__name__, "file": loc.filename, "line": loc.lineno,
        "path": outcome.path, "text": repr(outcome),
    }), flush=True)
    os._exit(0)  # skip tearing down the dead CUDA context
""")


@pytest.mark.cuda
def test_a_real_device_side_assert_replays_to_the_real_line(tmp_path):
    done = subprocess.run([sys.executable, "-c", GPU_SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, env=dict(subprocess_env(), CUDA_LAUNCH_BLOCKING="0"), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report.get("device_error"), report
    assert report["error"] == "IndexError", report
    assert (report["file"], report["line"]) == (MODELS_FILE, line_of("loss call line")), report
    assert Path(report["path"]).is_file()
    result = load_capture(report["path"], M.Classifier()).replay()  # here, in a healthy process
    assert isinstance(result.exception, IndexError)
    assert result.location.lineno == line_of("loss call line")


# ---- a snapshot that would not fit in host memory ----------------------------------------
def test_capture_refuses_a_snapshot_larger_than_half_the_host_memory(monkeypatch):
    from numguard_nb import _util
    from numguard_nb.replay import CaptureTooLarge, snapshot_bytes

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64, bias=False))
    needed = snapshot_bytes(model)
    assert needed == (64 * 64 * 2 + 64) * 4
    monkeypatch.setattr(_util, "host_memory_available", lambda: needed)  # 2x would be needed
    with pytest.raises(CaptureTooLarge) as caught:
        Guard(model, capture=True).attach()
    message = str(caught.value)
    assert "\n" not in message and "capture=False" in message
    assert message.startswith(f"capture refused: the weights' host copy ({needed / 1e3:.3g} kB) would")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    # with room for it, or where the free memory is not known, capture goes ahead
    for available in (2 * needed, None):
        monkeypatch.setattr(_util, "host_memory_available", lambda: available)
        with Guard(model, capture=True) as guard:
            model(torch.randn(2, 64))
        assert guard.capture is not None


def test_a_fused_optimizer_step_counts_as_changed_weights():
    """Adam(fused=True) writes parameters without bumping their version counters; a replay on
    the snapshot must still say that the weights moved since."""
    import gc

    from torch.optim.optimizer import _global_optimizer_post_hooks

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    other = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), fused=True)
    unrelated = torch.optim.SGD(other.parameters(), lr=0.1)
    gc.collect()  # captures earlier tests left behind go first
    hooks_before = len(_global_optimizer_post_hooks)
    with Guard(model, capture=True) as guard:
        versions = [p._version for p in model.parameters()]
        model(torch.randn(3, 4)).sum().backward()
        assert not guard.capture.weights_changed
        other(torch.randn(3, 4)).sum().backward()
        unrelated.step()  # another model's optimizer: these weights did not move
        model(torch.randn(3, 4)).sum().backward()
        assert not guard.capture.weights_changed
        optimizer.step()
        assert [p._version for p in model.parameters()] == versions  # invisible to versions
        model(torch.randn(3, 4))
        assert guard.capture.weights_changed
    assert len(_global_optimizer_post_hooks) == hooks_before  # gone with the guard



def test_snapshot_size_counts_what_tensors_store():
    from numguard_nb.replay import snapshot_bytes

    model = nn.Linear(4, 2)
    dense = snapshot_bytes(model)
    # a huge sparse buffer with two stored values costs its values and indices, not 4 TB
    indices, values = torch.tensor([[0, 1], [0, 1]]), torch.tensor([1.0, 2.0])
    model.register_buffer("mask", torch.sparse_coo_tensor(indices, values, (10**6, 10**6)))
    assert snapshot_bytes(model) == dense + 2 * 4 + 4 * 8
    with Guard(model, capture=True) as guard:
        model(torch.randn(3, 4))
    assert guard.capture is not None


def test_a_capture_left_behind_does_not_keep_its_optimizer_hook():
    import gc
    import weakref

    from torch.optim.optimizer import _global_optimizer_post_hooks

    gc.collect()  # captures earlier tests left behind go first
    hooks_before = len(_global_optimizer_post_hooks)
    capture = Capture(nn.Linear(4, 2))  # never closed by a guard
    assert len(_global_optimizer_post_hooks) == hooks_before + 1
    gone = weakref.ref(capture)
    del capture
    gc.collect()
    assert gone() is None and len(_global_optimizer_post_hooks) == hooks_before


def test_saving_a_bundle_to_a_folder_asks_for_a_file_name(tmp_path):
    emb = nn.Embedding(10, 4)
    with pytest.raises(IndexError), Guard(emb, capture=True) as guard:
        emb(torch.tensor([[1, 12]]))
    with pytest.raises(ValueError, match=r"is a folder: give the bundle a file name, e\.g\. "):
        guard.capture.save(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_bundle_names_a_notebook_cell_as_the_kernel_that_saved_it_did():
    # a fresh kernel does not know the cell's file (<ipython-input-4-...>): the name the saving
    # kernel gave it is kept; a file path is named from the file as usual
    from numguard_nb.replay import bundle, outside

    entries = [{"name": "torch.nn.functional.cross_entropy", "attribute": False,
                "args": outside._encode(()), "kwargs": outside._encode({}),
                "filename": "<ipython-input-4-1827e757352f>", "lineno": 3, "line": "loss = ...",
                "where": "Cell In[4], line 3"},
               {"name": "torch.log", "attribute": False, "args": outside._encode(()),
                "kwargs": outside._encode({}), "filename": "/work/train.py", "lineno": 12,
                "line": "", "where": "/elsewhere/train.py:12"}]
    cell, script = outside.decode(entries)
    assert (cell.where, script.where) == ("Cell In[4], line 3", "/work/train.py:12")
    site = bundle._recorded_site({"filename": "<ipython-input-4-1827e757352f>", "lineno": 2,
                                  "function": "<module>", "line": "logits = model(x)",
                                  "where": "Cell In[4], line 2"})
    assert str(site) == "Cell In[4], line 2 in <module>: logits = model(x)"
