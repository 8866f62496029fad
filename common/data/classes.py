"""The federation's class list, and how a factory's folder names map onto it.

A label index is the position of a class *name* in the run's ordered class list, never the position
of a folder among whatever folders a factory happens to have: a factory without a `crack` folder and
one with it agree on what label 2 means. Folder names map by name, optionally through documented
aliases (``--class-alias good=ok``); a folder whose name fits nothing is refused when the agent
starts, naming the folder and the list.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from common.data.synth import CLASSES as DEFAULT_CLASSES

__all__ = ["DEFAULT_CLASSES", "ClassListError", "assign_folders", "format_classes", "label_map", "parse_aliases", "parse_classes"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")


class ClassListError(ValueError):
    """A class list or alias that cannot be used; the message says which and why."""


def parse_classes(value: str | Sequence[str]) -> tuple[str, ...]:
    """``"ok,scratch,crack"`` (the run-config form) or a sequence of names -> an ordered, checked tuple."""
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else [str(n).strip() for n in value]
    names = [n for n in names if n]
    if len(names) < 2:
        raise ClassListError(f"the class list needs at least two classes, got {names}")
    bad = [n for n in names if not _NAME.match(n)]
    if bad:
        raise ClassListError(f"class names {bad} must be 1-64 letters, digits, '_', '.', '+' or '-' (starting with a letter or digit)")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ClassListError(f"class names {duplicates} appear more than once in {names}")
    return tuple(names)


def format_classes(classes: Sequence[str]) -> str:
    """The run-config form of a class list."""
    return ",".join(classes)


def parse_aliases(pairs: Iterable[str] | Mapping[str, str]) -> dict[str, str]:
    """``["good=ok", "dent=pit"]`` -> ``{"good": "ok", "dent": "pit"}`` (folder name -> class name)."""
    if isinstance(pairs, Mapping):
        items = [(str(k), str(v)) for k, v in pairs.items()]
    else:
        items = []
        for pair in pairs:
            folder, sep, name = str(pair).partition("=")
            if not sep or not folder.strip() or not name.strip():
                raise ClassListError(f"class alias {pair!r} must look like FOLDER=CLASS (e.g. good=ok)")
            items.append((folder.strip(), name.strip()))
    aliases: dict[str, str] = {}
    for folder, name in items:
        if folder in aliases and aliases[folder] != name:
            raise ClassListError(f"folder {folder!r} is aliased to both {aliases[folder]!r} and {name!r}")
        aliases[folder] = name
    return aliases


def assign_folders(folders: Iterable[str], classes: Sequence[str], aliases: Mapping[str, str], where: str) -> dict[str, str]:
    """Map each folder name to a class name of ``classes`` (directly or through ``aliases``).

    Raises `ClassListError` naming the first folder that fits no class, the list and the aliases.
    Two folders may map to the same class (e.g. ``good`` and ``ok``); a class without a folder is fine.
    """
    known = set(classes)
    for folder, name in aliases.items():
        if name not in known:
            raise ClassListError(f"class alias {folder}={name}: {name!r} is not in the class list {list(classes)}")
    out = {}
    for folder in sorted(folders):
        name = aliases.get(folder, folder)
        if name not in known:
            hint = f" or aliases {dict(aliases)}" if aliases else ""
            raise ClassListError(
                f"{where}: folder {folder!r} is not a class of the class list {list(classes)}{hint}; "
                f"rename it, add --class-alias {folder}=<class>, or extend --classes"
            )
        out[folder] = name
    return out


def label_map(names: Sequence[str], classes: Sequence[str], where: str) -> dict[str, int]:
    """Label index of each of ``names`` in ``classes``; raises `ClassListError` if one is missing."""
    index = {c: i for i, c in enumerate(classes)}
    missing = [n for n in names if n not in index]
    if missing:
        raise ClassListError(f"{where} holds classes {missing} that are not in the run's class list {list(classes)}")
    return {n: index[n] for n in names}
