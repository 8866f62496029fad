import numpy as np
import pytest
from PIL import Image

from common.data.folder import DatasetError, load_image_folder


def _write(path, value=128, size=(40, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full(size[::-1], value, dtype=np.uint8)).save(path)


def test_reads_class_folders(tmp_path):
    for i in range(3):
        _write(tmp_path / "ok" / f"{i}.png", 100)
        _write(tmp_path / "scratch" / f"{i}.png", 200)
    data, report = load_image_folder(tmp_path, size=32)
    assert data.images.shape == (6, 1, 32, 32)
    assert data.classes == ("ok", "scratch") and data.class_counts().tolist() == [3, 3]
    assert report.loaded == 6 and report.skipped == []


def test_truncated_and_garbage_files_are_skipped_by_name(tmp_path, caplog):
    for i in range(2):
        _write(tmp_path / "ok" / f"{i}.png")
        _write(tmp_path / "crack" / f"{i}.png")
    good = (tmp_path / "ok" / "0.png").read_bytes()
    (tmp_path / "ok" / "truncated.png").write_bytes(good[: len(good) // 2])
    (tmp_path / "crack" / "garbage.jpg").write_bytes(b"not an image at all")
    data, report = load_image_folder(tmp_path, size=16)
    assert len(data) == 4
    skipped = {p.rsplit("/", 1)[1] for p, _ in report.skipped}
    assert skipped == {"truncated.png", "garbage.jpg"}
    assert "truncated.png" in caplog.text and "garbage.jpg" in caplog.text


def test_empty_folder_is_refused(tmp_path):
    (tmp_path / "ok").mkdir()
    with pytest.raises(DatasetError, match="no readable images"):
        load_image_folder(tmp_path)


def test_single_class_is_refused(tmp_path):
    _write(tmp_path / "ok" / "a.png")
    with pytest.raises(DatasetError, match="single class"):
        load_image_folder(tmp_path)


def test_missing_folder_and_unknown_classes(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_image_folder(tmp_path / "nope")
    _write(tmp_path / "ok" / "a.png")
    _write(tmp_path / "mystery" / "a.png")
    with pytest.raises(DatasetError, match="mystery"):
        load_image_folder(tmp_path, classes=("ok", "scratch"))
