"""A whole federation's image folders on one disk: how ``fedforge demo --folders`` and ``bench/quality.py --folders``
read ROOT, so that trying FedForge on your own images and measuring it on them see the same federation.

    ROOT/<factory>/train/<class>/*.png   one directory per factory (any name; sorted), its training images (or training/;
                                         these names, too, ignore case, ``-``, ``_`` and spaces: ``Training/``, ``Hold-Out/``);
                                         the factories may also sit in one folder of ROOT's (ROOT/sites/<factory>/train/...)
    ROOT/<factory>/test/<class>/*.png    images of that factory's own distribution, never trained on (or val/, valid/,
                                         validation/, holdout/)
    ROOT/<factory>/<class>/*.png         instead of the two: every 4th image of each class, in a fixed order (the SHA-256
                                         of its path), is held out as the factory's test set (`split_unsplit`); so is every
                                         4th of a training folder without a test folder beside it
    ROOT/test/<class>/*.png              optional: the central test set (or central_test/, global_test/, holdout/, eval/)
    ROOT/proxy/**/*.png                  optional: unlabelled public images of the domain (the run's proxy set; or public/,
                                         unlabeled/, unlabelled/)

or split first, the factories inside the splits (a factory without a test folder there is split as above):

    ROOT/train/<factory>/<class>/*.png   each factory's training images
    ROOT/test/<factory>/<class>/*.png    its own test images (or val/, ..., as above); beside them the central test set and
                                         the proxy set as above (then under another name than the factories' test folder's);
                                         any other folder of ROOT is not read, and the demo and the bench name it

ROOT may also hold one folder that holds all of this (an archive unpacked into ROOT). Folders starting with ``.`` are never
read. ROOT's folder names are compared ignoring case, ``-``, ``_`` and spaces
(``Central-Test`` is ``central_test``), so a folder other data sets write for the central test set or the proxy set is
never taken for a factory and trained on. The class list is every class folder's name (NFC; through the aliases, as
``--class-alias OK-parts=good`` maps a factory's folder), sorted, unless given; folders whose names differ only in case
(``OK`` at one factory, ``ok`` at another) are one class, spelt as most of them are (`_case_aliases`).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.data.classes import normalise_name, parse_aliases, parse_classes
from common.data.datasets import ImageDataset
from common.data.folder import (
    IMAGE_SUFFIXES,
    TEST_NAMES,
    TRAIN_NAMES,
    DatasetError,
    folder_key,
    has_image_files,
    image_files,
    load_image_folder,
    unread_files,
)
from common.data.images import COLOUR_CHROMA, DEFAULT_BIT_DEPTH, median_chroma

__all__ = ["CENTRAL_TEST_NAMES", "PROXY_NAMES", "TEST_NAMES", "TRAIN_NAMES", "UNSPLIT_TEST_SHARE", "FolderFederation", "split_unsplit"]

UNSPLIT_TEST_SHARE = 4  # a factory without the two folders: every 4th image of each class (in a fixed hash order) is its test set
# ROOT's folders that are not factories, by the names data sets commonly give them (compared by `folder_key`)
CENTRAL_TEST_NAMES = ("test", "tests", "test_set", "central_test", "global_test", "server_test", "holdout", "held_out", "eval",
                      "evaluation")
PROXY_NAMES = ("proxy", "proxy_set", "public", "public_set", "unlabeled", "unlabelled")


@dataclass(frozen=True)
class FolderFederation:
    """The factories under ROOT, each with its training and test folder, the central test folder and the proxy folder."""

    factories: tuple[Path, ...]
    central_test: Path | None
    classes: tuple[str, ...]
    proxy: Path | None = None
    trains: tuple[Path, ...] = ()  # each factory's training folder (in the order of `factories`)
    tests: tuple[Path, ...] = ()  # and its test folder
    split: tuple[str, ...] = ()  # the factories split here (no train/test folders of their own)
    split_root: Path | None = None  # where their split lives (links to their images)
    aliases: Mapping[str, str] = field(default_factory=dict)  # folder name -> class name, for every factory and test folder
    ignored: tuple[str, ...] = ()  # ROOT's folders that a split-first layout does not read (`describe_ignored`)

    @classmethod
    def at(cls, root: str | Path, classes: str = "", split_dir: str | Path | None = None,
           aliases: Mapping[str, str] | None = None) -> FolderFederation:
        """The federation under ``root`` (layout: the module doc); raises `DatasetError` naming what is missing. A factory
        folder that holds class folders directly is split (`split_unsplit`) into ``split_dir`` (default: a temporary directory)."""
        root = Path(root).absolute()  # its paths go to other processes, which may run elsewhere
        if not root.is_dir():
            raise DatasetError(f"{root} does not exist or is not a directory")
        work = Path(split_dir).resolve() if split_dir else None  # a work directory inside ROOT (the demo's) is no factory
        splits = _split_first(root)  # ROOT/train/<factory>/..., ROOT/test/<factory>/...: neither is the central test set
        if not splits and (inner := _wrapper(root, work)):  # ROOT/<one folder>/...: an archive unpacked into ROOT, say
            return cls.at(inner, classes, split_dir, aliases)
        def outside_work(d: Path) -> bool:  # a work directory inside ROOT (the demo's) is no factory and no unread folder
            return not (work and work.is_relative_to(d.resolve()))

        central = _reserved(root, "central test set", CENTRAL_TEST_NAMES, skip=splits)
        proxy = _reserved(root, "proxy set", PROXY_NAMES, skip=splits)
        ignored: tuple[str, ...] = ()
        if splits:
            factories, pairs = _factories_in_splits(*splits)
            ignored = tuple(d.name for d in _folders(root) if d not in (*splits, central, proxy) and outside_work(d))
        else:
            factories = tuple(d for d in _folders(root) if d not in (central, proxy) and outside_work(d))
            if len(factories) == 1 and _is_container(factories[0]):  # ROOT/factories/<factory>/train/...: one folder holding them all
                factories = tuple(_folders(factories[0]))
            pairs = [(_first_dir(d, TRAIN_NAMES), _first_dir(d, TEST_NAMES)) for d in factories]
        # a factory without a test folder: its training folder (or, without one either, the factory's folder) is split here
        unsplit = [i for i, (d, (train, test)) in enumerate(zip(factories, pairs)) if test is None and _folders(train or d)]
        split_root = Path(split_dir or tempfile.mkdtemp(prefix="fedforge-split-")).absolute() if unsplit else None
        for i in unsplit:
            pairs[i] = split_unsplit(pairs[i][0] or factories[i], split_root / factories[i].name)  # type: ignore[operator]
        missing = [f"{d}/{'|'.join(names)}" for d, pair in zip(factories, pairs) for names, part in zip((TRAIN_NAMES, TEST_NAMES), pair)
                   if part is None]
        if len(factories) < 2 or missing:
            flat = [d.name for d, pair in zip(factories, pairs) if pair == (None, None) and has_image_files(d)]
            raise DatasetError(f"{root}: expected two or more factory folders, each with train/ and test/ folders or only class folders"
                               + (f"; missing {missing}" if missing else f", found {[d.name for d in factories]}")
                               + (f"; {flat} hold images but no class folders: if they are unlabelled public images of the domain, "
                                  f"name the folder proxy/" if flat else ""))
        trains, tests = (tuple(p for p in part if p is not None) for part in zip(*pairs))
        if empty := [str(folder) for folder in (*trains, *tests) if not has_image_files(folder)]:
            found = "".join(f"; {folder}: {unread.describe(Path(folder))}" for folder in empty if (unread := unread_files(Path(folder))))
            raise DatasetError(f"{empty} hold no image files (expected <class>/<image>, formats {sorted(IMAGE_SUFFIXES)}){found}")
        # every class folder of the factories and of the central test set: a class no factory holds is still a class the
        # global model is tested on (and gets wrong), not a reason to refuse the run
        aliases = parse_aliases(aliases or {})
        folder_names = [normalise_name(c.name) for part in (*trains, *tests, *([central] if central else [])) for c in _folders(part)]
        if not classes:  # a class list given is the user's word; discovered, folders differing only in case are one class
            case = _case_aliases([aliases.get(n, n) for n in folder_names])
            aliases = {**case, **{folder: case.get(name, name) for folder, name in aliases.items()}}  # washer=Nut, Nut=nut: washer=nut
        found = sorted({aliases.get(n, n) for n in folder_names})
        return cls(factories, central, parse_classes(classes or found), proxy, trains, tests,
                   tuple(factories[i].name for i in unsplit), split_root, aliases, ignored)

    def alias_pairs(self) -> tuple[str, ...]:
        """The aliases as ``FOLDER=CLASS`` (`client.config.AgentConfig.class_alias`; every factory gets all of them: one
        without the folder ignores it)."""
        return tuple(f"{folder}={name}" for folder, name in sorted(self.aliases.items()))

    def alias_flags(self) -> list[str]:
        """The aliases as ``fedforge client`` flags."""
        return [flag for pair in self.alias_pairs() for flag in ("--class-alias", pair)]

    def case_clashes(self) -> str:
        """A line naming the folders taken as one class because their names differ only in case ('' if none; `at`), or,
        under a class list given with such names, the classes that then train apart."""
        merged = sorted(f"{folder}={name}" for folder, name in self.aliases.items() if folder != name and folder.casefold() == name.casefold())
        if merged:
            return (f"folders whose names differ only in case are one class ({', '.join(merged)}, as --class-alias would make them); "
                    "rename one to keep them apart")
        groups: dict[str, list[str]] = {}
        for name in self.classes:
            groups.setdefault(name.casefold(), []).append(name)
        clashes = [names for names in groups.values() if len(names) > 1]
        if not clashes:
            return ""
        first = clashes[0]
        return (f"classes {clashes} of the class list differ only in case and train as different classes; if they are one, "
                f"drop {first[1]!r} from it and add --class-alias {first[1]}={first[0]}")

    def no_public_images(self) -> str:
        """A line saying what DP loses without a proxy folder ('' with one): the factories then train the whole head."""
        if self.proxy is not None:
            return ""
        return ("no proxy folder of unlabelled public images (proxy/, public/ or unlabeled/), so under DP the factories train "
                "the whole head, far less accurately (docs/operations.md, \"Factories that train with DP\")")

    def describe_split(self) -> str:
        """A line saying which factories were split here and how ('' if none)."""
        if not self.split:
            return ""
        return (f"{list(self.split)} have no test folders of their own: every {UNSPLIT_TEST_SHARE}th image of each class is their test set "
                f"({self.split_root})")

    def describe_ignored(self) -> str:
        """A line naming ROOT's folders that are not read ('' if none). In a split-first layout the factories are inside its
        train and test folders, so any other folder of ROOT is not a factory; one meant as the central test set or the proxy
        set under another name would otherwise be dropped without a word."""
        if not self.ignored:
            return ""
        return (f"{list(self.ignored)} not read: beside the train and test folders that hold the factories, ROOT's folders are read only as the central "
                f"test set ({', '.join(n + '/' for n in CENTRAL_TEST_NAMES[2:6])} ...) or the proxy set ({', '.join(n + '/' for n in PROXY_NAMES[:3])} ...); "
                f"rename one to use it")

    def channels(self, sample: int = 32) -> int:
        """3 if any factory's training images are in colour, else 1: what ``--channels auto`` reads them as.

        A factory's images are colour when the median of its sampled images' mean chroma (max - min over R, G, B, at 32 px)
        exceeds `COLOUR_CHROMA`: grey images saved as RGB or JPEG have almost none. Grey images read as RGB give the
        backbone exactly the input grey gives it, so a federation with one colour factory loses nothing on its grey ones."""
        return 3 if any(median_chroma(image_files(folder), sample) > COLOUR_CHROMA for folder in self.trains) else 1

    def central_test_folder(self, out: Path) -> Path:
        """The central test set a server of this federation evaluates on, named by class (a server's folders take no
        aliases): ROOT/test as it is, or else a folder at ``out`` of links to ROOT/test's images, or without one to every
        factory's test images, in one folder per class."""
        if self.central_test is not None and not self.aliases:
            return self.central_test
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for f, folder in enumerate([self.central_test] if self.central_test is not None else self.tests):
            for class_dir in _folders(folder):
                name = self.aliases.get(normalise_name(class_dir.name), class_dir.name)
                for i, image in enumerate(image_files(class_dir)):
                    link = out / name / f"{f:03d}-{class_dir.name}-{i:06d}{image.suffix.lower()}"
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link.symlink_to(image.resolve())
        return out

    def test_set(self, folder: Path, size: int, channels: int, bit_depth: int = DEFAULT_BIT_DEPTH) -> ImageDataset:
        """A labelled folder decoded in memory, labelled by the federation's class list."""
        data, _report = load_image_folder(folder, size, self.classes, channels, aliases=self.aliases, bit_depth=bit_depth)
        return ImageDataset(data.images_at(np.arange(len(data))), np.asarray(data.labels), self.classes)


def _case_aliases(names: list[str]) -> dict[str, str]:
    """Class folder names (one entry per folder) that differ only in case, each mapped to the spelling most folders use
    (ties: the first in sorted order): "ok" at one factory and "OK" at two are the same parts to the people who named them,
    and on a case-blind file system (macOS, Windows) the two folders could not even sit side by side."""
    counts = Counter(names)
    spellings: dict[str, list[str]] = {}
    for name in counts:
        spellings.setdefault(name.casefold(), []).append(name)
    out = {}
    for group in spellings.values():
        if len(group) > 1:
            canonical = min(group, key=lambda n: (-counts[n], n))
            out |= {name: canonical for name in group if name != canonical}
    return out


def _folders(parent: Path) -> list[Path]:
    return [c for c in sorted(parent.iterdir()) if c.is_dir() and not c.name.startswith(".")]


def _reserved(root: Path, what: str, names: tuple[str, ...], skip: tuple[Path | None, ...] | None = None) -> Path | None:
    """ROOT's one folder named as one of ``names`` (None without one), other than ``skip`` (the splits that hold the
    factories); two are refused, naming them, rather than one of them being taken for a factory."""
    keys = {folder_key(n) for n in names}
    found = [d for d in _folders(root) if folder_key(d.name) in keys and d not in (skip or ())]
    if len(found) > 1:
        raise DatasetError(f"{root}: {[d.name for d in found]} could each be the {what}; keep one of them (or rename the others)")
    return found[0] if found else None


def _is_container(folder: Path) -> bool:
    """Whether ``folder`` holds the factories rather than being one (ROOT/sites/<factory>/train/...): two or more of its
    folders have a training folder of their own. A factory's class folders never do."""
    return sum(_first_dir(d, TRAIN_NAMES) is not None for d in _folders(folder)) >= 2


def _wrapper(root: Path, work: Path | None) -> Path | None:
    """ROOT's only folder when the federation is plainly inside it (ROOT/<one folder>/<factories, test, proxy>): it is split
    first, holds a central test or proxy folder, or two or more factories with training folders. A federation needs two
    factories, so one folder is never all of it; its factories, central test set and proxy set are found there as in ROOT,
    none taken for a factory. A single factory of class folders (with dated sub-folders, say) is not read as a federation
    of its classes: it is refused as one factory."""
    inside = [d for d in _folders(root) if not (work and work.is_relative_to(d.resolve()))]
    if len(inside) != 1:
        return None
    reserved = {folder_key(n) for n in (*CENTRAL_TEST_NAMES, *PROXY_NAMES)}
    inner = inside[0]
    marked = _split_first(inner) or any(folder_key(d.name) in reserved for d in _folders(inner)) or _is_container(inner)
    return inner if marked else None


def _split_first(root: Path) -> tuple[Path, Path | None] | None:
    """ROOT's training folder and the test folder beside it when they hold the factories (ROOT/train/<factory>/<class>/*):
    two or more of the training folder's folders hold class folders. In the usual layout ROOT has no training folder, and
    a training folder of one data set's classes holds images, not class folders. The test folder is the first of
    `TEST_NAMES` that holds a folder named as one of the factories (None: every factory is split, `split_unsplit`)."""
    train_keys, test_keys = [folder_key(n) for n in TRAIN_NAMES], [folder_key(n) for n in TEST_NAMES]
    train = next((d for d in _folders(root) if folder_key(d.name) in train_keys), None)
    if train is None or sum(_holds_class_folders(d) for d in _folders(train)) < 2:
        return None
    factories = {folder_key(d.name) for d in _folders(train)}
    tests = sorted((d for d in _folders(root) if folder_key(d.name) in test_keys), key=lambda d: test_keys.index(folder_key(d.name)))
    return train, next((d for d in tests if factories & {folder_key(f.name) for f in _folders(d)}), None)


def _factories_in_splits(train: Path, test: Path | None) -> tuple[tuple[Path, ...], list[tuple[Path, Path | None]]]:
    """The factories of a split-first ROOT, each with its training folder and its test folder (None: split it here). A test
    folder of a factory that has no training folder is refused, naming it: its images would otherwise be silently dropped."""
    factories = tuple(_folders(train))
    held_out = {folder_key(d.name): d for d in _folders(test)} if test else {}
    if orphans := sorted(set(held_out) - {folder_key(d.name) for d in factories}):
        raise DatasetError(f"{test}: {[held_out[k].name for k in orphans]} have no training folder in {train} (the factories are "
                           f"{[d.name for d in factories]})")
    return factories, [(d, held_out.get(folder_key(d.name))) for d in factories]


def _holds_class_folders(folder: Path) -> bool:
    """Whether ``folder`` is a factory's set of class folders: folders of its own, one of them holding images."""
    return any(has_image_files(d) for d in _folders(folder))


def _first_dir(parent: Path, names: tuple[str, ...]) -> Path | None:
    """``parent``'s folder named as the first of ``names`` it holds, compared as ROOT's names are (`folder_key`: ``Train``
    and ``Hold-Out`` are ``train`` and ``holdout``), None without one. Two that compare equal (``train`` and ``Train``) are
    refused, naming them: taking either would drop the other's images without a word."""
    by_key: dict[str, list[Path]] = {}
    for d in _folders(parent):
        by_key.setdefault(folder_key(d.name), []).append(d)
    for key in (folder_key(n) for n in names):
        if len(found := by_key.get(key, [])) > 1:
            raise DatasetError(f"{parent}: {[d.name for d in found]} could each be its {names[0]} folder; keep one of them")
        if found:
            return found[0]
    return None


def split_unsplit(factory: Path, out: Path) -> tuple[Path, Path]:
    """``factory/<class>/*`` -> ``out/train/<class>`` and ``out/test/<class>`` of links to its images: every
    `UNSPLIT_TEST_SHARE`-th image of a class, in the order of the SHA-256 of its path within the factory (the same split on
    every run, independent of the seeds), is a test image; a class of two or three images holds one out, of one none."""
    for part in ("train", "test"):
        shutil.rmtree(out / part, ignore_errors=True)
        (out / part).mkdir(parents=True)
    for class_dir in _folders(factory):
        images = image_files(class_dir)
        images.sort(key=lambda p: hashlib.sha256(p.relative_to(factory).as_posix().encode()).hexdigest())
        for i, image in enumerate(images):
            held_out = i % UNSPLIT_TEST_SHARE == UNSPLIT_TEST_SHARE - 1 or (i == 0 and 1 < len(images) < UNSPLIT_TEST_SHARE)
            link = out / ("test" if held_out else "train") / class_dir.name / f"{i:06d}{image.suffix.lower()}"
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(image.resolve())
    return out / "train", out / "test"
