"""accel: HF Accelerate's API with a native core. The public names, nothing else.

Names resolve on first use, so `accel config` and `accel env` start without importing torch. Submodules resolve
as attributes too (`import accel; accel.utils.gather`), imported when first touched.
"""

from accel._lazy import lazy_names

__version__ = "0.1.0"

_PUBLIC = {
    "Accelerator": "accel.accelerator",
    "AcceleratorState": "accel.state",
    "DistributedType": "accel.state",
    "GradientState": "accel.state",
    "PartialState": "accel.state",
    "AutocastKwargs": "accel.accelerator_config",
    "DDPCommunicationHookType": "accel.accelerator_config",
    "DataLoaderConfiguration": "accel.accelerator_config",
    "DistributedDataParallelKwargs": "accel.accelerator_config",
    "GradScalerKwargs": "accel.accelerator_config",
    "InitProcessGroupKwargs": "accel.accelerator_config",
    "ProfileKwargs": "accel.accelerator_config",
    "DeepSpeedPlugin": "accel.backends.deepspeed",
    "FullyShardedDataParallelPlugin": "accel.backends.fsdp",
    "ParallelismConfig": "accel.backends.parallelism",
    "cpu_offload": "accel.big_modeling",
    "cpu_offload_with_hook": "accel.big_modeling",
    "disk_offload": "accel.big_modeling",
    "dispatch_model": "accel.big_modeling",
    "init_empty_weights": "accel.big_modeling",
    "init_on_device": "accel.big_modeling",
    "infer_auto_device_map": "accel.big_modeling",
    "load_checkpoint_and_dispatch": "accel.big_modeling",
    "load_checkpoint_in_model": "accel.checkpoint",
    "debug_launcher": "accel.launchers",
    "notebook_launcher": "accel.launchers",
    "find_executable_batch_size": "accel.memory",
    "prepare_pippy": "accel.inference",
    "is_rich_available": "accel.utils",
    "skip_first_batches": "accel.data",
    "synchronize_rng_states": "accel.data",
}
__all__ = [*_PUBLIC, "__version__", "as_accelerate"]


__getattr__, __dir__ = lazy_names(__name__, _PUBLIC, also=("__version__", "as_accelerate"), submodules=True)


def as_accelerate() -> None:
    """Makes `import accelerate` (and every `accelerate.X`) resolve to accel in this process and the processes it
    starts, so libraries built on HF Accelerate (transformers' `Trainer`, TRL, PEFT) run on accel: the one-line
    form of `accel launch --as_accelerate` / `ACCEL_AS_ACCELERATE=1` for notebooks. Call it before anything
    imports `accelerate` (see accel.accelerate_alias).

    Example:
        ```python
        import accel; accel.as_accelerate()
        from transformers import Trainer  # trains on accel
        ```
    """
    from accel.accelerate_alias import install

    install()
