"""The diagnostic tools in benchmarks/ stay pointed at what they measure."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import attribute  # noqa: E402


def test_every_part_an_attribution_variant_switches_off_is_still_there():
    # A part renamed in the package would leave its variant measuring the detector as it is.
    parts = attribute.parts_switched_off()
    assert all(hasattr(owner, name) for _, owner, name, _ in parts)
    named = {variant for variants, *_ in parts for variant in variants}
    assert named <= set(attribute.VARIANTS)
    assert set(attribute.VARIANTS) - named == {"sentinel", "full", "full-forward-only",
                                               "full-lean-floor"}


GPU_CHECKS = Path(__file__).resolve().parents[1] / "scripts" / "gpu_checks.sh"


class _Parsed(Exception):
    def __init__(self, namespace):
        super().__init__()
        self.namespace = namespace


def _benchmark_commands(script: str) -> list:
    """(benchmark name, its arguments) of each `python benchmarks/NAME.py ...` the script runs,
    a loop's specs put in for its "$1" "$2"."""
    text = re.sub(r"\\\n\s*", " ", script)  # (continued lines)
    specs = {}
    for loop in re.finditer(r"for spec in ((?:\"[^\"]*\"\s*)+); do(.*?)\ndone", text, re.S):
        for spec in shlex.split(loop.group(1)):
            specs.setdefault(loop.group(2), []).append(spec.split())
    found = []
    for match in re.finditer(r"python (benchmarks/(\w+)\.py)([^|;}\n]*?)(?:2>&1|\||;|}|\n)", text):
        arguments = match.group(3)
        body = next((b for b in specs if match.group(0) in b), None)
        for values in (specs[body] if body is not None else [[]]):
            filled = arguments.replace('"$1"', values[0]).replace('"$2"', values[1]) if values else arguments
            found.append((match.group(2), shlex.split(filled)))
    return found


def test_the_gpu_checks_run_every_benchmark_with_arguments_it_takes(monkeypatch):
    # A lent GPU has 15 minutes a session: a flag, model or variant a benchmark no longer takes
    # would spend them on an error. Each command's arguments are parsed by its own parser here.
    import argparse
    import importlib

    commands = _benchmark_commands(GPU_CHECKS.read_text())
    assert {name for name, _ in commands} >= {"overhead", "attribute", "row_cost", "ddp_overhead",
                                             "sentinel_where", "profile_step"}
    overhead = importlib.import_module("overhead")
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    for name, arguments in commands:
        module = importlib.import_module(name)
        monkeypatch.setattr(sys, "argv", [f"{name}.py", *arguments])
        try:
            module.main()
        except _Parsed as parsed:
            options = parsed.namespace
        else:
            raise AssertionError(f"{name} ran without parsing its arguments")
        if getattr(options, "models", None):
            assert set(options.models.split(",")) <= set(overhead.BUILDERS), (name, options.models)
        if name == "attribute":
            assert options.model in overhead.BUILDERS
            assert set(options.variants.split(",")) <= set(attribute.VARIANTS), options.variants


def test_the_lean_floor_reads_each_pass_once_and_sees_a_nan_made_in_it():
    # A floor that skipped its work would make any rework of full mode look free: it writes and
    # reads its rows, each pass once, and a nan a weight puts in a pass reaches its scan.
    import torch
    from lean_floor import LeanFloor

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    floor = LeanFloor(model)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    assert (floor.passes_read, floor.nonfinite_passes) == (2, 0)
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    model(x).sum().backward()
    assert (floor.passes_read, floor.nonfinite_passes) == (4, 2)
    floor.detach()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
