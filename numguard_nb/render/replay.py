"""The text and HTML views of a CPU replay: `ReplayResult` and `ReplayOutcome` (numguard_nb.replay).

The views read the result objects' attributes; they never import the replay. Both views are
made from one list of (style, text) lines, so they always say the same thing.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from .._util import dtype_name, error_line
from ._format import esc

Lines = List[Tuple[str, str]]  # (style, text); styles: head, section, error, info, code, note

_OK_COLOUR, _ERROR_COLOUR = "#2e7d32", "#c62828"


def value_outline(value) -> str:
    """What a value is, in a few words: 'tensor(float32, shape (6, 8))', 'dict(logits, loss)',
    'tuple of 2', 'int'."""
    if isinstance(value, torch.Tensor):
        return f"tensor({dtype_name(value.dtype)}, shape {tuple(value.shape)})"
    if isinstance(value, dict):
        return f"{type(value).__name__}({', '.join(str(k) for k in value)})"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


# ---- the lines --------------------------------------------------------------------------------
def _result_body(result) -> Lines:
    """The lines after the headline: where, which module, what was replayed."""
    lines = []
    if result.exception is not None:
        lines.append(("error", error_line(result.exception)))
        location = result.location
        if location is not None:
            fn = f" in {location.function}" if location.function else ""
            if location.kind == "raised":
                lines.append(("info", f"at {location.where}{fn}"))
            else:
                lines.append(("info", f"raised inside torch, in the call made at {location.where}{fn}"))
            if location.line:
                lines.append(("code", location.line))
        if result.module:
            lines.append(("info", f"raised in module {result.module}"))
        function = getattr(result, "function", None)
        if function is not None:
            lines.append(("info", f"raised in {function.name}, run outside the guarded modules"))
    else:
        lines.append(("info", _clean_words(result)))
    if result.replayed:
        lines.append(("info", f"replayed: {result.replayed}"))
    for note in result.notes:
        lines.append(("note", f"note: {note}"))
    return lines


def _clean_words(result) -> str:
    """Where the problem is when the replay ran clean: beyond what was recorded."""
    returned = f"it returned {value_outline(result.output)}"
    records = getattr(result.call, "outside", None)
    if not records:
        return (f"{returned}; the problem is elsewhere: an earlier call, or code outside the guarded "
                "modules")
    last = records[-1]
    return (f"{returned}, and the {len(records)} torch functions recorded after it ran clean too, the "
            f"last {last.name} at {last.where}; the problem is beyond what was recorded: in the "
            "backward, the optimizer step, or code run before the model call")


def _result_lines(result) -> Lines:
    if result.exception is not None:
        head = f"numguard replay on {result.device}: the call raised"
    else:
        head = f"numguard replay on {result.device}: the call ran clean"
    return [("head", head)] + _result_body(result)


def _outcome_lines(outcome) -> Lines:
    lines: Lines = []
    result = outcome.result
    if result is None:
        lines.append(("head", f"numguard: the captured call could not be replayed: {outcome.replay_error}"))
    elif result.exception is not None:
        lines.append(("head", f"numguard: replayed on {result.device}, the error is raised at the real line:"))
        lines.extend(_result_body(result))
    else:
        lines.append(("head", f"numguard: replayed on {result.device}, the captured call ran clean"))
        lines.extend(_result_body(result))
    for text in outcome.searched:
        lines.append(("note", f"note: {text}"))
    lines.append(("section", "The original error (reported late, so its traceback points at the wrong line):"
                  if outcome.device_error else "The original error:"))
    lines.append(("code", error_line(outcome.error)))
    if outcome.device_error:
        lines.append(("section", "The CUDA context is unusable after a device error: restart the "
                                 "kernel before using the GPU again."))
    if outcome.path is not None:
        lines.append(("section", f"Replay bundle: {outcome.path}"))
        lines.append(("info", "in a fresh kernel, build the model (any weights) and run:"))
        for command in outcome.replay_commands():
            lines.append(("code", command))
    elif outcome.save_error is not None:
        lines.append(("note", f"note: no replay bundle was written: {outcome.save_error}"))
    return lines


# ---- text and HTML ----------------------------------------------------------------------------
def _text(lines: Lines) -> str:
    indents = {"head": "", "section": "\n", "code": "      ", "error": "  "}
    return "\n".join(indents.get(style, "  ") + text for style, text in lines)


def _html(lines: Lines, ok: bool) -> str:
    colour = _OK_COLOUR if ok else _ERROR_COLOUR
    parts = [f'<div class="numguard-replay" style="font-family:monospace;border-left:4px solid {colour};'
             'padding:4px 8px">']
    for style, text in lines:
        text = esc(text)
        if style == "head":
            parts.append(f'<div style="font-weight:bold;color:{colour}">{text}</div>')
        elif style == "code":
            parts.append(f'<pre style="margin:2px 0 2px 2em">{text}</pre>')
        elif style == "section":
            parts.append(f'<div style="font-weight:bold;margin-top:6px">{text}</div>')
        elif style == "error":
            parts.append(f'<div style="margin-left:1em;font-weight:bold">{text}</div>')
        else:
            parts.append(f'<div style="margin-left:1em">{text}</div>')
    parts.append("</div>")
    return "".join(parts)


def replay_result_text(result) -> str:
    return _text(_result_lines(result))


def replay_result_html(result) -> str:
    return _html(_result_lines(result), ok=result.exception is None)


def replay_outcome_text(outcome) -> str:
    return _text(_outcome_lines(outcome))


def replay_outcome_html(outcome) -> str:
    ok = outcome.result is not None and outcome.result.exception is None
    return _html(_outcome_lines(outcome), ok=ok)
