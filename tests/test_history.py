"""The numerics history (`Guard(model, history_every=N)`, `guard.history`): which batches are
sampled, that its table holds what the guard's own report rows hold, its views (golden files),
bounded memory over a long run, nan/inf in it, the trend and the batch where it reaches the
limit, a detection's history note, `%numguard history`, the Trainer and Lightning callbacks'
figures, and that it leaves no hook behind.

The golden views are drawn from made-up passes (exact numbers, fed through `History.add_pass`
as the guard feeds its own), so they do not depend on the torch version's arithmetic.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from numguard_nb import Guard, NonFiniteError
from numguard_nb._schema import (
    BACKWARD, BUFFER, CELL_INF, CELL_MISSING, CELL_NAN, FORWARD, GRAD_OUTPUT, GRAD_PARAM, OUTPUT,
    PARAM, VALUE_TENSOR,
)
from numguard_nb.guard import GuardOptions
from numguard_nb.guard.history import KEPT_CATEGORIES, History, fit_trend
from numguard_nb.guard.passes import CallRecord, PassRecord
from numguard_nb.render import history as history_view
from promises import hooks_left, memory_growth

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]


class Grow(nn.Module):
    """Multiplies by `factor`, which the test sets before each batch."""

    def __init__(self):
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return x * self.factor


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def train(net, guard, batches, optimizer=None):
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    with guard:
        for _ in range(batches):
            net(x).pow(2).mean().backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()


# ---- made-up passes ------------------------------------------------------------------------
def made_up_pass(batch, phase, calls):
    """A read-back pass: `calls` are (name, class, [(role, category, abs min, abs max, dtype)]),
    children first, the root (name "") last; forward calls get the root as parent."""
    pass_ = PassRecord()
    records = []
    for seq, (name, cls, values) in enumerate(calls):
        call = CallRecord(seq, name, cls, phase, batch, 0, name == "")
        call.seq = seq
        for role, category, low, high, dtype in values:
            index = len(pass_.values)
            pass_.values.append([low, high, 0.0])
            call.slots.append((role, category, VALUE_TENSOR, dtype, (2, 2), index, 0))
        records.append(call)
    if phase == FORWARD:
        for call in records[:-1]:
            call.parent = records[-1]
    pass_.calls.extend(records)
    return pass_


def golden_history() -> History:
    """Twelve samples of a made-up run: `encoder` doubles every 10 batches toward float16's
    limit, `act` is not called in one sample and holds inf in another, `head` turns nan."""
    history = History()
    half, single = torch.float16, torch.float32
    for step in range(12):
        batch = step * 10
        encoder = 10.0 * 2 ** step
        act = math.inf if step == 7 else 0.5 * encoder
        head = math.nan if step >= 10 else 3.0 + step
        calls = [("encoder", "Linear", [("output", OUTPUT, 0.01, encoder, half),
                                        ("weight", PARAM, 0.001, 0.5 + step / 100, single)])]
        if step != 3:
            calls.append(("act", "ReLU", [("output", OUTPUT, 0.0, act, half)]))
        calls += [("head", "Linear", [("output", OUTPUT, 0.1, head, half)]),
                  ("", "Net", [("output", OUTPUT, 0.1, 1.0, half)])]
        history.add_pass(made_up_pass(batch, FORWARD, calls), batch)
        history.add_pass(made_up_pass(batch, BACKWARD, [
            ("head", "Linear", [("grad_output", GRAD_OUTPUT, 0.0, 1e-3, half),
                                ("weight.grad", GRAD_PARAM, 0.0, 2e-3, single)]),
        ]), batch)
    history.every = 10
    return history


# ---- sampling --------------------------------------------------------------------------------
def test_only_batches_whose_number_is_a_multiple_of_history_every_are_sampled(monkeypatch):
    net = small_net()
    kept = []
    original = History.add_pass
    monkeypatch.setattr(History, "add_pass", lambda self, pass_, batch=None, limit=None: (
        kept.append(batch), original(self, pass_, batch, limit)))
    guard = Guard(net, history_every=3)
    train(net, guard, 10)
    assert guard.history.batches == [0, 3, 6, 9]
    assert kept == [0, 0, 3, 3, 6, 6, 9, 9]  # forward and backward of sampled batches, no other
    frame = guard.history.to_frame()
    assert set(frame.batch_number) == {0, 3, 6, 9}
    assert set(frame[frame.batch_number == 3].phase) == {FORWARD, BACKWARD}
    assert guard.history.samples_taken == 4

    off = Guard(net)
    train(net, off, 4)
    assert off.history_every is None and len(off.history) == 0
    off.history_every = 2  # an option, settable between attaches
    train(net, off, 4)
    assert off.history.batches == [4, 6]


@pytest.mark.parametrize("value", [0, -3, True, 2.5, "10"])
def test_history_every_is_checked_with_a_one_line_error(value):
    with pytest.raises(ValueError, match=r"^history_every must be None or a positive number of "
                                         r"batches, got "):
        Guard(nn.Linear(2, 2), history_every=value)
    assert GuardOptions(history_every=7).history_every == 7


# ---- the table -----------------------------------------------------------------------------
def test_table_holds_what_the_guards_report_rows_hold_for_a_sampled_batch():
    net = small_net()
    guard = Guard(net, history_every=2, trace_batches=[4])
    train(net, guard, 6, torch.optim.SGD(net.parameters(), lr=0.1))
    frame = guard.history.to_frame()
    assert list(frame.columns) == history_view.FRAME_COLUMNS

    expected = {}
    for report_frame in guard.traces[4].frames:
        for row in report_frame.rows:
            if row.category in KEPT_CATEGORIES and row.kind == VALUE_TENSOR:
                key = (report_frame.module_name, report_frame.module_class, report_frame.phase,
                       report_frame.call_index, row.category, row.role, row.dtype)
                expected[key] = (np.float32(row.abs_min), np.float32(row.abs_max))
    batch = frame[frame.batch_number == 4]
    kept = {(r.module_name, r.module_class, r.phase, r.call_index, r.category, r.role, r.dtype):
            (np.float32(r.abs_min), np.float32(r.abs_max)) for r in batch.itertuples()}
    assert kept == expected
    assert {key[4] for key in kept} == {OUTPUT, GRAD_OUTPUT, GRAD_PARAM, PARAM, BUFFER}
    assert len(kept) == len(batch)  # one row per value

    # The weight update between samples: how far each weight's abs max moved since the last.
    def weight_rows(number):
        rows = frame[(frame.batch_number == number) & (frame.category == PARAM)]
        return rows.set_index(["module_name", "role"])

    before, after = weight_rows(2), weight_rows(4)
    assert np.allclose(after.abs_max_change, after.abs_max - before.abs_max.reindex(after.index))
    assert (after.abs_max_change != 0).any()
    assert weight_rows(0).abs_max_change.isna().all()
    assert frame[frame.category == OUTPUT].abs_max_change.isna().all()


# ---- the views -------------------------------------------------------------------------------
def test_views_of_a_made_up_run(golden):
    history = golden_history()
    view = history.view()
    assert [module for module, _ in view.modules] == ["", "encoder", "act", "head"]  # model order
    # nearest their limit in their latest sample: nan, then 20480 and 10240 of 65504
    assert [view.modules[row][0] for row in view.marked] == ["head", "encoder", "act"]
    golden("history_view.html", history._repr_html_() + "\n")
    golden("history_view.txt", repr(history) + "\n")
    kept = pickle.loads(pickle.dumps(history))  # saved for later, lock and all
    assert repr(kept) == repr(history) and kept.to_frame().equals(history.to_frame())
    kept.add_pass(made_up_pass(120, FORWARD, [
        ("", "Net", [("output", OUTPUT, 0.1, 1.0, torch.float16)])]))
    assert kept.batches[-1] == 120 and history.batches[-1] == 110


def test_an_empty_history_says_how_to_keep_one():
    assert repr(History()) == ("numguard history: no sampled batch yet "
                               "(Guard(model, history_every=N) samples a batch)")
    assert "no sampled batch yet" in History()._repr_html_()
    assert History().to_frame().empty and list(History().to_frame().columns) == \
        history_view.FRAME_COLUMNS
    assert History().note(CallRecord(1, "a", "Linear", FORWARD, 0, 0, True)) == ""


def test_nan_and_inf_in_the_history_are_drawn_in_their_own_colours():
    view = golden_history().view()
    act, head = view.modules.index(("act", "ReLU")), view.modules.index(("head", "Linear"))
    assert view.cells[act, 7] == CELL_INF and view.cells[act, 3] == CELL_MISSING
    assert (view.cells[head, 10:] == CELL_NAN).all()
    svg = history_view.history_svg(view)
    assert svg.count(f'fill="{history_view.NAN_COLOUR}"') == 2  # head's nan run, the legend
    assert svg.count(f'fill="{history_view.INF_COLOUR}"') == 2  # act's inf cell, the legend
    text = repr(view)
    assert re.search(r"head \(Linear\) +\|[^|]*NN\| nan at batch 110", text)
    assert re.search(r"act \(ReLU\) +\|[^|]{3} [^|]{3}I[^|]*\|", text)

    # A history holding nothing but nan and inf still draws (and its table holds them).
    broken = History()
    for batch, value in ((0, math.nan), (1, math.inf), (2, math.nan)):
        broken.add_pass(made_up_pass(batch, FORWARD, [
            ("", "Net", [("output", OUTPUT, value, value, torch.float32)])]), batch)
    assert "NIN" in repr(broken)
    svg = history_view.history_svg(broken.view())
    assert svg.count(f'fill="{history_view.NAN_COLOUR}"') == 3  # two cells, the legend
    assert svg.count(f'fill="{history_view.INF_COLOUR}"') == 2
    assert "Net output, forward: nan or inf since batch 0; too few finite samples" in \
        broken._repr_html_()
    table = broken.to_frame()
    assert table.abs_max.isna().tolist() == [True, False, True]
    assert math.isinf(table.abs_max[1])


# ---- memory ----------------------------------------------------------------------------------
def test_memory_stays_bounded_over_ten_thousand_batches():
    history = History(max_samples=64)
    forward = made_up_pass(0, FORWARD, [
        ("encoder", "Linear", [("output", OUTPUT, 0.1, 2.0, torch.float16),
                               ("weight", PARAM, 0.01, 0.5, torch.float32)]),
        ("", "Net", [("output", OUTPUT, 0.1, 1.0, torch.float16)])])
    backward = made_up_pass(0, BACKWARD, [
        ("encoder", "Linear", [("grad_output", GRAD_OUTPUT, 0.0, 1e-3, torch.float16),
                               ("weight.grad", GRAD_PARAM, 0.0, 1e-2, torch.float32)])])
    batches = iter(range(100_000))

    def step():  # as the guard feeds a sampled batch: its forward pass, then its backward pass
        batch = next(batches)
        history.add_pass(forward, batch)
        history.add_pass(backward, batch)

    growth = memory_growth(step, 10_000)
    assert len(history) <= 64 and history.samples_taken == 10_050
    kept = history.batches
    assert kept[0] == 0 and kept[-1] == 10_049  # the whole run, ...
    gaps = np.diff(kept)
    assert gaps[-1] == 1 and gaps[0] >= 1024 and (np.diff(gaps) <= 0).all()  # ... densest lately
    assert len({id(sample.ids) for sample in history.samples}) == 1  # one layout, held once
    assert growth < 16 * 1024, f"{growth} bytes more after 10,000 batches"

    # The guard's own history keeps its cap too.
    net = small_net()
    guard = Guard(net, history_every=1)
    guard.history = History(max_samples=8)
    train(net, guard, 40)
    assert len(guard.history) <= 8 and guard.history.batches[::len(guard.history) - 1] == [0, 39]


# ---- trends ----------------------------------------------------------------------------------
def test_a_steadily_growing_activation_is_projected_to_the_batch_it_reaches_the_limit():
    net = nn.Sequential(nn.Linear(4, 4), Grow())
    x = torch.ones(2, 4)
    with Guard(net, history_every=10, limit_dtype=torch.float16) as guard:
        for batch in range(400):
            net[1].factor = 1.01 ** batch
            net(x).sum().backward()
    (trend,) = [t for t in guard.history.view().trends if t.module_name == "1"]
    start = float(trend.abs_max[0])  # the output at batch 0, factor 1
    expected = math.log(65504 / start) / math.log(1.01)
    assert trend.role == "output" and trend.dtype == "float16" and trend.limit == 65504
    assert trend.steady and trend.r2 > 0.999 and trend.fitted == 20  # the recent half of 40
    assert trend.limit_batch == pytest.approx(expected, abs=0.5)
    assert trend.doubling_batches == pytest.approx(math.log(2) / math.log(1.01), rel=1e-3)
    sentence = history_view.trend_sentence(trend)
    assert f"would reach 65504 near batch {expected:,.0f}" in sentence
    assert "doubles every 70 batches (steady over the last 20 samples, R² 1.00)" in sentence


@pytest.mark.parametrize("growth, words", [(1.01, "doubles every 70 batches"),
                                            (2.0, "doubles every 1 batch "),
                                            (5.0, "doubles every 0.4 batches")])
def test_the_doubling_time_is_said_in_words_that_fit_it(growth, words):
    net = nn.Sequential(nn.Linear(4, 4), Grow())
    with Guard(net, history_every=1) as guard:
        for batch in range(12):
            net[1].factor = growth ** batch
            net(torch.ones(2, 4))
    (trend,) = [t for t in guard.history.view().trends if t.module_name == "1"]
    assert words in history_view.trend_sentence(trend)


def test_a_noisy_value_is_not_steady_and_gets_no_projection():
    rng = np.random.default_rng(0)
    batches = np.arange(0, 400, 10)
    noisy = 10 ** rng.uniform(-1, 1, len(batches))
    trend = fit_trend(batches, noisy, 65504.0)
    assert not trend["steady"] and "limit_batch" not in trend and trend["r2"] < 0.8
    few = fit_trend(np.arange(4), np.array([1.0, 2.0, 4.0, 8.0]), 65504.0)
    assert few == {"nonfinite_batch": None, "fitted": 4}  # however straight: no trend
    flat = fit_trend(np.arange(10), np.full(10, 3.0), 65504.0)
    assert flat["steady"] and flat["slope"] == 0 and "limit_batch" not in flat
    ended = fit_trend(np.arange(8), np.array([1, 2, 4, 8, 16, 32, math.inf, math.nan]), 100.0)
    assert ended["nonfinite_batch"] == 6 and ended["fitted"] == 6 and ended["steady"]


# ---- a detection's note ----------------------------------------------------------------------
def test_a_detection_says_how_the_culprits_value_grew_over_the_history():
    net = nn.Sequential(nn.Linear(4, 4), Grow()).half()
    with torch.no_grad():
        net[0].weight.fill_(0.25)
        net[0].bias.zero_()
    x = torch.ones(2, 4).half()

    def run(history_every, backward):
        guard = Guard(net, history_every=history_every)
        with pytest.raises(NonFiniteError) as raised, guard:
            for batch in range(1000):
                net[1].factor = 1.05 ** batch
                with torch.set_grad_enabled(backward):
                    loss = net(x).float().sum()
                if backward:
                    loss.backward()
        return raised.value.report

    report = run(5, backward=False)  # 1.05 ** 228 passes float16's largest value
    assert report.first_nonfinite.module_name == "1" and report.batch_number == 228
    # Samples every 5 batches: the last 10 finite ones are batches 180 to 225.
    first, last = float(torch.tensor(1.05 ** 180).half()), float(torch.tensor(1.05 ** 225).half())
    assert report.history_note == (
        f"its output's abs max grew {last / first:.3g}x over the last 45 batches "
        f"({first:.3g} at batch 180, {last:.3g} at batch 225)")
    assert f"\nhistory: {report.history_note}\n" in report.to_text() + "\n"
    assert '<div class="ng-note">history: ' in report._repr_html_()  # the notebook says it too

    # The weight gradients (twice the output) overflow first in backward: their history then.
    report = run(5, backward=True)
    assert report.first_nonfinite.module_name == "0" and report.phase == BACKWARD
    assert re.fullmatch(r"its weight gradients' abs max grew 8\.9\dx over the last 45 batches "
                        r"\(.* at batch 165, .* at batch 210\)", report.history_note)

    report = run(None, backward=False)
    assert report.history_note == "" and "history:" not in report.to_text()


# ---- hooks -----------------------------------------------------------------------------------
def test_the_history_leaves_no_hook_after_detach():
    net = small_net()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    before = hooks_left(net, optimizers=[optimizer])
    guard = Guard(net, history_every=1)
    train(net, guard, 3, optimizer)
    assert len(guard.history) == 3
    assert hooks_left(net, optimizers=[optimizer]) == before


# ---- %numguard history -----------------------------------------------------------------------
_SHELL_PROGRAM = r'''
import json
from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output

ip = start_ipython()
ip.run_cell("%load_ext numguard_nb")
ip.run_cell("""
import torch
from torch import nn
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
xs = [torch.randn(3, 4) for _ in range(6)]
def step(model, x):
    model(x).sum().backward()
""")
seen = {}

def run(name, cell):
    with capture_output() as captured:
        result = ip.run_cell(cell)
    error = result.error_in_exec
    value = result.result
    seen[name] = {
        "error": type(error).__name__ if error else None, "stderr": captured.stderr,
        "stdout": captured.stdout, "type": type(value).__name__,
        "html": value._repr_html_() if hasattr(value, "_repr_html_") else "",
    }

run("none yet", "%numguard history")
run("on", "%numguard on --history-every 2 net")
run("loop", "for x in xs:\n    step(net, x)")
run("status", "%numguard status")
run("history", "%numguard history --worst 2")
run("bad option", "%numguard history --worst 0")
run("off", "%numguard off")
run("after off", "%numguard history")
run("cell", "%%numguard --history-every 1 net\nfor x in xs[:2]:\n    step(net, x)")
run("after cell", "%numguard history")
seen["doc"] = ip.find_line_magic("numguard").__doc__
print(json.dumps(seen))
'''


def test_numguard_history_shows_the_session_guards_history_in_a_shell():
    result = subprocess.run([sys.executable, "-c", _SHELL_PROGRAM], capture_output=True, text=True,
                            timeout=300, cwd=REPOSITORY_ROOT)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["none yet"]["error"] == "UsageError"
    assert "%numguard history: no numerics history: %numguard on --history-every N" in \
        seen["none yet"]["stderr"]
    assert seen["loop"]["error"] is None
    assert "history of every 2 batches (3 samples)" in seen["status"]["stdout"]
    shown = seen["history"]
    assert shown["error"] is None and shown["type"] == "HistoryView"
    assert shown["stdout"].startswith("Out[") and \
        "numguard history: 3 sampled batches (every 2; batches 0 to 4), 4 modules" in shown["stdout"]
    assert '<svg class="ng-history-map"' in shown["html"]
    assert shown["html"].count('<svg class="ng-history-trend"') == 2  # --worst 2
    assert "expected a positive integer, got '0'" in seen["bad option"]["stderr"]
    assert "numguard history: 3 sampled batches" in seen["after off"]["stdout"]  # kept after off
    assert "numguard history: 2 sampled batches (every 1; batches 0 to 1)" in \
        seen["after cell"]["stdout"]  # the last %%numguard cell's (its own guard counts from 0)
    assert "%numguard history [--worst N]" in seen["doc"] and "--history-every" in seen["doc"]


# ---- the callbacks ---------------------------------------------------------------------------
def test_the_trainer_callback_logs_the_figures_of_each_sampled_batch(tmp_path):
    import transformers

    from numguard_nb.integrations import NumguardCallback

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, 64, (8,), generator=generator), "labels": i % 2}
            for i in range(16)]
    callback = NumguardCallback(history_every=2)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), report_to="none", use_cpu=True,
        per_device_train_batch_size=4, max_steps=4, save_strategy="no", disable_tqdm=True,
        logging_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "numguard/batch" in entry]
    assert [(entry["step"], entry["numguard/batch"]) for entry in logged] == [(1, 0.0), (3, 2.0)]
    for entry in logged:
        assert set(entry) == {"step", "numguard/batch", "numguard/max_log10_share",
                              "numguard/worst_abs_max", "numguard/nonfinite_values"}
        assert -38.5 < entry["numguard/max_log10_share"] < 0 and entry["numguard/nonfinite_values"] == 0
        assert entry["numguard/worst_abs_max"] == pytest.approx(
            10 ** entry["numguard/max_log10_share"] * torch.finfo(torch.float32).max, rel=1e-6)
    assert callback.history.batches == [0, 2]


def test_the_lightning_callback_logs_the_figures_of_each_sampled_batch():
    import lightning
    from lightning.pytorch.loggers import Logger

    from numguard_nb.integrations import NumguardLightningCallback

    class Captured(Logger):
        def __init__(self):
            super().__init__()
            self.metrics = []

        @property
        def name(self):
            return "captured"

        @property
        def version(self):
            return 0

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.metrics.append((step, dict(metrics)))

    class Lit(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = small_net()

        def training_step(self, batch, batch_index):
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    logger = Captured()
    callback = NumguardLightningCallback(history_every=2)
    trainer = lightning.Trainer(
        max_steps=5, accelerator="cpu", logger=logger, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
        log_every_n_steps=1000)
    data = torch.utils.data.DataLoader(torch.randn(40, 4), batch_size=8)
    trainer.fit(Lit(), data)
    logged = [(step, metrics) for step, metrics in logger.metrics if "numguard/batch" in metrics]
    assert [(step, metrics["numguard/batch"]) for step, metrics in logged] == \
        [(1, 0.0), (3, 2.0), (5, 4.0)]
    assert all(math.isfinite(metrics["numguard/max_log10_share"]) for _, metrics in logged)
    assert callback.history.batches == [0, 2, 4]
