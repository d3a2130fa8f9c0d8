"""Score inf/nan detectors on real bugs: which module, phase, op and batch each one names.

    python benchmarks/diagnosis.py [--cases a,b] [--json PATH] [--as-on-a-gpu]

Every case of diagnosis_cases (public bug reports reproduced small on CPU, plus traps where
nothing is wrong) is run from scratch once per detector:

- numguard: `Guard(models, ops=True)` around the whole loop (and, as "sentinel", `Guard(models,
  mode="sentinel")`: its checks, and the failing step re-run with the full guard) (a loss module is guarded alongside
  the model), given the case's GradScaler as `scaler=` where the run is built with one; a loop
  that makes its own scaler when it starts (`Run.make_scaler`) hands it to nobody, and the guard
  must find it. Its report's cause places the value outside the model where it says so ("data":
  the data pipeline, "loss-gradient": the training loop's loss, "weights": the optimizer step);
  otherwise the culprit frame's module and phase count.
- Hugging Face's `DebugUnderflowOverflow` on each module of the case (forward only): the module
  of the last frame of the dump it prints, and the batch number it prints.
- `torch.autograd.detect_anomaly()`: the autograd node of its error (it checks backward, for nan
  only), the module whose forward code the forward traceback it prints runs through (the
  training loop when none), the batch it stopped in.

A verdict on a bug scores four answers against the case's truth: module, phase (forward, which
includes preparing the data, backward, or the optimizer step), op (forward: the ATen op;
backward: the autograd node, and the ATen op if one is named) and batch. A detector that stays
silent, or names no op, has those wrong. On a trap the only question is whether it raised a
false alarm. Each truth is also re-derived here by diagnosis_tracer (independent of numguard):
the "tracer" column says whether it agrees.

`--as-on-a-gpu` runs numguard as it runs on a GPU, on this CPU: statistics written as device rows
and read once per pass, the sentinel's flags and the loss code's regions read later.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import io
import json
import re
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from diagnosis_cases import (
    BACKWARD, CASES, CASES_BY_NAME, FORWARD, IN_DATA, IN_LOOP, IN_OPTIMIZER, OPTIMIZER, Case,
    run_steps,
)
from diagnosis_tracer import trace

DETECTORS = ("numguard", "sentinel", "hf", "anomaly")
DETECTOR_TITLES = {"numguard": "numguard `Guard(ops=True)`",
                   "sentinel": "numguard `Guard(mode=\"sentinel\")`",
                   "hf": "HF `DebugUnderflowOverflow`",
                   "anomaly": "`autograd.detect_anomaly`"}
ANSWERS = ("module", "phase", "op", "batch")


@dataclass
class Verdict:
    """What one detector said about one run."""

    alarm: bool  # it stopped the run over an inf/nan
    module: Optional[str] = None
    phase: Optional[str] = None
    op: Optional[str] = None  # ATen op, when it names one
    node: Optional[str] = None  # autograd node, when it names one
    batch: Optional[int] = None
    said: str = ""  # its own words, shortened
    crash: Optional[str] = None  # the run ended with some other exception


class _BatchTracker:
    """A `run_steps` phase hook that remembers the batch being run."""

    def __init__(self):
        self.batch = 0

    def __call__(self, phase: str, batch: int):
        self.batch = batch
        return contextlib.nullcontext()


def _shorten(text: str, limit: int = 160) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _crash(exc: BaseException) -> str:
    return _shorten(f"{type(exc).__name__}: {exc}", 120)


def _qualify(prefix: str, name: str) -> str:
    return name if not prefix else (f"{prefix}.{name}" if name else prefix)


# ---- numguard ---------------------------------------------------------------------------------
# Where each cause places the first non-finite value (numguard's README, "What the guard
# watches"): (module, phase), None keeping the frame's own.
_NUMGUARD_CAUSES = {
    "data": (IN_DATA, None),  # the data fed to the model: made before the call
    "loss-gradient": (IN_LOOP, None),  # the gradient entering the model: the loss's doing
    "outside": (IN_LOOP, None),  # code between the model's calls: the training loop
    "weights": (IN_OPTIMIZER, OPTIMIZER),  # weights already non-finite: a broken optimizer step
}


def run_numguard(case: Case, **options) -> Verdict:
    from numguard_nb import Guard, NonFiniteError

    run = case.build()
    options = options or {"ops": True}
    try:
        # run.scaler is None here for a loop that makes its own (Run.make_scaler)
        with Guard(run.models, scaler=run.scaler, **options):
            run_steps(run)
    except NonFiniteError as err:
        report = err.report
        frame = report.first_nonfinite
        module, phase = _NUMGUARD_CAUSES.get(report.cause, (None, None))
        node, op = None, frame.op
        if op and ": " in op:  # backward: "SqrtBackward0: aten.div.Tensor"
            node, op = op.split(": ", 1)
        # Weights an optimizer step wrote: the step named, after the batch it followed.
        step = report.optimizer_step
        batch = step.after_batch if step is not None and step.after_batch is not None \
            else report.batch_number
        return Verdict(alarm=True, module=module or frame.module_name, phase=phase or frame.phase,
                       op=op, node=node, batch=batch,
                       said=_shorten(f"[{report.cause}] {report.summary()}"))
    except Exception as exc:
        return Verdict(alarm=False, crash=_crash(exc), said="run crashed")
    return Verdict(alarm=False, said="no detection")


# ---- Hugging Face DebugUnderflowOverflow ------------------------------------------------------
_HF_HEADER = re.compile(r"^ {18}(\S*) (\S+)$")  # "{17 spaces} {module name} {class}"
_HF_BATCH = re.compile(r"Detected inf/nan during batch_number=(\d+)")


def _hf_parse(printed: str):
    """(module name, batch) that a DebugUnderflowOverflow dump names: its last frame's module."""
    found = list(_HF_BATCH.finditer(printed))
    if not found:
        return None, None
    dump = printed[found[-1].end():]
    headers = [m.group(1) for m in map(_HF_HEADER.match, dump.splitlines()) if m]
    return (headers[-1] if headers else None), int(found[-1].group(1))


def _hf_instance(exc: BaseException):
    """The DebugUnderflowOverflow whose forward hook raised `exc`."""
    from transformers.debug_utils import DebugUnderflowOverflow

    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, DebugUnderflowOverflow):
            return owner
        tb = tb.tb_next
    return None


def run_hf(case: Case) -> Verdict:
    from transformers.debug_utils import DebugUnderflowOverflow

    run = case.build()
    debuggers = {prefix: DebugUnderflowOverflow(model) for prefix, model in run.models.items()}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            run_steps(run)
    except ValueError as exc:
        if not str(exc).startswith("DebugUnderflowOverflow"):
            return Verdict(alarm=False, crash=_crash(exc), said="run crashed")
        # The batch as printed: the root's forward hook counts it, so a detection in the root's
        # own frame prints the next batch's number; scored as printed, as a user would read it.
        name, batch = _hf_parse(printed.getvalue())
        owner = _hf_instance(exc)
        prefix = next((p for p, d in debuggers.items() if d is owner), "")
        module = _qualify(prefix, name) if name is not None else None
        flagged = [line.strip() for line in printed.getvalue().splitlines()
                   if line.endswith(("has nans", "has infs"))]
        return Verdict(alarm=True, module=module, phase=FORWARD, batch=batch,
                       said=_shorten(f"last frame {module!r}: {'; '.join(flagged[:3])}"))
    except Exception as exc:
        return Verdict(alarm=False, crash=_crash(exc), said="run crashed")
    return Verdict(alarm=False, said="no detection")


# ---- torch.autograd.detect_anomaly ------------------------------------------------------------
_ANOMALY_ERROR = re.compile(r"Function '(\w+)' returned nan values")
_STACK_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)')


def _forward_spans(models) -> Dict[tuple, List[str]]:
    """(file, first line, last line) of each module class's forward -> qualified module names."""
    spans: Dict[tuple, List[str]] = {}
    for prefix, root in models.items():
        for name, module in root.named_modules():
            forward = type(module).forward
            try:
                lines, first = inspect.getsourcelines(forward)
                filename = inspect.getsourcefile(forward)
            except (OSError, TypeError):
                continue
            spans.setdefault((filename, first, first + len(lines) - 1), []).append(
                _qualify(prefix, name))
    return spans


def _inside(name: str, ancestor: str) -> bool:
    return (ancestor == "" and name != "") or name.startswith(ancestor + ".")


def _relative(name: str, ancestor: str) -> str:
    return name if ancestor == "" else name[len(ancestor) + 1:]


def module_from_stack(stack: str, models) -> str:
    """The module whose forward made the node, read from a printed forward traceback.

    Walks the frames outermost first: a frame inside some module class's forward narrows the
    candidates to those modules nested in the previous ones, and the attribute the calling line
    names (`self.wo(h)`) picks among instances of one class. What stays ambiguous (a loop over a
    ModuleList) ends at the candidates' common ancestor.
    """
    spans = _forward_spans(models)
    current: List[str] = []
    caller_line = ""
    for filename, lineno, code in _STACK_FRAME.findall(stack):
        line = int(lineno)
        names = [n for (f, a, b), found in spans.items() if f == filename and a <= line <= b
                 for n in found]
        if current:
            names = [n for n in names if any(_inside(n, c) for c in current)]
        if names:
            called = re.search(r"self\.(\w+)", caller_line)
            if called and current:
                picked = [n for n in names if any(
                    _inside(n, c) and _relative(n, c).split(".")[0] == called.group(1)
                    for c in current)]
                names = picked or names
            current = names
        caller_line = code
    if not current:
        return IN_LOOP  # nodes are made by code with gradients: the loop, not the data pipeline
    parts = [name.split(".") for name in current]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common) if len(current) > 1 else current[0]


def run_anomaly(case: Case) -> Verdict:
    run = case.build()
    tracker = _BatchTracker()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly():
                run_steps(run, phase=tracker)
        except RuntimeError as exc:
            found = _ANOMALY_ERROR.search(str(exc))
            if not found:
                return Verdict(alarm=False, crash=_crash(exc), said="run crashed")
            node = found.group(1)
            stack = next((str(w.message) for w in caught
                          if f"Error detected in {node}" in str(w.message)), "")
            module = module_from_stack(stack, run.models)
            return Verdict(alarm=True, module=module, phase=BACKWARD, node=node,
                           batch=tracker.batch, said=_shorten(str(exc)))
        except Exception as exc:
            return Verdict(alarm=False, crash=_crash(exc), said="run crashed")
    return Verdict(alarm=False, said="no detection")


RUNNERS = {"numguard": run_numguard, "sentinel": lambda case: run_numguard(case, mode="sentinel"),
           "hf": run_hf, "anomaly": run_anomaly}


# ---- scoring ----------------------------------------------------------------------------------
def score(case: Case, verdict: Verdict) -> Dict[str, bool]:
    """Per answer, whether the verdict has it right; for a trap, {"healthy": no false alarm}."""
    if case.trap:
        return {"healthy": not verdict.alarm and verdict.crash is None}
    truth = case.truth
    if not verdict.alarm:
        return {answer: False for answer in ANSWERS}
    if truth.phase == BACKWARD:
        op_right = verdict.node == truth.node and verdict.op in (None, truth.op)
    else:
        op_right = verdict.node is None and verdict.op == truth.op
    return {"module": verdict.module == truth.module, "phase": verdict.phase == truth.phase,
            "op": op_right, "batch": verdict.batch == truth.batch}


def evaluate(cases, detectors=DETECTORS) -> List[dict]:
    """Run every case under the tracer and each detector; one result dict per case."""
    results = []
    for case in cases:
        started = time.perf_counter()
        traced = trace(case)
        entry = {"case": case.name, "summary": case.summary, "sources": list(case.sources),
                 "trap": case.trap,
                 "truth": dataclasses.asdict(case.truth) if case.truth else None,
                 "tracer_agrees": traced.healthy if case.trap else traced.truth == case.truth,
                 "tracer": dataclasses.asdict(traced.culprit) if traced.culprit else None,
                 "detectors": {}}
        for name in detectors:
            verdict = RUNNERS[name](case)
            entry["detectors"][name] = {"verdict": dataclasses.asdict(verdict),
                                        "score": score(case, verdict)}
        entry["seconds"] = round(time.perf_counter() - started, 2)
        results.append(entry)
    return results


# ---- the table --------------------------------------------------------------------------------
def _mark(right: bool) -> str:
    return "✓" if right else "✗"


def _module_text(name: Optional[str]) -> str:
    if name is None:
        return "-"
    return "(root)" if name == "" else name


def _truth_text(truth: Optional[dict]) -> str:
    if truth is None:
        return "healthy"
    op = f"{truth['node']}: {truth['op']}" if truth["node"] else truth["op"]
    return f"`{_module_text(truth['module'])}` · {truth['phase']} · `{op}` · {truth['batch']}"


def _cell(entry: dict, detector: str) -> str:
    scored = entry["detectors"][detector]["score"]
    if entry["trap"]:
        return "ok" if scored["healthy"] else "false alarm"
    return " ".join(_mark(scored[answer]) for answer in ANSWERS)


def _named(verdict: dict) -> str:
    if not verdict["alarm"]:
        return f"crash: {verdict['crash']}" if verdict["crash"] else "nothing"
    op = ": ".join(part for part in (verdict["node"], verdict["op"]) if part) or "-"
    return f"`{_module_text(verdict['module'])}` · {verdict['phase']} · `{op}` · {verdict['batch']}"


def markdown(results: List[dict], detectors=DETECTORS) -> str:
    bugs = [r for r in results if not r["trap"]]
    traps = [r for r in results if r["trap"]]
    head = ["case", "truth (module · phase · op · batch)", "tracer"] + [
        DETECTOR_TITLES[d] for d in detectors]
    lines = ["Each detector cell: module, phase, op, batch (✓ right, ✗ wrong); traps: ok or "
             "false alarm.", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for entry in results:
        row = [entry["case"], _truth_text(entry["truth"]), _mark(entry["tracer_agrees"])]
        row += [_cell(entry, d) for d in detectors]
        lines.append("| " + " | ".join(row) + " |")
    totals = [f"**total** ({len(bugs)} bugs, {len(traps)} traps)", "",
              f"{sum(r['tracer_agrees'] for r in results)}/{len(results)}"]
    for detector in detectors:
        parts = [f"{answer} {sum(r['detectors'][detector]['score'][answer] for r in bugs)}/{len(bugs)}"
                 for answer in ANSWERS]
        parts.append(f"traps {sum(r['detectors'][detector]['score']['healthy'] for r in traps)}"
                     f"/{len(traps)}")
        totals.append(" · ".join(parts))
    lines.append("| " + " | ".join(totals) + " |")
    lines += ["", "What each detector named (module · phase · op · batch):", "",
              "| case | " + " | ".join(DETECTOR_TITLES[d] for d in detectors) + " |",
              "|" + "---|" * (len(detectors) + 1)]
    for entry in results:
        cells = [_named(entry["detectors"][d]["verdict"]) for d in detectors]
        lines.append(f"| {entry['case']} | " + " | ".join(cells) + " |")
    lines += ["", "Cases and the reports they reproduce:", ""]
    for entry in results:
        lines.append(f"- `{entry['case']}`: {entry['summary']}. {', '.join(entry['sources'])}")
    return "\n".join(lines)


def read_as_on_a_gpu() -> None:
    """Run numguard's GPU path on CPU tensors, for this process: rows stay on the "device" and
    are read once per pass, the sentinel's flags and the loss code's regions are read later."""
    from numguard_nb import numerics, stats
    from numguard_nb.guard import outside_checks

    numerics.DEFERRED_DEVICE_TYPES.add("cpu")
    stats.CPU_READS_AT_ONCE = False
    outside_checks.IMMEDIATE_DEVICES = frozenset()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--as-on-a-gpu", action="store_true",
                        help="numguard's GPU path on this CPU (rows and flags read later)")
    args = parser.parse_args(argv)
    if args.as_on_a_gpu:
        read_as_on_a_gpu()
    if args.cases:
        unknown = [n for n in args.cases.split(",") if n not in CASES_BY_NAME]
        if unknown:
            parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES_BY_NAME)}")
        cases = [CASES_BY_NAME[n] for n in args.cases.split(",")]
    else:
        cases = list(CASES)
    started = time.perf_counter()
    results = evaluate(cases)
    print(markdown(results))
    elapsed = time.perf_counter() - started
    print(f"\n({len(results)} cases in {elapsed:.1f} s, torch {torch.__version__})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"torch": torch.__version__, "results": results}, handle, indent=1)
    return 0 if all(r["tracer_agrees"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
