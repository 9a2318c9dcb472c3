"""Who this process is in the run, and what the server needs to know about the run (wire ``RunMeta``).

Everything here is read once (or when it changes), never per step. Nothing raises: a value that cannot be read
is ``None``, as the wire format wants.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from typing import Any

import clusterdx

_IDENT_BAD = re.compile(r"[^A-Za-z0-9._:@/+-]")
_HOST_BAD = re.compile(r"[^A-Za-z0-9_.-]")


def ident(text: str, fallback: str = "run") -> str:
    """``text`` made into a wire ``Ident`` (what a run name or agent id must look like)."""
    out = _IDENT_BAD.sub("-", text.strip())[:128].lstrip("._:@/+-")
    return out or fallback


def hostname() -> str:
    """This machine's name as a wire ``Hostname`` (cloud names sometimes carry characters the wire refuses)."""
    name = _HOST_BAD.sub("-", socket.gethostname())[:253].lstrip(".-")
    return name or "localhost"


@dataclass(frozen=True)
class Identity:
    rank: int
    world_size: int
    local_rank: int | None
    source: str  # "torch.distributed", "torchrun", "slurm" or "default": says how far to trust it


def _env_int(env: dict[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def identity(env: dict[str, str] | None = None) -> Identity:
    """Rank and world size from torch.distributed when it is up, else torchrun's or Slurm's variables."""
    env = dict(os.environ) if env is None else env
    local = _env_int(env, "LOCAL_RANK")
    if local is None:
        local = _env_int(env, "SLURM_LOCALID")
    dist = _dist()
    if dist is not None:
        return Identity(dist.get_rank(), dist.get_world_size(), local, "torch.distributed")
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    if rank is not None and world is not None:
        return Identity(rank, world, local, "torchrun")
    rank, world = _env_int(env, "SLURM_PROCID"), _env_int(env, "SLURM_NTASKS")
    if rank is not None and world is not None:
        return Identity(rank, world, local, "slurm")
    return Identity(0, 1, local, "default")


def dist_initialized() -> bool:
    """Cheap enough to ask every step until the answer is yes."""
    return _dist() is not None


def _dist() -> Any:
    """torch.distributed when a process group is initialised, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


def default_run_name(env: dict[str, str] | None = None) -> str | None:
    """A name every rank of one job agrees on without talking: the scheduler's job id."""
    env = dict(os.environ) if env is None else env
    if env.get("CLUSTERDX_RUN"):
        return ident(env["CLUSTERDX_RUN"])
    if env.get("SLURM_JOB_ID"):
        return ident(f"slurm-{env['SLURM_JOB_ID']}")
    rdzv = env.get("TORCHELASTIC_RUN_ID", "")
    if rdzv and rdzv != "none":  # torchrun's default id is the literal "none"
        return ident(f"torchrun-{rdzv}")
    return None


# ---------------------------------------------------------------------------------------------------------------
# Environment variables that decide how NCCL and torch.distributed behave; drift between ranks is a finding.

_ENV_PREFIXES = (
    "NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCHELASTIC_", "CUDA_", "UCX_", "FI_", "GLOO_", "NVSHMEM_",
    "MASTER_", "SLURM_JOB_", "SLURM_NNODES", "SLURM_NTASKS", "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF",
    "TORCH_CPP_LOG_LEVEL", "LOCAL_WORLD_SIZE", "GROUP_RANK",
)
# Never ship something that looks like a credential, whatever its prefix.
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL|AUTH", re.IGNORECASE)
_MAX_ENV = 64  # the wire's Labels bound


def relevant_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """NCCL_* first (they matter most), then the rest, capped at the wire's 64 entries."""
    env = dict(os.environ) if env is None else env
    keys = sorted(k for k in env if k.startswith(_ENV_PREFIXES) and not _SECRET.search(k) and len(k) <= 128)
    keys.sort(key=lambda k: not k.startswith("NCCL_"))
    return {k: env[k][:1024] for k in keys[:_MAX_ENV]}


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "clusterdx": clusterdx.__version__}
    torch = sys.modules.get("torch")
    if torch is None:
        return out
    out["torch"] = str(torch.__version__)  # a str subclass; the wire wants str itself
    if torch.version.cuda:
        out["cuda"] = str(torch.version.cuda)
    if getattr(torch.version, "hip", None):
        out["hip"] = str(torch.version.hip)
    try:
        if torch.cuda.is_available():
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            cudnn = torch.backends.cudnn.version()
            if cudnn:
                out["cudnn"] = str(cudnn)
    except Exception:  # a broken CUDA install must not stop training; the version is simply unknown
        pass
    return out


def gpu_info(device: Any) -> dict[str, Any]:
    """Index, name, UUID and memory of the CUDA device this rank computes on (empty off CUDA)."""
    if device is None:
        return {}
    torch = sys.modules["torch"]
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    out: dict[str, Any] = {"gpu_index": index, "gpu_name": props.name[:96], "mem_total_bytes": props.total_memory}
    if uuid is not None:
        text = str(uuid)
        out["gpu_uuid"] = (text if text.startswith("GPU-") else f"GPU-{text}")[:96]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Peak dense FLOP/s by GPU and dtype (vendor datasheets, without structured sparsity), for MFU on the server.
# First match wins, so the more specific names come first. Missing dtype = not supported by the tensor cores.

_T = 1e12
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"GB200", {"fp8": 5000 * _T, "bf16": 2500 * _T, "fp16": 2500 * _T, "tf32": 1250 * _T}),
    (r"B200", {"fp8": 4500 * _T, "bf16": 2250 * _T, "fp16": 2250 * _T, "tf32": 1100 * _T}),
    (r"H200 NVL", {"fp8": 1671 * _T, "bf16": 835 * _T, "fp16": 835 * _T, "tf32": 418 * _T, "fp32": 60 * _T}),
    (r"H100 NVL", {"fp8": 1671 * _T, "bf16": 835 * _T, "fp16": 835 * _T, "tf32": 418 * _T, "fp32": 60 * _T}),
    (r"H100 PCIe", {"fp8": 1513 * _T, "bf16": 756 * _T, "fp16": 756 * _T, "tf32": 378 * _T, "fp32": 51 * _T}),
    # H100 SXM, H200 SXM and GH200 share the Hopper SXM peak.
    (r"H100|H200|GH200", {"fp8": 1979 * _T, "bf16": 989 * _T, "fp16": 989 * _T, "tf32": 494.5 * _T, "fp32": 67 * _T}),
    (r"A100", {"bf16": 312 * _T, "fp16": 312 * _T, "tf32": 156 * _T, "fp32": 19.5 * _T}),
    (r"L40S", {"fp8": 733 * _T, "bf16": 362 * _T, "fp16": 362 * _T, "tf32": 183 * _T, "fp32": 91.6 * _T}),
    (r"\bL40\b", {"fp8": 362 * _T, "bf16": 181 * _T, "fp16": 181 * _T, "tf32": 90.5 * _T, "fp32": 90.5 * _T}),
    (r"\bL4\b", {"fp8": 242 * _T, "bf16": 121 * _T, "fp16": 121 * _T, "tf32": 60 * _T, "fp32": 30.3 * _T}),
    (r"A6000", {"bf16": 154.8 * _T, "fp16": 154.8 * _T, "tf32": 77.4 * _T, "fp32": 38.7 * _T}),
    (r"\bA40\b", {"bf16": 149.7 * _T, "fp16": 149.7 * _T, "tf32": 74.8 * _T, "fp32": 37.4 * _T}),
    (r"\bA10G?\b", {"bf16": 125 * _T, "fp16": 125 * _T, "tf32": 62.5 * _T, "fp32": 31.2 * _T}),
    (r"V100.*PCI", {"fp16": 112 * _T, "fp32": 14 * _T}),
    (r"V100", {"fp16": 125 * _T, "fp32": 15.7 * _T}),
    (r"\bT4\b", {"fp16": 65 * _T, "fp32": 8.1 * _T}),
    (r"MI300X", {"fp8": 2615 * _T, "bf16": 1307 * _T, "fp16": 1307 * _T, "tf32": 653.7 * _T, "fp32": 163.4 * _T}),
    (r"MI250X?", {"bf16": 383 * _T, "fp16": 383 * _T, "fp32": 47.9 * _T}),
)
_PEAK_RE = tuple((re.compile(pattern), table) for pattern, table in PEAK_FLOPS)

_DTYPE_ALIASES = {
    "bfloat16": "bf16", "bf16": "bf16", "bf16-mixed": "bf16", "bf16-true": "bf16",
    "float16": "fp16", "half": "fp16", "fp16": "fp16", "16": "fp16", "16-mixed": "fp16", "16-true": "fp16",
    "float32": "fp32", "float": "fp32", "fp32": "fp32", "32": "fp32", "32-true": "fp32",
    "tf32": "tf32", "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "transformer-engine": "fp8",
}


def dtype_name(dtype: Any) -> str | None:
    """'bf16', 'fp16', 'fp32', 'tf32' or 'fp8' from a torch dtype, a string, or a Lightning precision flag."""
    if dtype is None:
        return None
    text = str(dtype).removeprefix("torch.").lower()
    return _DTYPE_ALIASES.get(text, text[:32])


def peak_flops(gpu_name: str | None, dtype: str | None) -> float | None:
    """The GPU's dense peak for ``dtype``; ``None`` when the GPU or dtype is not in the table (never a guess)."""
    if not gpu_name or not dtype:
        return None
    for pattern, table in _PEAK_RE:
        if pattern.search(gpu_name):
            return table.get(dtype)
    return None


# ---------------------------------------------------------------------------------------------------------------
# DataLoader settings, read off the object (torch's DataLoader or anything shaped like it).

_PATH_ATTRS = ("root", "path", "data_path", "data_dir", "dataset_path", "filename", "file", "files", "paths")


def dataset_path(dataset: Any, depth: int = 0) -> str | None:
    """The path a dataset reads from when it shows one (``root``, ``path``, ...); looks through wrappers."""
    if dataset is None or depth > 3:
        return None
    for attr in _PATH_ATTRS:
        value = getattr(dataset, attr, None)
        if isinstance(value, list | tuple) and value:
            value = value[0]
        if isinstance(value, str | os.PathLike) and str(value):
            return os.fspath(value)[:4096]
    return dataset_path(getattr(dataset, "dataset", None), depth + 1)  # Subset, ConcatDataset-like wrappers


def dataloader_info(loader: Any) -> dict[str, Any] | None:
    if not hasattr(loader, "num_workers"):
        return None  # a plain iterable: nothing to say
    sampler = getattr(loader, "batch_sampler", None) or getattr(loader, "sampler", None)
    sampler = getattr(sampler, "sampler", sampler)  # BatchSampler wraps the interesting one
    workers = int(loader.num_workers)
    info = {
        "batch_size": getattr(loader, "batch_size", None),
        "num_workers": workers,
        "pin_memory": bool(getattr(loader, "pin_memory", False)),
        # torch keeps prefetch_factor None with no workers: there is no prefetching then.
        "prefetch_factor": getattr(loader, "prefetch_factor", None) if workers else None,
        "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
        "sampler": type(sampler).__name__[:256] if sampler is not None else None,
        "dataset_path": dataset_path(getattr(loader, "dataset", None)),
    }
    return info


def count_params(model: Any) -> int | None:
    module = getattr(model, "module", model)  # DDP / FSDP wrappers keep the real module here
    try:
        return sum(p.numel() for p in module.parameters())
    except (AttributeError, TypeError):
        return None
