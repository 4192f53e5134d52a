"""A small name -> object registry shared by backends, KD losses and loaders."""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Generic, List, Sequence, TypeVar, Union

from kd.errors import KDError, suggest

T = TypeVar("T")


class _Lazy:
    """Where a name's object lives ("package.module:attribute"), imported when first got."""

    def __init__(self, target: str):
        self.target = target

    def load(self):
        module, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module), attribute)


class Registry(Generic[T]):
    """Maps names to objects; refuses duplicates and lists valid names on a miss."""

    def __init__(self, kind: str, entry_point_group: str | None = None):
        self.kind = kind
        self.entry_point_group = entry_point_group
        self._items: Dict[str, Union[T, _Lazy]] = {}
        self._entry_points_loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            held = self._items.get(name)
            if held is not None and held is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            setattr(obj, "name", name)  # noqa: B010  (obj is a generic T: no `name` attribute to assign for a type checker)
            return obj

        return deco

    def register_lazy(self, name: str, target: str) -> None:
        """``name`` for the object at ``target`` ("package.module:attribute"), imported when first got:
        the name is known (to validation, to the CLI's choices) without importing its module."""
        held = self._items.get(name)
        if held is not None and not (isinstance(held, _Lazy) and held.target == target):
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = _Lazy(target)

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded or not self.entry_point_group:
            return
        self._entry_points_loaded = True
        from importlib.metadata import entry_points

        try:
            eps = entry_points(group=self.entry_point_group)
        except TypeError:  # Python < 3.10
            # Python 3.9's dict of groups; the (3.10+) stubs type only the EntryPoints form
            eps = entry_points().get(self.entry_point_group, [])  # type: ignore[arg-type]
        for ep in eps:
            if ep.name not in self._items:
                self.register(ep.name)(ep.load())

    def check(self, name: str, also: Sequence[str] = ()) -> str:
        """``name`` where it is registered or one of ``also`` (choices beside the registered ones,
        such as ``auto``); else a KDError naming the near names and every choice."""
        self._load_entry_points()
        if name not in self._items and name not in also:
            choices = [*also, *sorted(self._items)]
            raise KDError(f"unknown {self.kind} {name!r}{suggest(name, choices)}; choose from: {', '.join(choices)}")
        return name

    def get(self, name: str) -> T:
        item = self._items[self.check(name)]
        if isinstance(item, _Lazy):
            loaded = item.load()
            del self._items[name]
            item = self.register(name)(loaded)
        return item

    def names(self) -> List[str]:
        self._load_entry_points()
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        self._load_entry_points()
        return name in self._items
