"""The federation's class list, and how a factory's folder names map onto it.

A label index is the position of a class *name* in the run's ordered class list, never the position
of a folder among whatever folders a factory happens to have: a factory without a `crack` folder and
one with it agree on what label 2 means. Folder names map by name, optionally through documented
aliases (``--class-alias good=ok``); a folder whose name fits nothing is refused when the agent
starts, naming the folder and the list.

A class name is what a factory calls its folder, so it may hold spaces and letters of any script
("Scratch Mark", "Ölfleck"). Names compare in Unicode NFC form: a folder written by macOS (NFD) matches
the same name typed elsewhere. Only characters the run's plumbing gives a meaning are refused: ``,``
(separates the list), ``=`` (an alias), ``/`` and ``\\`` (paths), quotes (the Flower run-config's string
quoting) and control characters.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence

from common.data.synth import CLASSES as DEFAULT_CLASSES

__all__ = ["DEFAULT_CLASSES", "ClassListError", "assign_folders", "format_classes", "label_map", "name_problem", "normalise_name",
           "parse_aliases", "parse_classes"]

_FORBIDDEN = re.compile(r"[,=/\\\"'\x00-\x1f\x7f]")
_MAX_LENGTH = 64


def normalise_name(name: str) -> str:
    """The form class and folder names compare in: Unicode NFC, surrounding white space removed."""
    return unicodedata.normalize("NFC", str(name)).strip()


def name_problem(name: str) -> str:
    """Why ``name`` cannot be a class name ('' if it can)."""
    if not name or len(name) > _MAX_LENGTH:
        return f"must be 1-{_MAX_LENGTH} characters"
    if name.startswith("."):
        return "must not start with '.' (folders starting with '.' are hidden and never read)"
    if bad := sorted(set(_FORBIDDEN.findall(name))):
        return f"must not contain {', '.join(repr(c) for c in bad)} (a comma separates classes, '=' an alias; slashes, quotes and control characters are refused)"
    return ""


class ClassListError(ValueError):
    """A class list or alias that cannot be used; the message says which and why."""


def parse_classes(value: str | Sequence[str]) -> tuple[str, ...]:
    """``"ok,scratch,crack"`` (the run-config form) or a sequence of names -> an ordered, checked tuple."""
    names = [normalise_name(n) for n in (value.split(",") if isinstance(value, str) else value)]
    names = [n for n in names if n]
    if len(names) < 2:
        raise ClassListError(f"the class list needs at least two classes, got {names}")
    for name in names:
        if problem := name_problem(name):
            raise ClassListError(f"class name {name!r} {problem}")
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
            items.append((folder, name))
    aliases: dict[str, str] = {}
    for folder, name in ((normalise_name(f), normalise_name(n)) for f, n in items):
        if folder in aliases and aliases[folder] != name:
            raise ClassListError(f"folder {folder!r} is aliased to both {aliases[folder]!r} and {name!r}")
        aliases[folder] = name
    return aliases


def assign_folders(folders: Iterable[str], classes: Sequence[str], aliases: Mapping[str, str], where: str) -> dict[str, str]:
    """Map each folder name to a class name of ``classes`` (directly or through ``aliases``).

    Raises `ClassListError` naming the first folder that fits no class, the list and the aliases.
    Two folders may map to the same class (e.g. ``good`` and ``ok``); a class without a folder is fine.
    Names compare in NFC form (`normalise_name`); the keys of the result are the folder names as on disk.
    """
    known = {normalise_name(c) for c in classes}
    aliases = {normalise_name(f): normalise_name(n) for f, n in aliases.items()}
    for folder, name in aliases.items():
        if name not in known:
            raise ClassListError(f"class alias {folder}={name}: {name!r} is not in the class list {list(classes)}")
    out = {}
    for folder in sorted(folders):
        name = aliases.get(normalise_name(folder), normalise_name(folder))
        if name not in known:
            hint = f" or aliases {dict(aliases)}" if aliases else ""
            # a folder written in another case ("ok" for "OK") is the commonest slip: name the class it would be
            same = sorted(c for c in known if c.casefold() == name.casefold())
            fix = (f"if it holds {same[0]!r}, add --class-alias {folder}={same[0]} (or rename it)" if same
                   else f"rename it, add --class-alias {folder}=<class>, or extend --classes")
            raise ClassListError(f"{where}: folder {folder!r} is not a class of the class list {list(classes)}{hint}; {fix}")
        out[folder] = name
    return out


def label_map(names: Sequence[str], classes: Sequence[str], where: str) -> dict[str, int]:
    """Label index of each of ``names`` in ``classes``; raises `ClassListError` if one is missing."""
    index = {c: i for i, c in enumerate(classes)}
    missing = [n for n in names if n not in index]
    if missing:
        raise ClassListError(f"{where} holds classes {missing} that are not in the run's class list {list(classes)}")
    return {n: index[n] for n in names}
