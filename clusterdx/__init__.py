"""clusterdx: live diagnostics for GPU clusters that train large models.

This small top-level package holds only what every part shares and that must import without Django or
torch: the wire format (:mod:`clusterdx.wire`) and the ``clusterdx`` command line (:mod:`clusterdx.cli`).
"""

__version__ = "0.1.0"
