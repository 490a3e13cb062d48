"""Backend registry: built-in backends, third-party ones from the ``mla_verify.backends`` entry-point group."""
from .base import Backend, Envelope, PreparedCall

__all__ = ["Backend", "Envelope", "PreparedCall"]
