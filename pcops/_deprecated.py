"""Renamed public keywords: the old name keeps working for one release with a ``FutureWarning``
(the version policy in CHANGELOG.md)."""

from __future__ import annotations

import functools
import warnings

import torch


def renamed(**old_to_new: str):
    """Decorate a function whose keyword ``old`` became ``new``: ``f(old=x)`` warns and calls ``f(new=x)``."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__qualname__}() got {old!r} and its new name {new!r}; pass only {new!r}")
                    if not torch.compiler.is_compiling():  # warned eagerly; a traced call is not broken by it
                        warnings.warn(f"{fn.__qualname__}(): the keyword {old!r} is renamed {new!r}; {old!r} will be removed in the next release",
                                      FutureWarning, stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return inner

    return wrap


def field(old: str, new: str, owner: str):
    """A read-only property ``old`` of a result type (a NamedTuple) whose field became ``new``:
    reading it warns and returns the new field."""

    def get(self):
        if torch.compiler.is_compiling():
            return getattr(self, new)
        warnings.warn(f"{owner}.{old} is renamed {owner}.{new}; {old!r} will be removed in the next release", FutureWarning, stacklevel=2)
        return getattr(self, new)

    return property(get, doc=f"Deprecated: the former name of ``{new}``.")
