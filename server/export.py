"""Export of an approved version for deployment: TorchScript (and ONNX when `onnx` is installed),
optionally with dynamic int8 quantization of the linear layers, and the accuracy delta it costs.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.data import datasets
from common.data.datasets import ImageDataset
from common.models import build_model, load_weights
from common.training import evaluate
from server.registry.service import Registry

log = logging.getLogger("fedforge.export")


@dataclass
class ExportReport:
    version_id: str
    files: list[str]
    accuracy: float
    quantized_accuracy: float | None
    accuracy_delta: float | None
    skipped: list[str]


def export_version(registry: Registry, version_id: str, out_dir: str | Path, quantize: bool = False, onnx: bool = True,
                   test_data: ImageDataset | None = None) -> ExportReport:
    version = registry.get_version(version_id)
    if version is None:
        raise KeyError(f"no version {version_id!r} in the registry")
    if version.status != "approved":
        raise PermissionError(f"version {version_id} is {version.status}; only approved versions are exported for deployment")
    model = build_model(version.architecture, num_classes=6)
    load_weights(model, registry.load_weights(version_id))
    model.eval()
    test = test_data or datasets.test_dataset(datasets.SyntheticSpec(), 600)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    example = torch.from_numpy(test.images[:2])
    files, skipped = [], []

    accuracy = evaluate(model, test).accuracy
    deployed, q_acc = model, None
    if quantize:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            deployed = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        q_acc = evaluate(deployed, test).accuracy
    suffix = "-int8" if quantize else ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scripted = torch.jit.trace(deployed, example)
    ts_path = out / f"{version_id}{suffix}.torchscript.pt"
    scripted.save(str(ts_path))
    files.append(str(ts_path))
    if onnx:
        if importlib.util.find_spec("onnx") is None:
            skipped.append("onnx: the `onnx` package is not installed (pip install onnx onnxscript)")
        elif quantize:
            skipped.append("onnx: dynamic int8 modules do not export to ONNX; export without --quantize")
        else:
            onnx_path = out / f"{version_id}.onnx"
            torch.onnx.export(model, (example,), str(onnx_path), input_names=["image"], output_names=["logits"],
                              dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}})
            files.append(str(onnx_path))
    report = ExportReport(version_id, files, accuracy, q_acc, None if q_acc is None else q_acc - accuracy, skipped)
    (out / f"{version_id}{suffix}.export.json").write_text(json.dumps({**asdict(report), "manifest": json.loads(version.manifest)}, indent=2))
    return report
