"""Putting shadow wrappers in the place of entry points, and taking them back.

A function is replaced wherever a module binds it -- its own module, every re-export (``flashinfer.decode``,
``flashinfer.mla``) and every ``from ... import`` an engine made before shadow mode started -- by scanning the
module dictionaries in ``sys.modules`` for that very object. A method is replaced on its class. References held
elsewhere (an attribute of an object, a ``functools.partial``, a list) are not seen; ``Installed.bindings``
says how many places were patched, and the session reports a kernel that no module binds.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any


@dataclass
class Installed:
    original: Callable[..., Any]
    wrapper: Callable[..., Any]
    owner: type | None = None  # the class of a method
    attr: str = ""
    bindings: int = 0  # module-level names (or 1 for a method) now bound to the wrapper
    places: list[tuple[dict, str]] = field(default_factory=list)
    added: tuple[dict, str] | None = None  # a name bound only for the session (see install_function)


def _module_dicts() -> list[dict]:
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict):
            found.append(namespace)
    return found


def _rebind(old: Any, new: Any) -> list[tuple[dict, str]]:
    """Bind ``new`` wherever a module binds ``old``; the (namespace, name) pairs changed."""
    changed = []
    for namespace in _module_dicts():
        for name, value in list(namespace.items()):
            if value is old:
                namespace[name] = new
                changed.append((namespace, name))
    return changed


def install_function(original: Callable[..., Any], wrapper: Callable[..., Any],
                     home: tuple[ModuleType, str] | None = None) -> Installed:
    """Wrap every module binding of ``original``. ``home`` (module, name): where the caller named it; a module
    that provides the name through ``__getattr__`` (not its dictionary) gets it bound for the session, so that
    a ``from module import name`` made while shadow mode is on gets the wrapper."""
    places = _rebind(original, wrapper)
    added = None
    if home is not None and home[1] not in vars(home[0]):
        vars(home[0])[home[1]] = wrapper
        added = (vars(home[0]), home[1])
    return Installed(original, wrapper, bindings=len(places) + (added is not None), places=places, added=added)


def install_method(owner: type, attr: str, wrapper: Callable[..., Any]) -> Installed:
    original = owner.__dict__[attr]
    setattr(owner, attr, wrapper)
    return Installed(original, wrapper, owner=owner, attr=attr, bindings=1)


def uninstall(installed: Installed) -> None:
    """Put the original back: on the class, or in every module that binds the wrapper now (modules imported
    while shadow mode was on included)."""
    if installed.owner is not None:
        if installed.owner.__dict__.get(installed.attr) is installed.wrapper:
            setattr(installed.owner, installed.attr, installed.original)
        return
    if installed.added is not None and installed.added[0].get(installed.added[1]) is installed.wrapper:
        del installed.added[0][installed.added[1]]
    _rebind(installed.wrapper, installed.original)
