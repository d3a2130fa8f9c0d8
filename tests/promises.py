"""The guard's promises, as checks any test can make: nothing left behind, nothing changed.

- `hooks_left(...)`: every hook numguard_nb could have left on modules (their own and the global
  ones), on tensors (parameters, buffers, any tensor given) and on optimizers (theirs and the
  global ones). A test takes the list before a guarded run and asserts it is the same after.
- `same_run(run)`: runs `run()` twice from the same seed and compares everything it returns
  (outputs, gradients, buffers, RNG state) bit for bit; a test calls it with and without a guard.
- `memory_growth(step, steps)`: bytes still allocated by Python after `steps` more calls of
  `step` than a warm-up, for loops that must stay flat.
- `sentinel_steps_without_sync(model, loss_of)`: sentinel training steps on a GPU in which any
  host synchronisation raises.
"""

from __future__ import annotations

import gc
import tracemalloc

import torch
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks
from torch import nn

_MODULE_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_backward_hooks",
    "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)
_GLOBAL_MODULE_HOOKS = (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
    "_global_backward_hooks", "_global_backward_pre_hooks", "_global_buffer_registration_hooks",
    "_global_module_registration_hooks", "_global_parameter_registration_hooks",
)
_OPTIMIZER_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")


def _tensor_hooks(name: str, tensor) -> list:
    found = []
    if not isinstance(tensor, torch.Tensor):
        return found
    for attribute in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(tensor, attribute, None)
        if hooks:
            found += [f"{name}.{attribute}: {hook!r}" for hook in hooks.values()]
    return found


def hooks_left(*modules: nn.Module, optimizers=(), tensors=()) -> list:
    """A description of every hook on `modules` (and their submodules, parameters and buffers),
    on `tensors`, on `optimizers` and in torch's global module and optimizer hook registries."""
    found = []
    for root in modules:
        for name, module in root.named_modules():
            for attribute in _MODULE_HOOK_DICTS:
                hooks = getattr(module, attribute, None) or {}
                found += [f"{name or '<root>'}.{attribute}: {hook!r}" for hook in
                          (hooks.values() if isinstance(hooks, dict) else hooks)]
        for name, tensor in list(root.named_parameters()) + list(root.named_buffers()):
            found += _tensor_hooks(name, tensor)
    for index, tensor in enumerate(tensors):
        found += _tensor_hooks(f"tensor{index}", tensor)
    for optimizer in optimizers:
        for attribute in _OPTIMIZER_HOOK_DICTS:
            found += [f"optimizer.{attribute}: {hook!r}" for hook in getattr(optimizer, attribute, {}).values()]
    for attribute in _GLOBAL_MODULE_HOOKS:
        found += [f"global {attribute}: {hook!r}" for hook in getattr(module_hooks, attribute, {}).values()]
    for attribute in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        found += [f"global {attribute}: {hook!r}" for hook in getattr(optimizer_hooks, attribute, {}).values()]
    return found


def _flatten(value, out: list) -> list:
    if isinstance(value, torch.Tensor):
        out.append(value.detach().clone())
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            _flatten(value[key], out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _flatten(item, out)
    else:
        out.append(value)
    return out


def bit_identical(a, b) -> bool:
    """Whether two results hold the same values bit for bit (nan equal to nan of the same bits)."""
    left, right = _flatten(a, []), _flatten(b, [])
    if len(left) != len(right):
        return False
    for x, y in zip(left, right):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            if x.is_floating_point():
                bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
                x, y = x.contiguous().view(bits), y.contiguous().view(bits)
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def same_run(run, seed: int = 0):
    """Run `run()` from `seed` and return what it returned with the RNG state after it, for
    comparing a guarded and an unguarded run with `bit_identical`."""
    torch.manual_seed(seed)
    result = run()
    return result, torch.get_rng_state()


def model_state(model: nn.Module) -> dict:
    """Parameters, their gradients and the buffers of a model, copied."""
    state = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    state.update({f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    state.update({f"buffer {n}": b.clone() for n, b in model.named_buffers()})
    return state


def memory_growth(step, steps: int, warmup: int = 50) -> int:
    """Bytes Python still holds after `steps` calls of `step()`, over what it held after `warmup`
    calls. Both counts are traced: what the first calls make once (caches, a mode's state) and
    what later calls put in its place is not growth."""
    gc.collect()
    tracemalloc.start()
    try:
        for _ in range(warmup):
            step()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(steps):
            step()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def sentinel_steps_without_sync(model, loss_of) -> None:
    """Four training steps (fused AdamW) under a sentinel and torch's sync detector in "error"
    mode from the second on (the first warms up): any host synchronisation raises."""
    from numguard_nb import Guard

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    with Guard(model, mode="sentinel"):
        for step in range(4):
            torch.cuda.set_sync_debug_mode("error" if step else "default")
            try:
                loss_of(model).backward()
                optimizer.step()
                optimizer.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
