"""The stateful objects a training loop registers with an executor
(``register_state(name, obj)``): LR schedulers, a data position, an EMA of the weights.

Note [Registered state]
Anything besides the model, the optimizer and the loss scaler that a training loop
steps along with the executor is part of the training state as well: a newcomer whose
LR scheduler starts at 0 trains with another learning rate than the members, silently.
A registered object's ``state_dict()`` goes into the executor's state (its
``"registered"`` entry, by name), and so into checkpoints and into the state a newcomer
receives on every join path (vflow.world.membership); loading calls its
``load_state_dict``. The names are agreed like the settings: a newcomer whose names
differ from the members' is refused, the message naming its names.

An object is loaded last, after the model and the optimizer (a scheduler reads the
optimizer's learning rates only when it steps, so the order does not matter to it), and
from a copy of the entry: ``load_state_dict`` of torch's schedulers adopts the dict's
lists and tensors as they are, which would tie two executors' objects together. Loading
is all or nothing: what the registered objects held before is kept, and put back should
any of them fail.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Protocol

from vflow.world.membership import Column

_MAX_NAME = 200


class Stateful(Protocol):
    """What ``register_state`` takes: torch's state-dict protocol."""

    def column(self) -> Column:
        """The names, for the agreement of a worker set (Note [Agreement]): a newcomer
        whose names differ is refused."""
        return Column("registered state", repr(self.names), f"register_state names {self.names}")

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def registered_from(objects: object, where: str = "registered_state") -> RegisteredState:
    """The objects an executor's constructor was given (``{name: obj}`` or None)."""
    registered = RegisteredState()
    if objects is None:
        return registered
    if not isinstance(objects, Mapping):
        raise TypeError(
            f"{where} must be a dict {{name: obj}} or None, got {type(objects).__name__}"
        )
    for name, obj in objects.items():
        registered.register(name, obj)
    return registered


class RegisteredState:
    """The named objects of one executor, in registration order."""

    def __init__(self) -> None:
        self._objects: dict[str, Stateful] = {}

    def register(self, name: object, obj: object) -> None:
        """Adds ``obj`` under ``name``; raises, adding nothing, on a name that is taken
        or not a plain string, or an object without ``state_dict`` and
        ``load_state_dict``."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if not name or len(name) > _MAX_NAME or not name.isprintable():
            raise ValueError(
                f"name must be a non-empty printable string of at most {_MAX_NAME} characters, "
                f"got {name!r}"
            )
        if name in self._objects:
            raise ValueError(
                f"name {name!r} is registered already (to a "
                f"{type(self._objects[name]).__name__}); each object needs a name of its own"
            )
        missing = [
            method
            for method in ("state_dict", "load_state_dict")
            if not callable(getattr(obj, method, None))
        ]
        if missing:
            raise TypeError(
                f"obj must have state_dict() and load_state_dict() (an LR scheduler, or any "
                f"object of torch's state-dict protocol); a {type(obj).__name__} has no "
                f"{' and no '.join(missing)}"
            )
        self._objects[name] = obj  # type: ignore[assignment]

    @property
    def names(self) -> list[str]:
        return list(self._objects)

    def column(self) -> Column:
        """The names, for the agreement of a worker set (Note [Agreement]): a newcomer
        whose names differ is refused."""
        return Column("registered state", repr(self.names), f"register_state names {self.names}")

    def state_dict(self) -> dict[str, Any]:
        """Every object's state by name; as with modules, the values may be live."""
        return {name: obj.state_dict() for name, obj in self._objects.items()}

    def check(self, saved: Any, where: str) -> None:
        """Raises unless ``saved`` (``where`` names it in messages) holds a state dict for
        exactly the registered names."""
        if not isinstance(saved, Mapping):
            raise TypeError(f"{where} must be a dict of state dicts, got {type(saved).__name__}")
        missing = [name for name in self._objects if name not in saved]
        unexpected = [name for name in saved if name not in self._objects]
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"lacks {missing}, which this executor registered")
            if unexpected:
                parts.append(f"has {unexpected}, which this executor did not register")
            raise ValueError(
                f"{where} {' and '.join(parts)}; register the same names "
                "(register_state) as the executor that wrote it"
            )
        for name, value in saved.items():
            if not isinstance(value, Mapping):
                raise TypeError(
                    f"{where}[{name!r}] must be a state dict, got {type(value).__name__}"
                )

    def snapshot(self) -> dict[str, Any]:
        """A private copy of every object's state, to put back with ``restore``."""
        return copy.deepcopy(self.state_dict())

    def load(self, saved: Mapping[str, Any]) -> None:
        """Loads a checked ``saved`` into the objects, from a copy of it."""
        for name, obj in self._objects.items():
            obj.load_state_dict(copy.deepcopy(dict(saved[name])))

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        for name, obj in self._objects.items():
            obj.load_state_dict(snapshot[name])
