"""The optimizer the user's training would build, rebuilt over the doctor's copy of the model.

A recipe is a function of the copy (the optimizer must hold the copy's parameters, not the
user's): the user's optimizer rebuilt (same class and param-group hyperparameters, fresh
state), the one a Trainer would create, or SGD when there is none.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .._util import error_line
from .checklist import format_number

__all__ = ["OptimizerPlan", "OptimizerRecipe", "sgd_recipe", "rebuild_recipe", "trainer_recipe"]


@dataclass
class OptimizerPlan:
    """The optimizer built over the copy, as the user's training would build it."""

    optimizer: torch.optim.Optimizer | None  # None when it would hold none of the model's parameters
    description: str
    foreign_tensor_count: int = 0  # tensors the user's optimizer holds that are not the model's


# Builds the plan over the model copy, whose parameters the optimizer must hold.
OptimizerRecipe = Callable[[nn.Module], OptimizerPlan]


def sgd_recipe(lr: float, reason: str) -> OptimizerRecipe:
    """Plain SGD over the copy's trainable parameters; ``reason`` says why it stands in."""

    def recipe(model: nn.Module) -> OptimizerPlan:
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trainable, lr=lr) if trainable else None
        return OptimizerPlan(optimizer, f"SGD(lr={lr:g}), used as {reason}")

    return recipe


def rebuild_recipe(model: nn.Module, optimizer: torch.optim.Optimizer, whose: str) -> OptimizerRecipe:
    """The same optimizer class and param-group hyperparameters, fresh state, over the copy."""

    def recipe(copied: nn.Module) -> OptimizerPlan:
        # deepcopy keeps the parameter order, so the i-th parameters correspond.
        counterpart = {id(p): q for p, q in zip(model.parameters(), copied.parameters())}
        groups, foreign = [], 0
        for group in optimizer.param_groups:
            params = [counterpart[id(p)] for p in group["params"] if id(p) in counterpart]
            foreign += len(group["params"]) - len(params)
            if params:
                hyperparameters = {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
                # A scheduler may have decayed lr to 0 by the end of a run: check with the lr it started from.
                hyperparameters["lr"] = hyperparameters.get("initial_lr", hyperparameters.get("lr"))
                groups.append({**hyperparameters, "params": params})
        optimizer_class = type(optimizer)
        if not groups:
            return OptimizerPlan(None, optimizer_class.__name__, foreign)
        accepted = inspect.signature(optimizer_class.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        # defaults may hold entries the constructor does not take (AdamW's decoupled_weight_decay).
        defaults = {key: value for key, value in optimizer.defaults.items() if takes_any or key in accepted}
        try:
            rebuilt = optimizer_class(groups, **defaults)
        except TypeError:  # a constructor taking more (a wrapper's inner class): a copy over the copy
            rebuilt = copy.deepcopy(optimizer, {id(p): counterpart[id(p)] for p in model.parameters()})
            rebuilt.state.clear()  # (fresh, as a rebuilt one's, at the lr it started from)
            for group in rebuilt.param_groups:
                group["lr"] = group.get("initial_lr", group["lr"])
        scheduled = ", the schedule's initial lr" if "initial_lr" in groups[0] else ""
        lr = format_number(groups[0]["lr"])
        description = f"{optimizer_class.__name__}(lr={lr}{scheduled}), rebuilt from {whose}"
        return OptimizerPlan(rebuilt, description, foreign)

    return recipe


def _unwrapped_optimizer(optimizer: Any) -> Any:
    # accelerate wraps the Trainer's optimizer once training has started; the real one is inside.
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def trainer_recipe(trainer) -> OptimizerRecipe:
    """The Trainer's optimizer rebuilt; before training made one, the one it would make (SGD at
    its learning rate where that cannot be built here)."""
    if trainer.optimizer is not None:
        return rebuild_recipe(trainer.model, _unwrapped_optimizer(trainer.optimizer), "the Trainer's")
    args = trainer.args
    optim_name = getattr(args.optim, "value", args.optim)

    def recipe(copied: nn.Module) -> OptimizerPlan:
        try:
            optimizer = _trainer_optimizer(trainer, copied)
        except Exception as error:  # e.g. bitsandbytes missing: any optimizer shows the wiring works
            reason = f"the Trainer's {optim_name} cannot be rebuilt here ({error_line(error)})"
            return sgd_recipe(args.learning_rate, reason)(copied)
        lr = format_number(optimizer.param_groups[0]["lr"])
        description = f"{type(optimizer).__name__}(lr={lr}), built as the Trainer does (optim={optim_name})"
        return OptimizerPlan(optimizer, description)

    return recipe


def _trainer_optimizer(trainer, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``Trainer.create_optimizer`` would build over ``model``, without touching the Trainer."""
    if trainer.optimizer_cls_and_kwargs is not None:
        optimizer_class, kwargs = trainer.optimizer_cls_and_kwargs
    else:
        optimizer_class, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
    special = {"params", "model", "optimizer_dict"} & set(kwargs)
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)) or special:
        raise ValueError("it builds its own parameter groups")
    decay = set(trainer.get_decay_parameter_names(model))
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for name, p in trainable if name in decay], "weight_decay": trainer.args.weight_decay},
        {"params": [p for name, p in trainable if name not in decay], "weight_decay": 0.0},
    ]
    return optimizer_class([group for group in groups if group["params"]], **kwargs)

