"""Export of an approved version for deployment: a `torch.export` program (``.pt2``), TorchScript (and ONNX with the
``export`` extra installed), optionally with dynamic int8 quantization of the linear layers, and the accuracy delta it costs.

Why both PyTorch formats: torch 2.13 deprecates TorchScript (``torch.jit.trace`` and ``torch.jit.load`` warn that they
are going away and name `torch.export` instead), while edge runtimes built on older torch load only TorchScript. The
``.pt2`` file loads with ``torch.export.load(path).module()`` and takes any batch size; TorchScript stays for them.
Dynamic int8 modules do not pass through `torch.export`, so a quantized export writes TorchScript only, and says so.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import logging
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.data import datasets, synth
from common.data.datasets import ImageDataset, ImageSet
from common.data.images import grey_to_channels
from common.models import build_model, load_weights
from common.training import evaluate
from server.registry.service import Registry

log = logging.getLogger("fedforge.export")


@dataclass
class ExportReport:
    version_id: str
    files: list[str]
    accuracy: float | None  # on the check set (None without one)
    quantized_accuracy: float | None
    accuracy_delta: float | None
    skipped: list[str]


def input_of(version: Any) -> tuple[tuple[str, ...], int, int]:
    """The classes, image size and channels a version was trained for (versions from before they were recorded: the built-in ones)."""
    spec = version.model_input or {}
    return tuple(spec.get("classes") or synth.CLASSES), int(spec.get("image_size") or synth.DEFAULT_SIZE), int(spec.get("channels") or 1)


def export_version(registry: Registry, version_id: str, out_dir: str | Path, quantize: bool = False, onnx: bool = True,
                   test_data: ImageSet | None = None) -> ExportReport:
    """The *whole* model (for the pretrained family: the pinned backbone and the federated head) as one file.

    The accuracy check runs on ``test_data``, or on generated images when the version's classes are the
    generator's; otherwise it is skipped (pass --test-data).
    """
    version = registry.get_version(version_id)
    if version is None:
        raise KeyError(f"no version {version_id!r} in the registry")
    if version.status != "approved":
        raise PermissionError(f"version {version_id} is {version.status}; only approved versions are exported for deployment")
    classes, size, channels = input_of(version)
    model = build_model(version.architecture, num_classes=len(classes), in_channels=channels)
    load_weights(model, registry.load_weights(version_id))
    model.eval()
    test = test_data
    if test is None and set(classes) >= set(synth.CLASSES):
        generated = datasets.test_dataset(datasets.SyntheticSpec(image_size=size), 600)
        test = ImageDataset(grey_to_channels(generated.images, channels), datasets.relabel(generated.labels, synth.CLASSES, classes), classes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    example = torch.from_numpy(test.images_at(np.arange(2))) if test is not None else torch.rand(2, channels, size, size)
    files, skipped = [], []
    if test is None:
        skipped.append("accuracy check: no test data for this version's classes (pass --test-data)")

    accuracy = evaluate(model, test).accuracy if test is not None else None
    deployed, q_acc = model, None
    if quantize:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            deployed = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        q_acc = evaluate(deployed, test).accuracy if test is not None else None
    suffix = "-int8" if quantize else ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes and its own deprecation (the module doc)
        scripted = torch.jit.trace(deployed, example)
    ts_path = out / f"{version_id}{suffix}.torchscript.pt"
    scripted.save(str(ts_path))
    files.append(str(ts_path))
    if quantize:
        skipped.append("pt2: dynamic int8 modules do not export with torch.export; export without --quantize")
    else:
        files.append(str(_export_program(model, example, out / f"{version_id}.pt2")))
    if onnx:
        if missing := [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]:
            skipped.append(f"onnx: {' and '.join(missing)} not installed (pip install 'fedforge[export]')")
        elif quantize:
            skipped.append("onnx: dynamic int8 modules do not export to ONNX; export without --quantize")
        else:
            files.append(str(_export_onnx(model, example, out / f"{version_id}.onnx")))
    report = ExportReport(version_id, files, accuracy, q_acc, None if q_acc is None or accuracy is None else q_acc - accuracy, skipped)
    (out / f"{version_id}{suffix}.export.json").write_text(json.dumps({**asdict(report), "manifest": json.loads(version.manifest)}, indent=2))
    return report


def _batch_dim() -> Any:
    """The exported models' first dimension: any batch an inspection station sends, one image or many."""
    return torch.export.Dim("batch", min=1, max=1 << 16)


def _export_onnx(model: torch.nn.Module, example: torch.Tensor, path: Path) -> Path:
    """``model`` as one self-contained ONNX file (input ``image``, output ``logits``, any batch size) at ``path``.

    torch's exporter (through `torch.export` and onnxscript) would put the weights in a ``.onnx.data`` file beside it by
    default, which a copy of the ``.onnx`` alone leaves behind; the model is far below ONNX's 2 GB limit for one file.
    The exporter's and onnxscript's progress lines are kept out of the operator's output, and so is the exporter's
    warning that torchvision's detection operators (which no FedForge model uses) have no ONNX translation here."""
    quiet = {"onnx_ir": logging.WARNING, "onnxscript": logging.WARNING, "torch.onnx": logging.WARNING,
             "torch.onnx._internal.exporter._registration": logging.ERROR}
    loggers = [logging.getLogger(name) for name in quiet]
    levels = [logger.level for logger in loggers]
    for logger, level in zip(loggers, quiet.values()):
        logger.setLevel(level)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation inside the exporter
            torch.onnx.export(model, (example,), str(path), input_names=["image"], output_names=["logits"],
                              dynamic_shapes=({0: _batch_dim()},), external_data=False, verbose=False)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return path


def _export_program(model: torch.nn.Module, example: torch.Tensor, path: Path) -> Path:
    """``model`` as a `torch.export` program with a dynamic batch dimension, saved at ``path`` (the module doc).

    Its weights are exported in the default layout: the pretrained backbone keeps its convolution weights channels-last
    (`common.backbones`), and torch's archive writer cannot tell the storage range of a non-contiguous weight (it warns
    that the weights may not load on another device). The program still runs channels-last: the backbone's forward
    converts its input."""
    model = copy.deepcopy(model).to(memory_format=torch.contiguous_format)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: _batch_dim()},))
    torch.export.save(program, str(path))
    return path
