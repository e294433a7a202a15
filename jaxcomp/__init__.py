"""jaxcomp: communication-compressed distributed training in JAX."""

from jaxcomp import comm, compressors, feedback
from jaxcomp.comm import measure_collectives
from jaxcomp.compressors import wire_bytes

__version__ = "0.1.0"

__all__ = ("comm", "compressors", "feedback", "measure_collectives", "wire_bytes")
