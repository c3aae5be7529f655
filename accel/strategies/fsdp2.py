"""FSDP2: torch's `fully_shard` over every process of the job, prepared as HF Accelerate's `_prepare_fsdp2` does.

Each process holds a shard of every parameter, gradient and optimizer state (DTensors over a 1-D mesh of all
processes); a wrapped block's parameters are all-gathered for its forward and backward, its gradients
reduce-scattered after. The collectives run on the job's default group: on CPU processes of one host that is
accel's shared-memory process group (HF refuses FSDP on CPUs), on GPUs NCCL.

What `prepare` does (HF's order): the auto-wrap policy is bound to the model (transformer layer classes, or a
parameter count), activation checkpointing wraps the matching blocks, trainable parameters are upcast to fp32 under
mixed precision (FSDP2 keeps fp32 master weights; `MixedPrecisionPolicy` casts for compute), `fully_shard` shards
the matching blocks bottom-up, then the input embedding and the tail (final norm, output head; tied embeddings stay
in one unit), then the root; the optimizer's parameters are switched to the sharded ones (any prepare order), and
the model is compiled last when dynamo is configured. An `fsdp_version=1` plugin runs on FSDP2 through the
translation `accel to-fsdp2` applies (`fsdp2_plugin`).

Gradients are reduce-scattered at every backward, also while accumulating (as HF's FSDP2: accumulating unsharded
gradients would hold a full gradient per process). The fused clip reads this process's shards, sums the squares
across processes in one all-reduce and scales the shards; the fp16 scaler unscales the shards and takes the inf/nan
flag's maximum over processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from accel.backends import fsdp_options
from accel.backends.fsdp import FullyShardedDataParallelPlugin, get_parameters_from_modules
from accel.checkpoint.sharded import FullStates, ShardedStates
from accel.optimizer import AcceleratedOptimizer
from accel.strategies.base import Strategy, compile_model
from accel.unsupported import refuse

logger = logging.getLogger(__name__)

_CHECKPOINT_WRAPPED = "._checkpoint_wrapped_module"


class FSDP2Strategy(Strategy):
    """Every process holds a shard of the model, its gradients and its optimizer state (torch's FSDP2).

    Args:
        state: The process state.
        precision: The mixed-precision policy (autocast and fp16's scaler, as for DDP).
        plugin: HF's `FullyShardedDataParallelPlugin` (an `fsdp_version=1` one is translated to FSDP2).
        mixed_precision: The Accelerator's mixed precision: the parameter and reduction dtype of FSDP's
            `MixedPrecisionPolicy` unless the plugin gives one.
    """

    shards_gradients = True

    def __init__(self, state, precision, plugin: FullyShardedDataParallelPlugin, mixed_precision: str = "no"):
        super().__init__(state, precision)
        self.plugin = fsdp2_plugin(plugin)
        if self.plugin.cpu_ram_efficient_loading:
            raise refuse("FSDP cpu_ram_efficient_loading", "cpu_ram_efficient_loading=True (FSDP_CPU_RAM_EFFICIENT_LOADING)",
                         "load the weights on every process (the default)")  # fmt: skip
        if mixed_precision != "no" and self.plugin.mixed_precision_policy is None:
            self.plugin.set_mixed_precision(mixed_precision)
        self.mixed_precision = mixed_precision
        self._sharded_of: dict[int, torch.nn.Parameter] = {}  # id(parameter before sharding) -> its sharded one
        self._optimizers: list[torch.optim.Optimizer] = []  # switched again when a later model is sharded

    @classmethod
    def create(cls, state, precision, settings) -> FSDP2Strategy:
        return cls(state, precision, settings.fsdp_plugin or FullyShardedDataParallelPlugin(), settings.mixed_precision)

    # --- models -----------------------------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, dynamo_plugin: Any) -> torch.nn.Module:
        if isinstance(getattr(model, "_orig_mod", model), FSDPModule):
            return model  # prepared already
        if not dist.is_initialized():  # fully_shard would start a new default group itself, which never meets
            raise RuntimeError("FSDP2 shards over the default process group, which was destroyed (end_training, or "
                               "torch.distributed.destroy_process_group): prepare models in a new process")  # fmt: skip
        before = _named_parameters(model)
        self.plugin.set_auto_wrap_policy(model)
        wraps = wrap_policy(self.plugin)
        if self.plugin.activation_checkpointing:
            apply_activation_checkpointing(model, wraps, offload=bool(self.plugin.activation_checkpointing_offload))
        if self.mixed_precision != "no":
            upcast_trainable_parameters(model)
        shard_model(model, wraps, self._fully_shard_kwargs(model))
        self._record_sharded(before, _named_parameters(model))
        return compile_model(model, dynamo_plugin)

    def _fully_shard_kwargs(self, model: torch.nn.Module) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "reshard_after_forward": self.plugin.reshard_after_forward,
            "mp_policy": self.plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        }
        if self.plugin.cpu_offload is not None:
            kwargs["offload_policy"] = self.plugin.cpu_offload
        if self.plugin.ignored_modules is not None:
            kwargs["ignored_params"] = get_parameters_from_modules(self.plugin.ignored_modules, model, self.device)
        return kwargs

    def _record_sharded(self, before: dict[str, torch.nn.Parameter], after: dict[str, torch.nn.Parameter]) -> None:
        missing = [name for name in before if name not in after]
        if missing:
            raise KeyError(f"FSDP2: parameters missing after sharding: {missing[:5]} (a model whose tied weights its "
                           "checkpoint keeps apart? set model.config.tie_word_embeddings = False)")  # fmt: skip
        self._sharded_of.update({id(param): after[name] for name, param in before.items()})
        for optimizer in self._optimizers:
            self._switch_parameters(optimizer)

    # --- optimizers -------------------------------------------------------------------------------------------

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool) -> AcceleratedOptimizer:
        """The optimizer over the sharded parameters (of a model prepared before it, or after it: it is switched
        then). Its state, if any, is moved along."""
        self._switch_parameters(optimizer)
        self._optimizers.append(optimizer)
        return AcceleratedOptimizer(optimizer, device_placement=False, scaler=self.precision.scaler)

    def _switch_parameters(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            group["params"] = [self._sharded_of.get(id(p), p) for p in group["params"]]
        for old_id, new in self._sharded_of.items():
            old = next((p for p in list(optimizer.state) if id(p) == old_id), None)
            if old is not None:
                optimizer.state[new] = optimizer.state.pop(old)

    # --- gradients --------------------------------------------------------------------------------------------

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Nothing to skip: gradients are reduce-scattered at every backward (see the module docstring)."""
        return contextlib.nullcontext()

    def local_gradients(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return [g._local_tensor if isinstance(g, DTensor) else g for g in grads]

    def sharded(self, grads: list[torch.Tensor]) -> list[bool]:
        return [isinstance(g, DTensor) for g in grads]

    def sum_across_shards(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def max_across_shards(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    # --- state ------------------------------------------------------------------------------------------------

    def sharded_states(self) -> ShardedStates | FullStates:
        """How save_state / load_state write and read the models' and optimizers' state: sharded DCP folders
        (SHARDED_STATE_DICT, FSDP2's default) or HF's full files gathered onto the main process (FULL_STATE_DICT)."""
        from torch.distributed.fsdp import StateDictType

        return ShardedStates() if self.plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT else FullStates()

    def model_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """The full state dict, gathered shard by shard onto the main process's CPU (other processes get an
        empty dict); every process must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(getattr(model, "_orig_mod", model), options=options)


# --- preparing a model ------------------------------------------------------------------------------------------


def fsdp2_plugin(plugin: FullyShardedDataParallelPlugin) -> FullyShardedDataParallelPlugin:
    """`plugin` itself for FSDP2; an `fsdp_version=1` plugin translated to FSDP2 by the one rule `accel launch` and
    `accel to-fsdp2` apply (`accel.backends.fsdp_options.to_fsdp2`: the sharding strategy becomes
    reshard_after_forward, FSDP1-only options FSDP2 does without go, FULL_STATE_DICT stays the default), saying so
    in one line; what FSDP2 cannot do (hybrid sharding's 2-D mesh, NO_SHARD, BACKWARD_POST...) is refused."""
    if plugin.fsdp_version == 2:
        return plugin
    translation = fsdp_options.to_fsdp2(_fsdp1_options(plugin), _asked_by_plugin)
    fsdp_options.refuse_mesh_strategy(translation.options, _asked_by_plugin)
    options = translation.options
    policy = plugin.mixed_precision_policy
    translated = dataclasses.replace(
        plugin, fsdp_version=2, sharding_strategy=None, reshard_after_forward=options["fsdp_reshard_after_forward"],
        cpu_offload=bool(getattr(plugin.cpu_offload, "offload_params", False)),
        mixed_precision_policy=None if policy is None else {"param_dtype": policy.param_dtype,
                                                            "reduce_dtype": policy.reduce_dtype,
                                                            "output_dtype": policy.param_dtype},
        state_dict_type=options["fsdp_state_dict_type"], backward_prefetch=None, use_orig_params=None,
        sync_module_states=None, forward_prefetch=None, param_init_fn=None, state_dict_config=None,
        optim_state_dict_config=None,
    )  # fmt: skip
    logger.warning("FSDP: fsdp_version 1 options run on FSDP2: %s", "; ".join(translation.changes))
    return translated


def _fsdp1_options(plugin: FullyShardedDataParallelPlugin) -> dict[str, Any]:
    """The FSDP1 plugin's options as `fsdp_options` names them (what translates or is refused)."""
    strategy = plugin.sharding_strategy or plugin.reshard_after_forward
    options = {
        "fsdp_sharding_strategy": getattr(strategy, "name", strategy),
        "fsdp_backward_prefetch": getattr(plugin.backward_prefetch, "name", None),
        "fsdp_forward_prefetch": plugin.forward_prefetch,
        "fsdp_use_orig_params": plugin.use_orig_params,
        "fsdp_sync_module_states": plugin.sync_module_states,
        "fsdp_state_dict_type": getattr(plugin.state_dict_type, "name", plugin.state_dict_type),
    }
    return {key: value for key, value in options.items() if value is not None}


def _asked_by_plugin(key: str, value: Any) -> str:
    return f"FullyShardedDataParallelPlugin({key.removeprefix('fsdp_')}={fsdp_options.shown(value)})"


def wrap_policy(plugin: FullyShardedDataParallelPlugin) -> Callable[[torch.nn.Module], bool] | None:
    """Whether a submodule gets its own FSDP unit, from the plugin's bound auto-wrap policy (`set_auto_wrap_policy`):
    its transformer layer classes (seen through activation checkpointing's wrapper), or more parameters than
    `min_num_params`; None when nothing but the root is wrapped."""
    policy = plugin.auto_wrap_policy
    keywords = getattr(policy, "keywords", {})
    if "transformer_layer_cls" in keywords:
        classes = tuple(keywords["transformer_layer_cls"])
        if not classes:
            return None
        return lambda module: isinstance(getattr(module, "_checkpoint_wrapped_module", module), classes)
    if "min_num_params" in keywords:
        limit = keywords["min_num_params"]
        return lambda module: sum(p.numel() for p in module.parameters()) > limit
    return None


def apply_activation_checkpointing(model: torch.nn.Module, wraps: Callable[[torch.nn.Module], bool] | None,
                                   offload: bool) -> None:  # fmt: skip
    """Recomputes the activations of every block that gets its own FSDP unit (optionally keeping the checkpointed
    inputs in CPU memory), as HF does before sharding."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

    if wraps is None:
        raise ValueError("FSDP activation_checkpointing needs an auto-wrap policy (transformer layer classes or a "
                         "minimum parameter count) naming the blocks to checkpoint")  # fmt: skip
    for name, module in list(_children_bottom_up(model))[:-1]:
        if wraps(module):
            wrapped = checkpoint_wrapper(module, preserve_rng_state=False)
            model.set_submodule(name, offload_wrapper(wrapped) if offload else wrapped)


def upcast_trainable_parameters(model: torch.nn.Module) -> None:
    """FSDP2 needs one original dtype per unit: trainable parameters become fp32 master weights (the policy casts
    them for compute), as HF does under mixed precision."""
    upcast = [name for name, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32]
    for name, param in model.named_parameters():
        if name in upcast:
            param.data = param.data.to(torch.float32)
    if upcast:
        logger.info("FSDP: %d trainable parameters upcast to fp32 for mixed precision: %s", len(upcast), upcast[:5])


def shard_model(model: torch.nn.Module, wraps: Callable[[torch.nn.Module], bool] | None, kwargs: dict) -> None:
    """`fully_shard` on the blocks `wraps` picks (bottom-up), the input embedding, the tail (final norm and output
    head, kept gathered after forward: the backward starts there) and the root, as HF does."""
    if wraps is not None:
        for _, module in list(_children_bottom_up(model))[:-1]:
            if wraps(module) and not isinstance(module, FSDPModule):
                fully_shard(module, **kwargs)
    embed = _get(model, "get_input_embeddings")
    head = _get(model, "get_output_embeddings")
    tied = embed is not None and head is not None and getattr(embed, "weight", None) is getattr(head, "weight", 0)
    if embed is not None and not tied and not isinstance(embed, FSDPModule):
        fully_shard(embed, **kwargs)
    # Tied embeddings form one unit with the tail: a parameter may belong to one FSDP unit only.
    tail = [m for m in ((final_norm(model), embed, head) if tied else (final_norm(model), head))
            if m is not None and not isinstance(m, FSDPModule)]  # fmt: skip
    if tail:
        fully_shard(tail, **{**kwargs, "reshard_after_forward": False})
    if not isinstance(model, FSDPModule):
        fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})


def final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The last normalization layer among the base model's children (`transformer.ln_f`, `model.norm`)."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    if not isinstance(base, torch.nn.Module):
        return None
    norms = [module for _, module in base.named_children() if "Norm" in type(module).__name__]
    return norms[-1] if norms else None


def _get(model: torch.nn.Module, accessor: str) -> torch.nn.Module | None:
    try:
        return getattr(model, accessor, lambda: None)()
    except NotImplementedError:  # transformers' default for models without one
        return None


def _children_bottom_up(model: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Module]]:
    """(name, module) of every submodule, children before their parents, the root last."""
    order: list[tuple[str, torch.nn.Module]] = []

    def visit(name: str, module: torch.nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        order.append((name, module))

    visit("", model)
    return order


def _named_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters by their name in the user's model (activation checkpointing's and compile's wrappers left out)."""
    return {name.replace(_CHECKPOINT_WRAPPED, "").removeprefix("_orig_mod."): param
            for name, param in model.named_parameters()}  # fmt: skip
