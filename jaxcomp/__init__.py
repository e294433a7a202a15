"""jaxcomp: communication-compressed distributed training in JAX."""

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp.compressors import wire_bytes
from jaxcomp.comm import measure_collectives

__version__ = "0.1.0"

__all__ = ("comm", "compressors", "feedback", "measure_collectives", "wire_bytes")
