"""How the run is parallelized (wire ``Layout``), read off the objects the training loop already has: the model
(DDP / FSDP / FSDP2 wrappers, DTensor parameters and their DeviceMesh, activation-checkpoint wrappers), a pipeline
schedule, a DeepSpeed config. Read once (at ``watch``), never per step; nothing raises: what cannot be read is left
out (``None`` on the wire), never guessed.
"""

from __future__ import annotations

import sys
from typing import Any

from trainer_hooks.collectives import role_of

# FSDP1 sharding strategies as ZeRO stages (the memory each saves): params, grads and optimizer state sharded = 3.
_FSDP1_ZERO = {"FULL_SHARD": 3, "HYBRID_SHARD": 3, "SHARD_GRAD_OP": 2, "_HYBRID_SHARD_ZERO2": 2, "NO_SHARD": 0}
_MAX_MODULES = 100_000  # a model with more modules is scanned that far: enough to find the wrappers


def from_mesh(mesh: Any) -> dict[str, Any]:
    """DeviceMesh dimensions (name -> size) and this rank's coordinate on each."""
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        return {}
    out: dict[str, Any] = {"mesh": {str(n)[:128]: int(s) for n, s in zip(names, mesh.shape, strict=False)}}
    coords = mesh.get_coordinate()
    if coords is not None:
        out["coords"] = {str(n)[:128]: int(c) for n, c in zip(names, coords, strict=False)}
    return out


def parallel_sizes(mesh: Any) -> dict[str, int]:
    """RunMeta.parallel from a mesh: sizes by role (dp_replicate x dp_shard multiply into dp)."""
    sizes: dict[str, int] = {}
    for name, size in zip(getattr(mesh, "mesh_dim_names", None) or (), mesh.shape, strict=False):
        role = role_of(str(name))
        if role in ("dp", "tp", "pp", "cp", "ep"):
            sizes[role] = sizes.get(role, 1) * int(size)
    return sizes


def meshes_of(model: Any) -> list[Any]:
    """The DeviceMeshes the model's DTensor parameters live on (FSDP2, tensor parallel), root meshes first seen."""
    found: list[Any] = []
    params = getattr(model, "parameters", None)
    if params is None:
        return found
    try:
        for p in params():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None and all(mesh is not m for m in found):
                found.append(mesh)
    except (TypeError, RuntimeError):
        return found
    return found


def from_model(model: Any) -> dict[str, Any]:
    """Strategy, ZeRO-like stage, offload and activation checkpointing from the model's wrappers."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(model, "modules"):
        return {}
    out: dict[str, Any] = {}
    kinds = _wrapper_kinds(torch)
    ckpt = False
    for i, module in enumerate(model.modules()):
        if i > _MAX_MODULES:
            break
        name = type(module).__name__
        if name == "CheckpointWrapper" or hasattr(module, "_checkpoint_wrapped_module") or _composable_checkpoint(module):
            ckpt = True
        if "strategy" in out and (out["strategy"] != "fsdp2" or "sharding" in out):
            continue
        if kinds.get("fsdp2") is not None and isinstance(module, kinds["fsdp2"]):
            out.update(_fsdp2(module))  # the root often holds no parameters: the next FSDP module tells its sharding
        elif kinds.get("fsdp") is not None and isinstance(module, kinds["fsdp"]):
            out.update(_fsdp1(module))
        elif kinds.get("ddp") is not None and isinstance(module, kinds["ddp"]):
            out.update(strategy="ddp", zero_stage=0)
    if ckpt or _hf_checkpointing(model):
        out["activation_checkpointing"] = True
    if "strategy" not in out and meshes_of(model):
        out["strategy"] = "model_parallel"  # DTensor parameters without an FSDP wrapper: tensor parallel
    return out


def _hf_checkpointing(model: Any) -> bool:
    """HF models say so themselves (``is_activation_checkpointing``; ``is_gradient_checkpointing`` before v5)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _wrapper_kinds(torch: Any) -> dict[str, Any]:
    kinds: dict[str, Any] = {"ddp": torch.nn.parallel.DistributedDataParallel}
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        kinds.update(fsdp2=FSDPModule, fsdp=FullyShardedDataParallel)
    except ImportError:
        pass
    return kinds


def _composable_checkpoint(module: Any) -> bool:
    # torch.distributed._composable.checkpoint marks the module's state instead of wrapping it.
    state = getattr(module, "__dict__", {}).get("_composable_state") or {}
    return any("checkpoint" in type(s).__name__.lower() for s in getattr(state, "values", lambda: [])())


def _fsdp2(module: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"strategy": "fsdp2", "zero_stage": 3}
    try:
        state = module._get_fsdp_state()
        group = state._fsdp_param_group
        if group is not None:
            # reshard_after_forward=False keeps the gathered parameters between forward and backward: ZeRO-2's memory.
            if group.post_forward_mesh_info is None:
                out["zero_stage"] = 2
            mesh_info = group.mesh_info
            out["sharding"] = "HYBRID_SHARD" if type(mesh_info).__name__ == "HSDPMeshInfo" else \
                "FULL_SHARD" if out["zero_stage"] == 3 else "SHARD_GRAD_OP"
            offload = type(group.offload_policy).__name__
            out["offload"] = offload == "CPUOffloadPolicy"
    except Exception:  # private attributes: a torch that moved them still gets the strategy
        pass
    return out


def _fsdp1(module: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"strategy": "fsdp"}
    strategy = getattr(module, "sharding_strategy", None)
    if strategy is not None:
        out["sharding"] = strategy.name[:32]
        out["zero_stage"] = _FSDP1_ZERO.get(strategy.name)
    offload = getattr(module, "cpu_offload", None)
    if offload is not None:
        out["offload"] = bool(getattr(offload, "offload_params", False))
    return out


def from_schedule(schedule: Any) -> dict[str, Any]:
    """A ``torch.distributed.pipelining`` schedule: its class and number of micro-batches."""
    out: dict[str, Any] = {"strategy": "pipeline", "pp_schedule": type(schedule).__name__[:64]}
    n = getattr(schedule, "_n_microbatches", None)
    if isinstance(n, int) and n >= 1:
        out["pp_microbatches"] = n
    return out


def from_deepspeed_config(config: dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config dict (``ds_config.json``, ``engine.config``, accelerate's ``deepspeed_plugin``).

    Values DeepSpeed leaves to be filled in ("auto") are left out."""
    out: dict[str, Any] = {"strategy": "deepspeed"}
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage")
    if isinstance(stage, int) and 0 <= stage <= 3:
        out["zero_stage"] = stage
    devices = [(zero.get(k) or {}).get("device") for k in ("offload_optimizer", "offload_param")]
    if zero:
        out["offload"] = any(d not in (None, "none") for d in devices)
    for key, field in (("gradient_accumulation_steps", "grad_accum"), ("train_micro_batch_size_per_gpu", "micro_batch")):
        value = config.get(key)
        if isinstance(value, int) and value >= 1:
            out[field] = value
    ckpt = config.get("activation_checkpointing")
    if isinstance(ckpt, dict) and ckpt:
        # The section configures deepspeed.checkpointing; the model still has to call it, so this says "set up".
        out["activation_checkpointing"] = True
    return out


def clean(layout: dict[str, Any]) -> dict[str, Any]:
    """Only the known fields, only set ones, within the wire's bounds."""
    out: dict[str, Any] = {}
    for key, value in layout.items():
        if value is None or key not in _FIELDS:
            continue
        if key in ("strategy", "sharding"):
            value = str(value)[:32]
        elif key == "pp_schedule":
            value = str(value)[:64]
        out[key] = value
    return out


_FIELDS = ("strategy", "mesh", "coords", "zero_stage", "offload", "activation_checkpointing", "grad_accum",
           "micro_batch", "sharding", "pp_schedule", "pp_microbatches")


# -- the framework adapters' views ------------------------------------------------------------------------------------

_LIGHTNING = {"DDPStrategy": "ddp", "FSDPStrategy": "fsdp", "DeepSpeedStrategy": "deepspeed",
              "ModelParallelStrategy": "model_parallel", "SingleDeviceStrategy": "single"}


def from_lightning(trainer: Any) -> dict[str, Any]:
    """The Lightning Trainer's strategy (DDP, FSDP, DeepSpeed, ModelParallel), gradient accumulation, micro-batch."""
    strategy = trainer.strategy
    name = type(strategy).__name__
    out: dict[str, Any] = {"strategy": _LIGHTNING.get(name, name.removesuffix("Strategy").lower()[:32])}
    if out["strategy"] == "ddp":
        out["zero_stage"] = 0
    elif out["strategy"] == "deepspeed" and isinstance(getattr(strategy, "config", None), dict):
        out.update(from_deepspeed_config(strategy.config))
    elif out["strategy"] == "fsdp":
        sharding = getattr(strategy, "sharding_strategy", None)
        if sharding is not None and hasattr(sharding, "name"):
            out["sharding"], out["zero_stage"] = sharding.name[:32], _FSDP1_ZERO.get(sharding.name)
        offload = getattr(strategy, "cpu_offload", None)
        if offload is not None:
            out["offload"] = bool(getattr(offload, "offload_params", offload))
        if getattr(strategy, "_activation_checkpointing_kwargs", None):
            out["activation_checkpointing"] = True
    accum = getattr(trainer, "accumulate_grad_batches", None)
    if isinstance(accum, int) and accum >= 1:
        out["grad_accum"] = accum
    return out


def lightning_mesh(trainer: Any) -> Any:
    """ModelParallelStrategy's DeviceMesh once set up, else None."""
    try:
        return getattr(trainer.strategy, "device_mesh", None)
    except (AttributeError, RuntimeError):  # the property raises before the strategy is set up
        return None


def from_hf(args: Any) -> dict[str, Any]:
    """The HF Trainer's arguments and accelerate's state: distributed type, FSDP / DeepSpeed plugin, ZeRO stage,
    offload, gradient checkpointing and accumulation."""
    out: dict[str, Any] = {}
    accum, micro = getattr(args, "gradient_accumulation_steps", None), getattr(args, "per_device_train_batch_size", None)
    if isinstance(accum, int) and accum >= 1:
        out["grad_accum"] = accum
    if isinstance(micro, int) and micro >= 1:
        out["micro_batch"] = micro
    if getattr(args, "gradient_checkpointing", False):
        out["activation_checkpointing"] = True
    out.update(from_accelerate())
    return out


def from_accelerate() -> dict[str, Any]:
    """accelerate's process-wide state, when an Accelerator exists (never creates one)."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return {}
    if not AcceleratorState._shared_state:
        return {}
    state = AcceleratorState()
    kind = str(getattr(state.distributed_type, "value", state.distributed_type))
    out: dict[str, Any] = {}
    if kind == "NO":
        out["strategy"] = "single"
    elif kind.startswith("MULTI_"):
        out.update(strategy="ddp", zero_stage=0)
    elif kind == "DEEPSPEED" and getattr(state, "deepspeed_plugin", None) is not None:
        config = getattr(state.deepspeed_plugin, "deepspeed_config", None) or {}
        out.update(from_deepspeed_config(config if isinstance(config, dict) else {}))
    elif kind == "FSDP" and getattr(state, "fsdp_plugin", None) is not None:
        plugin = state.fsdp_plugin
        out["strategy"] = "fsdp2" if getattr(plugin, "fsdp_version", 1) == 2 else "fsdp"
        sharding = getattr(plugin, "sharding_strategy", None)
        if sharding is not None and hasattr(sharding, "name"):
            out["sharding"], out["zero_stage"] = sharding.name[:32], _FSDP1_ZERO.get(sharding.name)
        offload = getattr(plugin, "cpu_offload", None)
        if offload is not None:
            out["offload"] = bool(getattr(offload, "offload_params", offload))
        if getattr(plugin, "activation_checkpointing", False):
            out["activation_checkpointing"] = True
    else:
        out["strategy"] = kind.lower()[:32]
    return out
