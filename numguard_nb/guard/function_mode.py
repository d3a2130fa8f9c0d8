"""A torch function mode's place on this thread's stack, and taking it off where torch itself
puts it back.

While a mode handles a call, torch holds it off the stack and pushes it back when the call
returns (`torch.overrides._pop_mode_temporarily`, or the C++ guard for builtin functions). A
mode that must leave from inside such a call (the guard detached by an `on_detect` raised from
a backward the mode runs) would otherwise be pushed back for good: `leave_when_put_back` takes
it off right after, before the user's code runs again.

    >>> if handling(HANDLER_CODES):
    ...     leave_when_put_back(MODE, HANDLER_CODES)
"""

from __future__ import annotations

import sys

import torch

__all__ = ["stack_len", "stack_at", "push", "pop", "handling", "leave_when_put_back"]

stack_len = torch._C._len_torch_function_stack
stack_at = torch._C._get_function_stack_at
push = torch._C._push_on_torch_function_stack
pop = torch._C._pop_torch_function_stack


def handling(handler_codes: frozenset) -> bool:
    """Whether this thread runs inside a mode's handler (one of `handler_codes`): looked up by
    frames, so only on rare paths."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in handler_codes:
            return True
        frame = frame.f_back
    return False


def leave_when_put_back(mode, handler_codes: frozenset) -> None:
    """Take `mode` off the stack as soon as torch puts it back at the end of the call its handler
    (the outermost frame of `handler_codes`) is handling: a one-shot profile function of this
    thread watches for that moment, calling a profile function set before it as that one was
    called, and setting it back after. It gives up when the frame that made the call returns
    without it (another mode stayed above). Under a C-level profiler (cProfile) nothing is done:
    the mode, passing everything through, leaves when its watch is collected."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code not in handler_codes:
        frame = frame.f_back
    while frame is not None and frame.f_code in handler_codes:
        frame = frame.f_back
    if frame is None:
        return
    caller = frame.f_back  # torch's dispatch (handle_torch_function), or the user's frame
    previous = sys.getprofile()
    if previous is not None and not callable(previous):
        return  # a C-level profiler (cProfile): left alone; the mode leaves with its watch

    def profile(frame_, event, arg):
        if previous is not None:  # a profiler's or a debugger's, called as before
            previous(frame_, event, arg)
        count = stack_len()
        done = bool(count and stack_at(count - 1) is mode)
        if done:
            pop()
        if (done or (event == "return" and frame_ is caller)) and sys.getprofile() is profile:
            sys.setprofile(previous)

    sys.setprofile(profile)
