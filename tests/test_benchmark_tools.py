"""The diagnostic tools in benchmarks/ stay pointed at what they measure."""

from __future__ import annotations

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
    assert set(attribute.VARIANTS) - named == {"sentinel", "full", "full-forward-only"}
