"""A factory's data: where its images come from, and the train / held-out split a run trains on.

The agent learns *which* images it has when it starts (a folder is indexed and its class names are
checked then) and again when a new run begins (`FactoryData.refresh`: images copied in since are
trained on, without a restart); it learns *how* a run wants them (class list, image size, channels)
from the run's messages, and decodes them for that request once (`FactoryData.split`), keeping the last
request's split warm. A folder's held-out split is drawn per image from its path and the factory's seed
(`common.data.datasets.keyed_split`), so the same images are held out whatever size a run asks for, and
images added later never move an image from one split to the other.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from common.data import datasets, synth
from common.data.classes import ClassListError, label_map, parse_aliases, parse_classes
from common.data.datasets import ImageDataset, ImageSet, keyed_split, stratified_split
from common.data.folder import DatasetError, FolderIndex, FolderReport, index_image_folder, load_labelled
from common.data.images import COLOUR_CHROMA, DEFAULT_BIT_DEPTH, grey_to_channels, median_chroma

if TYPE_CHECKING:
    from client.config import AgentConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataRequest:
    """How a run wants a factory's images: its class list, image size and channel count."""

    classes: tuple[str, ...] = synth.CLASSES
    image_size: int = synth.DEFAULT_SIZE
    channels: int = 1

    def __post_init__(self) -> None:
        if not 8 <= self.image_size <= 1024:
            raise ValueError(f"image-size must be between 8 and 1024 pixels, got {self.image_size}")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 (grey) or 3 (RGB), got {self.channels}")

    @classmethod
    def from_config(cls, config: dict) -> DataRequest:
        """The data keys of a train/evaluate/describe message (defaults: the built-in classes, 64 px grey)."""
        classes = config.get("classes")
        return cls(parse_classes(classes) if classes else synth.CLASSES, int(config.get("image-size", synth.DEFAULT_SIZE)),
                   int(config.get("channels", 1)))

    def to_config(self) -> dict[str, object]:
        """The data keys of a message asking for these images (what `from_config` reads back)."""
        return {"classes": ",".join(self.classes), "image-size": self.image_size, "channels": self.channels}


class DataSource(Protocol):
    kind: str  # "synthetic" or "folder"
    description: str

    def names(self) -> tuple[str, ...]: ...  # class name of every image

    def load(self, request: DataRequest, memory_limit: int) -> tuple[ImageSet, FolderReport]: ...

    @property
    def version(self) -> str: ...  # which images it holds: changes when an image is added, removed or rewritten

    def reindexed(self) -> DataSource: ...  # the source as it is now (raises DatasetError naming what no longer fits)

    def split(self, data: ImageSet, report: FolderReport, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class SyntheticSource:
    """One partition of the project's generated federation (the demo, tests and benchmarks)."""

    spec: datasets.SyntheticSpec
    factory_index: int
    kind: str = "synthetic"
    description: str = "synthetic"

    def names(self) -> tuple[str, ...]:
        return tuple(synth.CLASSES[int(i)] for i in datasets.factory_labels(self.spec, self.factory_index))

    def load(self, request: DataRequest, memory_limit: int) -> tuple[ImageSet, FolderReport]:
        spec = datasets.SyntheticSpec(self.spec.seed, self.spec.num_factories, self.spec.alpha, self.spec.train_size, request.image_size)
        data = datasets.factory_dataset(spec, self.factory_index)
        labels = datasets.relabel(data.labels, synth.CLASSES, request.classes)
        return ImageDataset(grey_to_channels(data.images, request.channels), labels, request.classes), FolderReport(loaded=len(labels))

    @property
    def version(self) -> str:
        return f"synthetic:{self.spec}:{self.factory_index}"

    def reindexed(self) -> SyntheticSource:
        return self  # generated: it never changes

    def split(self, data: ImageSet, report: FolderReport, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
        return stratified_split(np.asarray(data.labels), fraction, seed)


@dataclass(frozen=True)
class FolderSource:
    """A factory's image folder as indexed at one moment; `reindexed` indexes it again (a new run's first message)."""

    index: FolderIndex
    kind: str = "folder"
    bit_depth: int = DEFAULT_BIT_DEPTH  # significant bits of its 16-bit grey images and colour TIFFs (`AgentConfig.bit_depth`)
    classes: tuple[str, ...] = ()  # the factory's class list and folder aliases, to index the folder again
    aliases: tuple[tuple[str, str], ...] = ()
    version: str = ""  # `folder_version` of the index when it was made

    @property
    def description(self) -> str:
        return str(self.index.root)

    def names(self) -> tuple[str, ...]:
        return self.index.names

    def load(self, request: DataRequest, memory_limit: int) -> tuple[ImageSet, FolderReport]:
        if request.channels == 1 and (chroma := median_chroma(self.index.paths)) > COLOUR_CHROMA:
            log.warning("data folder %s holds colour images (median chroma %.2f) but the run reads them as grey (channels = 1); colour "
                        "added 3.8-4.7 points of global accuracy on two held-out colour data sets (docs/benchmarks.md): the central "
                        "site sets channels = 3 in the run config", self.index.root, chroma)
        return load_labelled(self.index, request.classes, request.image_size, request.channels, memory_limit, self.bit_depth)

    def reindexed(self) -> FolderSource:
        index = index_image_folder(self.index.root, self.classes, dict(self.aliases))
        return replace(self, index=index, version=folder_version(index))

    def split(self, data: ImageSet, report: FolderReport, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Held out by each file's path (`keyed_split`): images added later never move an image between the splits."""
        skipped = {path for path, _ in report.skipped}
        keys = [p.relative_to(self.index.root).as_posix() for p in self.index.paths if str(p) not in skipped]
        return keyed_split(keys, np.asarray(data.labels), fraction, seed)


def folder_version(index: FolderIndex) -> str:
    """SHA-256 over every indexed file's path, class, size and modification time: what `FactoryData.refresh` compares."""
    digest = hashlib.sha256()
    for path, name in zip(index.paths, index.names):
        try:
            st = path.stat()
            stamp = f"{st.st_size}|{st.st_mtime_ns}"
        except OSError:
            stamp = "gone"
        digest.update(f"{path.relative_to(index.root).as_posix()}|{name}|{stamp}\n".encode())
    return digest.hexdigest()


def open_source(data: str, classes: str, aliases: tuple[str, ...] | list[str], spec: datasets.SyntheticSpec, factory_index: int,
                bit_depth: int = DEFAULT_BIT_DEPTH) -> DataSource:
    """``--data synthetic`` or an image folder (its 16-bit grey images of ``bit_depth`` bits), checked against the factory's own
    class list now."""
    if data == "synthetic":
        return SyntheticSource(spec, factory_index)
    try:
        class_list, alias_map = parse_classes(classes), parse_aliases(aliases)
    except ClassListError as exc:
        raise DatasetError(str(exc)) from None
    index = index_image_folder(data, class_list, alias_map)
    return FolderSource(index, bit_depth=bit_depth, classes=tuple(class_list), aliases=tuple(sorted(alias_map.items())), version=folder_version(index))


def fit_reason(source: DataSource, classes: tuple[str, ...]) -> str:
    """Why this factory's classes do not fit a run's class list ("" when they do)."""
    try:
        label_map(sorted(set(source.names())), classes, where=f"factory data {source.description}")
    except ClassListError as exc:
        return str(exc)
    return ""


@dataclass(frozen=True)
class Split:
    request: DataRequest
    train: ImageSet
    held_out: ImageSet
    report: FolderReport


class FactoryData:
    """The factory's source plus the split decoded for the latest request (one kept warm at a time)."""

    def __init__(self, source: DataSource, held_out_fraction: float, seed: int, memory_limit: int) -> None:
        self.source, self.fraction, self.seed, self.memory_limit = source, held_out_fraction, seed, memory_limit
        self._current: Split | None = None
        self.report = FolderReport(loaded=len(source.names()))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in self.source.names():
            out[name] = out.get(name, 0) + 1
        return out

    def refresh(self) -> str:
        """Index the source again and use it from now on if its images changed: what changed ("" if nothing did).

        A folder that no longer indexes (a new folder that fits no class, say) is logged, naming why, and the images
        indexed before stay in use: a round is never lost to an operator's half-finished copy."""
        try:
            fresh = self.source.reindexed()
        except (DatasetError, OSError) as exc:  # OSError: a share that went away, a folder it may no longer read
            log.warning("data folder %s changed but cannot be indexed again, so the images indexed before are used: %s", self.source.description, exc)
            return ""
        if fresh.version == self.source.version:
            return ""
        before = self.counts()
        self.source, self._current = fresh, None
        self.report = FolderReport(loaded=len(fresh.names()))
        after = self.counts()
        changed = [f"{name} {before.get(name, 0)} -> {after.get(name, 0)}" for name in sorted(set(before) | set(after))
                   if before.get(name, 0) != after.get(name, 0)]
        return (f"{sum(after.values())} image files (were {sum(before.values())}"
                + (f"; {', '.join(changed)})" if changed else "; the same counts, files added, removed or rewritten)"))

    def split(self, request: DataRequest) -> Split:
        """The train and held-out sets for ``request``, decoded on first use; raises `DatasetError` if the classes do not fit."""
        if self._current is not None and self._current.request == request:
            return self._current
        if reason := fit_reason(self.source, request.classes):
            raise DatasetError(reason)
        data, report = self.source.load(request, self.memory_limit)
        train_idx, held_idx = self.source.split(data, report, self.fraction, self.seed)
        self._current = Split(request, data.subset(train_idx), data.subset(held_idx), report)
        self.report = report
        log.info("data for %d px x %d channel(s): %d training and %d held-out images%s (%d left out: unreadable, filed under two classes or in a format not read)", request.image_size,
                 request.channels, len(train_idx), len(held_idx), ", streamed from disk" if report.streamed else "", len(report.skipped))
        return self._current


def factory_data(cfg: AgentConfig) -> FactoryData:
    """The factory's data as its configuration names it: the agent and each of its DDP/FSDP workers open it here, so
    that they read the same images the same way (bit depth included) and hold out the same split."""
    spec = datasets.SyntheticSpec(seed=cfg.data_seed, num_factories=cfg.num_factories, alpha=cfg.alpha, train_size=cfg.train_size)
    source = open_source(cfg.data, cfg.classes, cfg.class_alias, spec, cfg.factory_index, cfg.bit_depth)
    return FactoryData(source, cfg.val_fraction, cfg.data_seed, cfg.memory_limit)
