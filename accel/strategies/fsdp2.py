"""FSDP2: torch's `fully_shard` over every process of the job, prepared as HF Accelerate's `_prepare_fsdp2` does.

Each process holds a shard of every parameter, gradient and optimizer state (DTensors over a 1-D mesh of all
processes); a wrapped block's parameters are all-gathered for its forward and backward, its gradients
reduce-scattered after. The collectives run on the job's default group: on CPU processes of one host that is
accel's shared-memory process group (HF refuses FSDP on CPUs), on GPUs NCCL. Hybrid sharding runs on a 2-D mesh
(dp_replicate, dp_shard): shards within each replica group, gradients all-reduced across replicas; it comes from a
`ParallelismConfig` (HF's way for FSDP2) or from FSDP1's HYBRID_SHARD / HYBRID_SHARD_ZERO2 (replicas = machines)
and NO_SHARD (every process a replica), and its sub-groups share memory too on one host.

What `prepare` does (HF's order): the auto-wrap policy is bound to the model (transformer layer classes, or a
parameter count), activation checkpointing wraps the matching blocks, trainable parameters are upcast to fp32 under
mixed precision (FSDP2 keeps fp32 master weights; `MixedPrecisionPolicy` casts for compute), `fully_shard` shards
the matching blocks bottom-up, then the input embedding and the tail (final norm, output head; tied embeddings stay
in one unit), then the root; the optimizer's parameters are switched to the sharded ones (any prepare order), and
the model is compiled last when dynamo is configured. An `fsdp_version=1` plugin runs on FSDP2 through the
translation `accel to-fsdp2` applies (`fsdp2_plugin`). With `cpu_ram_efficient_loading` only the main process
holds the weights: the model is sharded on the meta device and the shards are filled from the main process's state
dict, broadcast one tensor at a time (`take_main_process_weights`, `load_main_process_weights`).

Gradients are reduce-scattered at every backward, also while accumulating (as HF's FSDP2: accumulating unsharded
gradients would hold a full gradient per process). The fused clip reads this process's shards, sums the squares
across processes in one all-reduce and scales the shards; the fp16 scaler unscales the shards and takes the inf/nan
flag's maximum over processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from accel.backends import fsdp_options
from accel.backends.fsdp import FullyShardedDataParallelPlugin, get_parameters_from_modules
from accel.checkpoint.sharded import FullStates, ShardedStates
from accel.optimizer import AcceleratedOptimizer
from accel.strategies.base import Strategy, compile_model

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
        self.plugin, self._mesh_strategy = fsdp2_plugin(plugin)
        if mixed_precision != "no" and self.plugin.mixed_precision_policy is None:
            self.plugin.set_mixed_precision(mixed_precision)
        self.mixed_precision = mixed_precision
        self._sharded_of: dict[int, torch.nn.Parameter] = {}  # id(parameter before sharding) -> its sharded one
        self._optimizers: list[torch.optim.Optimizer] = []  # switched again when a later model is sharded
        # The mesh models are sharded over: None for FSDP's 1-D mesh of every process; a 2-D (dp_replicate,
        # dp_shard) one for hybrid sharding and NO_SHARD (built now, on every process: its groups are collective).
        self.mesh: DeviceMesh | None = fsdp_mesh(state, self._mesh_strategy)

    @classmethod
    def create(cls, state, precision, settings) -> FSDP2Strategy:
        return cls(state, precision, settings.fsdp_plugin or FullyShardedDataParallelPlugin(), settings.mixed_precision)

    # --- models -----------------------------------------------------------------------------------------------

    def setup_model(self, model: torch.nn.Module, device_placement: bool, dynamo_plugin: Any = None) -> torch.nn.Module:
        """As every strategy, but a model loaded RAM-efficiently is not placed: its parameters off the main process
        are on the meta device (`fully_shard` places the shards), as HF's FSDP2 prepare never moves the model."""
        placement = device_placement and not self.plugin.cpu_ram_efficient_loading
        return super().setup_model(model, placement, dynamo_plugin)

    def wrap(self, model: torch.nn.Module, dynamo_plugin: Any) -> torch.nn.Module:
        if isinstance(getattr(model, "_orig_mod", model), FSDPModule):
            return model  # prepared already
        if not dist.is_initialized():  # fully_shard would start a new default group itself, which never meets
            raise RuntimeError(
                "FSDP2 shards over the default process group, which was destroyed (end_training, or "
                "torch.distributed.destroy_process_group): prepare models in a new process"
            )
        before = _named_parameters(model)
        self.plugin.set_auto_wrap_policy(model)
        wraps = wrap_policy(self.plugin)
        if self.plugin.activation_checkpointing:
            apply_activation_checkpointing(model, wraps, offload=bool(self.plugin.activation_checkpointing_offload))
        if self.mixed_precision != "no":
            upcast_trainable_parameters(model)
        if self.plugin.cpu_ram_efficient_loading:
            self._shard_from_main_process(model, wraps)
        else:
            shard_model(model, wraps, self._fully_shard_kwargs(model))
        self._record_sharded(before, _named_parameters(model))
        return compile_model(model, dynamo_plugin)

    def _shard_from_main_process(self, model: torch.nn.Module, wraps: Callable[[torch.nn.Module], bool] | None) -> None:
        """cpu_ram_efficient_loading: the model is sharded on the meta device, then its shards are filled from the
        main process's weights (HF's order: `fully_shard` would otherwise copy the whole model into its shards)."""
        weights, tied = take_main_process_weights(model)
        kwargs = self._fully_shard_kwargs(model)  # taken now, the ignored parameters are the meta ones
        shard_model(model, wraps, kwargs)
        offload = isinstance(kwargs.get("offload_policy"), CPUOffloadPolicy)
        load_main_process_weights(model, weights, tied, self.device, cpu_offload=offload)

    def _fully_shard_kwargs(self, model: torch.nn.Module) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "reshard_after_forward": self.plugin.reshard_after_forward,
            "mp_policy": self.plugin.mixed_precision_policy or MixedPrecisionPolicy(),
            "mesh": self.mesh,
        }
        if self.plugin.cpu_offload is not None:
            kwargs["offload_policy"] = self.plugin.cpu_offload
            if self.device.type == "cpu" and getattr(self.plugin.cpu_offload, "pin_memory", False):
                # Pinned memory needs an accelerator; on CPU processes the shards live in CPU memory already.
                kwargs["offload_policy"] = dataclasses.replace(self.plugin.cpu_offload, pin_memory=False)
        if self.plugin.ignored_modules is not None:
            kwargs["ignored_params"] = get_parameters_from_modules(self.plugin.ignored_modules, model, self.device)
        return kwargs

    def _record_sharded(self, before: dict[str, torch.nn.Parameter], after: dict[str, torch.nn.Parameter]) -> None:
        missing = [name for name in before if name not in after]
        if missing:
            raise KeyError(
                f"FSDP2: parameters missing after sharding: {missing[:5]} (a model whose tied weights its "
                "checkpoint keeps apart? set model.config.tie_word_embeddings = False)"
            )
        self._sharded_of.update({id(param): after[name] for name, param in before.items()})
        for optimizer in self._optimizers:
            self._switch_parameters(optimizer)

    # --- optimizers -------------------------------------------------------------------------------------------

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool) -> AcceleratedOptimizer:
        """The optimizer over the sharded parameters (of a model prepared before it, or after it: it is switched
        then). Its state, if any, is moved along."""
        self._switch_parameters(optimizer)
        self._optimizers.append(optimizer)
        if type(optimizer) in _ELEMENTWISE_OPTIMIZERS:
            ShardStep(optimizer)
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
        """Summed over the processes that hold the other shards: on a 2-D mesh the replicas hold copies, which
        must not be counted again."""
        group = None if self.mesh is None else self.mesh.get_group(self.mesh.ndim - 1)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
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


# --- stepping on the shards -------------------------------------------------------------------------------------

# torch's optimizers whose update of an element reads only that element (of the parameter, its gradient and its
# state) and scalars: stepping each process's shard alone is the same update as stepping the whole DTensor. Exact
# types only (a subclass may step otherwise).
_ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class ShardStep:
    """Steps an elementwise optimizer on each process's local shards instead of on the DTensors.

    torch's optimizers over DTensors dispatch every op through DTensor (and leave the foreach kernels off: DTensor is
    not among their supported types); on CPU processes that costs more than the update itself (AdamW over a GPT-2's
    52 sharded parameters: ~60 ms against ~10 ms). A step pre-hook puts each sharded parameter's local tensor (its
    gradient: the gradient's local tensor) in its place in the parameter groups and the state's local tensors in
    the state; the post-hook puts the DTensors back, wrapping state the step created (as DTensors of the
    parameter's layout). Between steps the optimizer holds the DTensors, so state_dict and DCP see what they would
    without it. A step that raised is undone by the next step's pre-hook.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._swapped: list[tuple[dict, int, DTensor]] = []  # (parameter group, index, the DTensor put aside)
        self._dtensor_state: dict[DTensor, dict] = {}  # the state put aside, by parameter
        optimizer.register_step_pre_hook(self._to_shards)
        optimizer.register_step_post_hook(self._to_dtensors)

    def _to_shards(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._to_dtensors(optimizer, args, kwargs)  # a step that raised left its shards in place
        if any(group.get("differentiable") for group in optimizer.param_groups):
            return
        shard_of = {}
        for group in optimizer.param_groups:
            for index, param in enumerate(group["params"]):
                if isinstance(param, DTensor):
                    shard = param._local_tensor
                    shard.grad = None if param.grad is None else param.grad._local_tensor
                    shard_of[param] = group["params"][index] = shard
                    self._swapped.append((group, index, param))
        entries = list(optimizer.state.items())
        optimizer.state.clear()  # refilled in its order (the same dict: others may hold it)
        for key, values in entries:
            if key in shard_of:
                self._dtensor_state[key] = values
                key, values = shard_of[key], {name: _local(value) for name, value in values.items()}
            optimizer.state[key] = values

    def _to_dtensors(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._swapped:
            return
        param_of = {}
        for group, index, param in self._swapped:
            shard = group["params"][index]
            shard.grad = None
            param_of[shard] = group["params"][index] = param
        entries = list(optimizer.state.items())
        optimizer.state.clear()
        for key, values in entries:
            if key in param_of:
                key, before = param_of[key], self._dtensor_state.get(param_of[key], {})
                values = {name: _as_dtensor(value, before.get(name), key) for name, value in values.items()}
            optimizer.state[key] = values
        self._swapped, self._dtensor_state = [], {}


def _local(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value


def _as_dtensor(value: Any, before: Any, param: DTensor) -> Any:
    """A state value after a step on the shards, as the optimizer keeps it: the DTensor it was (stepped in place),
    a tensor the step created of the shard's shape as a DTensor laid out as `param`, anything else as it is."""
    if isinstance(before, DTensor) and before._local_tensor is value:
        return before
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape != param._local_tensor.shape:
        return value
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


# --- preparing a model ------------------------------------------------------------------------------------------


def fsdp2_plugin(plugin: FullyShardedDataParallelPlugin) -> tuple[FullyShardedDataParallelPlugin, str | None]:
    """`plugin` itself for FSDP2; an `fsdp_version=1` plugin translated to FSDP2 by the one rule `accel launch` and
    `accel to-fsdp2` apply (`accel.backends.fsdp_options.to_fsdp2`: the sharding strategy becomes
    reshard_after_forward, FSDP1-only options FSDP2 does without go, FULL_STATE_DICT stays the default), saying so
    in one line; what FSDP2 cannot do (BACKWARD_POST, LOCAL_STATE_DICT...) is refused. Also returns the FSDP1
    strategy that FSDP2 runs on a 2-D mesh (HYBRID_SHARD, HYBRID_SHARD_ZERO2, NO_SHARD), else None."""
    if plugin.fsdp_version == 2:  # a mesh strategy here is what `accel launch` exported for an FSDP1 configuration
        strategy = getattr(plugin.sharding_strategy, "name", plugin.sharding_strategy)
        return plugin, strategy if strategy in fsdp_options.MESH_STRATEGIES else None
    translation = fsdp_options.to_fsdp2(_fsdp1_options(plugin), _asked_by_plugin)
    options = translation.options
    policy = plugin.mixed_precision_policy
    translated = dataclasses.replace(
        plugin,
        fsdp_version=2,
        sharding_strategy=None,
        reshard_after_forward=options["fsdp_reshard_after_forward"],
        cpu_offload=bool(getattr(plugin.cpu_offload, "offload_params", False)),
        mixed_precision_policy=None
        if policy is None
        else {
            "param_dtype": policy.param_dtype,
            "reduce_dtype": policy.reduce_dtype,
            "output_dtype": policy.param_dtype,
        },
        state_dict_type=options["fsdp_state_dict_type"],
        backward_prefetch=None,
        use_orig_params=None,
        sync_module_states=None,
        forward_prefetch=None,
        param_init_fn=None,
        state_dict_config=None,
        optim_state_dict_config=None,
    )
    logger.warning("FSDP: fsdp_version 1 options run on FSDP2: %s", "; ".join(translation.changes))
    return translated, options.get("fsdp_sharding_strategy")


def fsdp_mesh(state: Any, mesh_strategy: str | None) -> DeviceMesh | None:
    """The mesh `fully_shard` gets: from a `ParallelismConfig` as HF builds it (its mesh becomes the state's
    `device_mesh`, `Accelerator.torch_device_mesh`, and FSDP takes its (dp_replicate, dp_shard_cp) dimensions), or
    from a translated FSDP1 strategy (`fsdp_mesh_shape`; the state's `device_mesh` too); None: the default 1-D
    mesh."""
    config = getattr(state, "parallelism_config", None)
    if config is not None and (config.dp_shard_enabled or config.dp_replicate_enabled):
        state.device_mesh = config.get_device_mesh(state.device.type)
        return state.device_mesh[tuple(config.fsdp_dim_names)]
    if mesh_strategy is None:
        return None
    from accel.backends.parallelism import init_mesh

    state.device_mesh = init_mesh(
        state.device.type, fsdp_mesh_shape(mesh_strategy, state.num_processes), ("dp_replicate", "dp_shard")
    )
    return state.device_mesh


def fsdp_mesh_shape(mesh_strategy: str, num_processes: int) -> tuple[int, int]:
    """(replicas, shards) of FSDP1's `mesh_strategy` on FSDP2: the hybrid ones shard within each machine (its
    processes, torch elastic's LOCAL_WORLD_SIZE) and replicate across machines, as FSDP1 does; NO_SHARD replicates
    on every process."""
    if mesh_strategy == "NO_SHARD":
        return num_processes, 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
    if local < 1 or num_processes % local:
        raise ValueError(
            f"FSDP {mesh_strategy}: {num_processes} processes do not split into machines of LOCAL_WORLD_SIZE={local}"
        )
    return num_processes // local, local


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


def apply_activation_checkpointing(
    model: torch.nn.Module, wraps: Callable[[torch.nn.Module], bool] | None, offload: bool
) -> None:
    """Recomputes the activations of every block that gets its own FSDP unit (optionally keeping the checkpointed
    inputs in CPU memory), as HF does before sharding."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

    if wraps is None:
        raise ValueError(
            "FSDP activation_checkpointing needs an auto-wrap policy (transformer layer classes or a "
            "minimum parameter count) naming the blocks to checkpoint"
        )
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
    tail = [
        m
        for m in ((final_norm(model), embed, head) if tied else (final_norm(model), head))
        if m is not None and not isinstance(m, FSDPModule)
    ]
    if tail:
        fully_shard(tail, **{**kwargs, "reshard_after_forward": False})
    if not isinstance(model, FSDPModule):
        fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})


def take_main_process_weights(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """For `cpu_ram_efficient_loading`: the main process's full state dict (other processes: empty; their weights,
    often on the meta device already, are never read), and the names of each group of tied parameters. The model's
    parameters are left on the meta device, so that `fully_shard` shards no data and no process but the main one
    ever holds a full copy (as HF moves the model to meta before sharding)."""
    weights = model.state_dict() if dist.get_rank() == 0 else {}
    names_by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_id.setdefault(id(param), []).append(name)
    on_meta: dict[int, torch.nn.Parameter] = {}  # one meta parameter per parameter: tied ones stay tied
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                if id(param) not in on_meta:
                    on_meta[id(param)] = torch.nn.Parameter(
                        torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
                    )
                module._parameters[name] = on_meta[id(param)]
    return weights, [names for names in names_by_id.values() if len(names) > 1]


def load_main_process_weights(
    model: torch.nn.Module,
    weights: dict[str, torch.Tensor],
    tied: list[list[str]],
    device: torch.device,
    cpu_offload: bool,
) -> None:
    """Fills the sharded model (its parameters on meta) from the main process's full state dict, broadcast one
    tensor at a time, each process keeping its shard (buffers and ignored parameters whole): a process other than
    the main one holds its shards and one full tensor at most. Loading assigns new parameters, one per name: tied
    parameters are tied again (as HF's `tie_weights` after loading)."""
    local = model.state_dict()
    _check_same_layout(local, device)
    loaded = {}
    for name, like in local.items():
        if dist.get_rank() == 0:
            full = weights.pop(name).detach().to(device)
        else:
            full = torch.empty(like.shape, dtype=like.dtype, device=device)
        dist.broadcast(full, src=0)
        shard = _shard_like(full, like)
        loaded[name] = shard.cpu() if cpu_offload else shard
    model.load_state_dict(loaded, assign=True)
    for names in tied:
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, shared)


def _check_same_layout(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Raises on every process, before any weight is sent, when a process's model differs from the main process's
    (names, shapes, dtypes of its state dict): its weights could not take the main process's."""
    layout = [(name, tuple(t.shape), t.dtype) for name, t in state.items()]
    main = [layout if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(main, src=0)
    difference = _first_difference(layout, main[0])
    differs = torch.tensor([difference is not None], dtype=torch.int32, device=device)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    if differs.item():
        raise ValueError(
            "FSDP cpu_ram_efficient_loading: the processes' models differ, so the main process's "
            f"weights cannot load into them: {difference or 'on another process'}"
        )


def _first_difference(ours: list[tuple], main: list[tuple]) -> str | None:
    for mine, theirs in zip(ours, main):
        if mine != theirs:
            return f"{mine} where the main process has {theirs}"
    if len(ours) != len(main):
        return f"{len(ours)} state dict entries, the main process's {len(main)}"
    return None


def _shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This process's shard of `full`, placed as `like` is (`full` itself when `like` is not sharded)."""
    if not isinstance(like, DTensor):
        return full
    view = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
    # Its own storage: a view would keep the whole tensor alive.
    return DTensor.from_local(view.clone(), like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


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
    return {
        name.replace(_CHECKPOINT_WRAPPED, "").removeprefix("_orig_mod."): param
        for name, param in model.named_parameters()
    }
