"""Training-loop hooks: per-rank step timing, data wait, communication time and run metadata for clusterdx.

Standard library and torch only; the framework adapters import their framework when first used::

    from trainer_hooks import Monitor                 # plain PyTorch
    from trainer_hooks import LightningCallback       # needs `pip install lightning`
    from trainer_hooks import HFCallback              # needs `pip install transformers`

See docs/training-hooks.md.
"""

from __future__ import annotations

from typing import Any

from trainer_hooks.meta import PEAK_FLOPS, peak_flops
from trainer_hooks.monitor import Monitor
from trainer_hooks.timing import CpuClock, CudaClock, FinishedStep, StepTimer

__all__ = ["PEAK_FLOPS", "CpuClock", "CudaClock", "FinishedStep", "HFCallback", "LightningCallback", "Monitor", "StepTimer",
           "peak_flops"]

_ADAPTERS = {"LightningCallback": "trainer_hooks.lightning", "HFCallback": "trainer_hooks.hf"}


def __getattr__(name: str) -> Any:
    # The adapters subclass their framework's callback class, so importing them imports the framework: only on use.
    if name in _ADAPTERS:
        import importlib

        return getattr(importlib.import_module(_ADAPTERS[name]), name)
    raise AttributeError(f"module 'trainer_hooks' has no attribute {name!r}")
