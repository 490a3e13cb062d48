"""Backend registry: built-in backends, third-party ones from the ``mla_verify.backends`` entry-point group.

An entry point names a ``Backend`` instance or a zero-argument factory returning one, e.g. in a plugin's
pyproject.toml::

    [project.entry-points."mla_verify.backends"]
    my-kernel = "my_pkg.mla:make_backend"

Listing backends never imports FlashInfer or FlashMLA (that happens when such a backend is asked about a CUDA
device or prepared), so the registry works on a CPU-only machine.

May import: core, problems. (tests/test_imports.py holds this rule.)
"""
from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import entry_points

from ..core.errors import UsageError, did_you_mean
from .base import Backend, Envelope, PreparedCall

ENTRY_POINT_GROUP = "mla_verify.backends"

__all__ = ["Backend", "Envelope", "PreparedCall", "ENTRY_POINT_GROUP", "builtin_backends", "all_backends",
           "get_backend", "named_backend", "requested_backends"]


def builtin_backends() -> list[Backend]:
    """Dense decode backends first, then the sparse (top-k) ones: each judged on its envelope's kind."""
    from .cpu_peer import cpu_peer_backend
    from .fa3_sparse import fa3_sparse_backend
    from .flashinfer_swa import swa_backend
    from .flashinfer_trtllm import flashinfer_sparse_backends, trtllm_backends
    from .flashinfer_wrapper import wrapper_backends
    from .flashmla import flashmla_backends
    from .flashmla_sparse import flashmla_sparse_backend

    return [*trtllm_backends(), *wrapper_backends(), swa_backend(), *flashmla_backends(),
            cpu_peer_backend(), flashmla_sparse_backend(), fa3_sparse_backend(), *flashinfer_sparse_backends()]


def _plugin_backends() -> list[Backend]:
    found = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        where = f"backend entry point '{ep.name}' ({ep.value})"
        try:
            obj = ep.load()
            backend = obj if isinstance(obj, Backend) else obj() if callable(obj) else obj
        except Exception as exc:  # a broken plugin is a configuration error, reported in one line
            raise UsageError(f"{where} failed to load: {type(exc).__name__}: {exc}") from None
        if not isinstance(backend, Backend):
            raise UsageError(f"{where} gave a {type(backend).__name__}, not a mla_verify Backend")
        found.append(backend)
    return found


def all_backends() -> dict[str, Backend]:
    """Every backend by name: built-ins first, then plugins (a plugin may not reuse a taken name)."""
    registry: dict[str, Backend] = {}
    for backend in [*builtin_backends(), *_plugin_backends()]:
        if backend.name in registry:
            raise UsageError(f"two backends are named '{backend.name}'; backend names must be unique")
        registry[backend.name] = backend
    return registry


def get_backend(name: str) -> Backend:
    registry = all_backends()
    if name not in registry:
        raise UsageError(f"unknown backend '{name}'{did_you_mean(name, registry)}; known: {', '.join(registry)}")
    return registry[name]


def named_backend(name: str, source: object = None) -> Backend:
    """The backend a run recorded by ``name``: a registered one, or a ``--kernel`` (``MODULE:ATTR``), loaded first
    from ``source``, where it was loaded from and, when it was named, the calling convention it was run with
    (Backend.source)."""
    from .user_kernel import load_kernel

    return load_kernel(name, recorded=source) if ":" in name else get_backend(name)


def requested_backends(names: Sequence[str] | None, kernels: Sequence[str] | None,
                       convention: str | None = None) -> list[Backend]:
    """The ``--kernel`` callables (called by ``convention``, else each one's signature's), else the ``--backend``
    names (each once), else every registered backend."""
    from .user_kernel import load_kernel

    if kernels:
        return [load_kernel(k, convention=convention) for k in kernels]
    return [get_backend(n) for n in dict.fromkeys(names)] if names else list(all_backends().values())
