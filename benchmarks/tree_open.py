"""How long the report of a real 24-layer transformer takes to open in the notebook.

    python benchmarks/tree_open.py

Traces one training step (forward + backward) of a 24-layer GPT-2 built from a config, then
times the three views a notebook shows: the widget tree (nodes built lazily, on expand), its
static HTML fallback, and Hugging Face's text format.
"""

from __future__ import annotations

import time

import torch


def main() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from numguard_nb import Guard
    from numguard_nb.render.html import report_html
    from numguard_nb.render.widget import ReportView, report_bundle

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=24, n_head=4))
    ids = torch.randint(0, 512, (2, 32))
    with Guard(model, trace_batches=[0]) as guard:
        model(input_ids=ids, labels=ids).loss.backward()
    report = guard.traces[0]
    print(f"24-layer GPT-2, one step traced: {len(report.frames)} frames, "
          f"{sum(len(f.rows) for f in report.frames)} tensor rows")
    for name, build in (
        ("widget tree + HTML fallback", lambda: report_bundle(report, view=ReportView(report))),
        ("static HTML alone", lambda: report_html(report)),
        ("text (Hugging Face format)", report.to_text),
    ):
        start = time.perf_counter()
        build()
        print(f"  {name}: {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
