"""Users' own image folders: the class list maps folders by name, any format and size loads, big folders stream."""

import io
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from client.config import AgentConfig
from client.data import DataRequest, FactoryData, fit_reason, open_source
from common.data.classes import ClassListError, parse_aliases, parse_classes
from common.data.datasets import StreamedImages
from common.data.folder import DatasetError, index_image_folder, load_image_folder, load_labelled
from common.data.images import read_image
from common.data.synth import CLASSES

FEDERATION = ("good", "dent", "scratch", "rust")  # a class list that is not the built-in one


def _write(path, value=None, size=(40, 30), mode="L"):
    """A flat image; by default its grey level follows its class folder's name, so that two classes never hold the same
    bytes (the loader leaves out an image filed under two classes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if value is None:
        value = 64 + zlib.crc32(path.parent.name.encode()) % 128
    shape = size[::-1] if mode == "L" else (*size[::-1], 3)
    Image.fromarray(np.full(shape, value, dtype=np.uint8), mode=mode).save(path)


def test_labels_follow_the_class_list_not_the_folders_present(tmp_path):
    """Two factories with different folder sets agree on every label: the index is the class's place in the list."""
    for name, value in (("good", 10), ("scratch", 200)):  # factory a: no `dent`, no `rust`
        for i in range(3):
            _write(tmp_path / "a" / name / f"{i}.png", value)
    for name, value in (("dent", 90), ("scratch", 200), ("rust", 250)):  # factory b: no `good`
        for i in range(2):
            _write(tmp_path / "b" / name / f"{i}.jpg", value)
    a, _ = load_image_folder(tmp_path / "a", size=16, classes=FEDERATION)
    b, _ = load_image_folder(tmp_path / "b", size=16, classes=FEDERATION)
    assert a.classes == b.classes == FEDERATION
    scratch = FEDERATION.index("scratch")
    assert set(a.labels.tolist()) == {0, scratch} and set(b.labels.tolist()) == {1, scratch, 3}
    for data in (a, b):  # the same images behind the same label
        assert np.allclose(data.images_at(np.flatnonzero(data.labels == scratch)), 200 / 255, atol=0.01)


def test_unknown_folder_is_refused_naming_it_and_the_list(tmp_path):
    _write(tmp_path / "good" / "a.png")
    _write(tmp_path / "mystery" / "a.png")
    with pytest.raises(DatasetError, match="folder 'mystery' is not a class of the class list") as err:
        index_image_folder(tmp_path, FEDERATION)
    assert "good" in str(err.value) and "--class-alias" in str(err.value)


def test_a_folder_named_in_another_case_is_refused_with_the_alias_that_fixes_it(tmp_path):
    """"Good" for the run's "good": refused (a case-blind match could merge two classes a line keeps apart), and the error
    gives the exact --class-alias to add."""
    _write(tmp_path / "Good" / "a.png")
    with pytest.raises(DatasetError, match="folder 'Good' is not a class") as err:
        index_image_folder(tmp_path, FEDERATION)
    assert "add --class-alias Good=good" in str(err.value)
    assert index_image_folder(tmp_path, FEDERATION, parse_aliases(["Good=good"])).folders == {"Good": "good"}


def test_alias_maps_a_renamed_folder(tmp_path):
    _write(tmp_path / "OK-parts" / "a.png", 10)
    _write(tmp_path / "dent" / "b.png", 90)
    index = index_image_folder(tmp_path, FEDERATION, parse_aliases(["OK-parts=good"]))
    assert index.folders == {"OK-parts": "good", "dent": "dent"}
    data, _ = load_labelled(index, FEDERATION, 8)
    assert sorted(data.labels.tolist()) == [0, 1]
    with pytest.raises(ClassListError, match="FOLDER=CLASS"):
        parse_aliases(["nonsense"])
    with pytest.raises(DatasetError, match="'bent' is not in the class list"):
        index_image_folder(tmp_path, FEDERATION, {"OK-parts": "bent"})


def test_single_class_factory_trains_and_missing_class_is_fine(tmp_path):
    for i in range(12):
        _write(tmp_path / "ok" / f"{i}.png", 100 + i)
    cfg = AgentConfig(factory_id="only-ok", data=str(tmp_path), state_dir=str(tmp_path / "state"))
    data = FactoryData(open_source(cfg.data, cfg.classes, cfg.class_alias, None, 0), 0.25, 0, cfg.memory_limit)  # type: ignore[arg-type]
    split = data.split(DataRequest(CLASSES, 16, 1))
    assert len(split.train) + len(split.held_out) == 12 and len(split.train) > 0 and len(split.held_out) > 0
    assert set(split.train.labels.tolist()) == set(split.held_out.labels.tolist()) == {0}


def test_classes_that_do_not_fit_the_runs_list_are_named(tmp_path):
    _write(tmp_path / "scratch" / "a.png")
    source = open_source(str(tmp_path), ",".join(CLASSES), (), None, 0)  # type: ignore[arg-type]
    assert fit_reason(source, CLASSES) == ""
    assert "['scratch']" in fit_reason(source, ("ok", "crack"))
    with pytest.raises(ClassListError, match="more than once"):
        parse_classes("ok,ok")


def test_rgb_and_odd_sizes_are_letterboxed_not_cropped(tmp_path):
    img = np.zeros((30, 60, 3), np.uint8)
    img[:, :, 0] = 255  # a red frame, twice as wide as high
    Image.fromarray(img).save(tmp_path / "wide.png")
    rgb = read_image(tmp_path / "wide.png", 30, channels=3)
    assert rgb.shape == (3, 30, 30)
    assert np.allclose(rgb[0, 8:22], 1.0) and np.allclose(rgb[1:, 8:22], 0.0)  # the whole frame, scaled into the middle
    assert np.allclose(rgb[0, :5], 1.0)  # padded with the image's own mean colour
    grey = read_image(tmp_path / "wide.png", 30, channels=1)
    assert grey.shape == (1, 30, 30) and 0.2 < grey[0, 15, 15] < 0.4  # luma of pure red
    Image.fromarray(np.full((7, 5), 200, np.uint8)).save(tmp_path / "tiny.bmp")
    assert read_image(tmp_path / "tiny.bmp", 64).shape == (1, 64, 64)


def _strip_with_marks(pieces: int, length: int = 100) -> np.ndarray:
    """A dark strip of ``pieces`` squares along its length, each with a bright square mark in its middle."""
    strip = np.full((length, length * pieces), 40, np.uint8)
    for i in range(pieces):
        strip[40:60, i * length + 40:i * length + 60] = 255
    return strip


def test_a_line_scan_strip_is_folded_into_a_near_square_mosaic_before_letterboxing(tmp_path):
    """A 4:1 strip fills the whole input as a 2 x 2 mosaic of its quarters, in reading order, each mark at the middle of its
    quadrant; letterboxed alone it would fill a quarter. A tall strip folds the same way, and so does a 16-bit one."""
    from common.data.images import STRIP_FOLD, decode_image_bytes, fold_strip

    Image.fromarray(_strip_with_marks(4)).save(tmp_path / "wide.png")
    grey = read_image(tmp_path / "wide.png", 64)[0]
    assert grey.shape == (64, 64)
    for row in (0, 1):
        for col in (0, 1):
            quadrant = grey[row * 32:(row + 1) * 32, col * 32:(col + 1) * 32]
            assert quadrant[13:19, 13:19].min() > 0.9 and quadrant[:8].max() < 0.2, (row, col)  # its mark, in its middle
    assert np.array_equal(grey, decode_image_bytes((tmp_path / "wide.png").read_bytes(), 64)[0])  # inspection reads it alike

    order = _strip_with_marks(4)
    for i in range(4):
        order[10:20, i * 100 + 10:i * 100 + 10 + 10 * (i + 1)] = 255  # piece i: a bar i + 1 tenths long above its mark
    mosaic = np.asarray(fold_strip(Image.fromarray(order)))
    assert mosaic.shape == (200, 200)
    bars = [int((mosaic[r * 100 + 15, c * 100:(c + 1) * 100] == 255).sum()) for r in (0, 1) for c in (0, 1)]
    assert bars == [10, 20, 30, 40]  # left to right, row after row

    Image.fromarray(np.ascontiguousarray(_strip_with_marks(4).T)).save(tmp_path / "tall.png")
    tall = read_image(tmp_path / "tall.png", 64)[0]
    assert all(tall[r * 32 + 13:r * 32 + 19, c * 32 + 13:c * 32 + 19].min() > 0.9 for r in (0, 1) for c in (0, 1))
    Image.fromarray(_strip_with_marks(4).astype(np.uint16) * 257).save(tmp_path / "wide16.png")
    assert np.abs(read_image(tmp_path / "wide16.png", 64)[0] - grey).max() < 0.01  # a 16-bit camera's strip folds alike

    three = np.asarray(fold_strip(Image.fromarray(_strip_with_marks(3))))  # 3 pieces on a 2 x 2 grid
    assert three.shape == (200, 200) and three[140:160, 40:60].min() == 255
    assert abs(int(three[150, 150]) - round(float(_strip_with_marks(3).mean()))) <= 1  # the empty cell: the strip's mean
    assert STRIP_FOLD == 2.5
    narrow = Image.fromarray(np.zeros((100, 240), np.uint8))  # 2.4:1, below the fold: letterboxed as it is
    assert fold_strip(narrow) is narrow


def _cut_out(hidden):
    """A background-removed cut-out: a grey disc with a dark mark, opaque inside, transparent outside, ``hidden`` the RGB
    left under the transparent pixels (None: the original background, green)."""
    yy, xx = np.mgrid[0:48, 0:64]
    inside = (xx - 32) ** 2 + (yy - 24) ** 2 < 18**2
    rgb = np.zeros((48, 64, 3), np.uint8)
    rgb[...] = (30, 140, 40)
    rgb[inside] = (150, 150, 150)
    rgb[20:26, 28:34] = (20, 20, 20)
    if hidden is not None:
        rgb[~inside] = hidden
    return np.dstack([rgb, np.where(inside, 255, 0).astype(np.uint8)]), inside


def test_a_cut_out_reads_alike_whatever_colour_its_transparent_pixels_hide(tmp_path):
    """Export tools leave black, white or the old background under a cut-out's transparent pixels; Pillow's ``convert``
    shows that colour. Every copy reads as the cut-out composited onto white, grey or RGB, from RGBA, LA and palette PNGs
    (a transparent palette entry), on every site; an opaque RGBA image reads as its RGB."""
    from common.data.images import ALPHA_BACKGROUND, decode_image_bytes

    for i, hidden in enumerate([(0, 0, 0), (255, 255, 255), None, (200, 0, 200)]):
        Image.fromarray(_cut_out(hidden)[0], "RGBA").save(tmp_path / f"cut{i}.png")
    rgba, inside = _cut_out(None)
    expected = np.where(inside[..., None], rgba[..., :3], np.array(ALPHA_BACKGROUND, np.uint8))
    Image.fromarray(expected).save(tmp_path / "composited.png")
    for channels in (1, 3):
        want = read_image(tmp_path / "composited.png", 32, channels)
        for i in range(4):
            got = read_image(tmp_path / f"cut{i}.png", 32, channels)
            assert np.abs(got - want).max() < 1 / 255 + 1e-6, (i, channels)
            assert np.array_equal(got, decode_image_bytes((tmp_path / f"cut{i}.png").read_bytes(), 32, channels))
    assert read_image(tmp_path / "cut0.png", 32, 1)[0, 4, 0] == 1.0  # the corner below the letterbox band: white, not black

    grey = Image.fromarray(_cut_out((0, 0, 0))[0], "RGBA").convert("LA")
    grey.save(tmp_path / "grey-alpha.png")
    assert np.abs(read_image(tmp_path / "grey-alpha.png", 32, 1) - read_image(tmp_path / "composited.png", 32, 1)).max() < 2 / 255
    palette = Image.fromarray(_cut_out((0, 0, 0))[0][..., :3]).quantize(8)  # black, outside the disc, as the transparent entry
    black = next(i for i, c in enumerate(np.asarray(palette.getpalette()).reshape(-1, 3).tolist()) if c == [0, 0, 0])
    palette.save(tmp_path / "palette.png", transparency=black)
    with Image.open(tmp_path / "palette.png") as img:
        assert img.mode == "P" and "transparency" in img.info
    assert read_image(tmp_path / "palette.png", 32, 1)[0, 4, 0] == 1.0  # the transparent black reads white
    opaque = _cut_out((0, 0, 0))[0].copy()
    opaque[..., 3] = 255
    Image.fromarray(opaque, "RGBA").save(tmp_path / "opaque.png")
    Image.fromarray(opaque[..., :3]).save(tmp_path / "opaque-rgb.png")
    assert np.array_equal(read_image(tmp_path / "opaque.png", 32, 3), read_image(tmp_path / "opaque-rgb.png", 32, 3))
    opaque[..., 3] = 0  # a fourth channel of zeros hides every pixel: not meant as transparency, read as the colours
    Image.fromarray(opaque, "RGBA").save(tmp_path / "zero-alpha.png")
    assert np.array_equal(read_image(tmp_path / "zero-alpha.png", 32, 3), read_image(tmp_path / "opaque-rgb.png", 32, 3))


def test_a_large_jpeg_decodes_at_a_reduced_scale_to_what_the_full_image_gives(tmp_path, monkeypatch):
    """A photograph many times the input size is decoded in the JPEG's DCT domain at a reduced scale (never below twice the
    input size), then letterboxed: within 3/255 of decoding every pixel. A cache keyed by file bytes names the decoding."""
    from common.data import images
    from common.data.datasets import StreamedImages
    from common.features import content_keys

    rng = np.random.default_rng(0)
    photo = Image.fromarray((rng.random((40, 60, 3)) * 255).astype(np.uint8)).resize((1500, 1000), Image.BICUBIC)
    photo.save(tmp_path / "photo.jpg", quality=92)
    with Image.open(tmp_path / "photo.jpg") as img:  # what the decoder is asked for: 1/4 of each side (375 x 250 >= 2 x 64)
        img.draft(img.mode, (images.JPEG_DRAFT * 64, images.JPEG_DRAFT * 64))
        assert img.size == (375, 250)
    for channels in (1, 3):
        reduced = read_image(tmp_path / "photo.jpg", 64, channels)
        with monkeypatch.context() as m:
            m.setattr(images, "JPEG_DRAFT", 10**6)  # no reduction: every pixel decoded
            full = read_image(tmp_path / "photo.jpg", 64, channels)
        assert reduced.shape == full.shape == (channels, 64, 64) and np.abs(reduced - full).max() <= 3 / 255
    streamed = StreamedImages((tmp_path / "photo.jpg",), np.zeros(1, np.int64), ("a",), 64, 3)
    before = content_keys(streamed)
    monkeypatch.setattr(images, "DECODE_VERSION", images.DECODE_VERSION + 1)
    assert content_keys(streamed) != before


def test_a_high_resolution_cameras_images_are_read_and_only_what_would_decode_too_large_is_refused(tmp_path, monkeypatch):
    """A 192-megapixel JPEG (over Pillow's own refusal at 179 and the 64 FedForge refused before) is read without a warning:
    it decodes at 1/8. The pixel limit counts what would be decoded, so a JPEG over it nominally is read and a PNG of the
    same pixels refused by name, in a folder as alone; an inspection request's image has its own, lower limit, and a deep
    colour TIFF the deep-sample limit, in the same words."""
    import warnings

    from common.data import images
    from common.data.images import ImageError, decode_image_bytes

    frame = np.full((12000, 16000), 40, np.uint8)
    frame[:, 8000:] = 220  # dark left half, bright right half
    Image.fromarray(frame).save(tmp_path / "frame.jpg", quality=90)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's DecompressionBombWarning included
        read = read_image(tmp_path / "frame.jpg", 64)
    assert read.shape == (1, 64, 64) and abs(read[0, 32, 2] - 40 / 255) < 0.02 and abs(read[0, 32, 60] - 220 / 255) < 0.02

    dark = np.zeros((8000, 9000), np.uint8)  # 72 Mpx in 70 kB of PNG: read from a folder, refused in a request
    Image.fromarray(dark).save(tmp_path / "dark.png")
    assert read_image(tmp_path / "dark.png", 32).max() == 0
    with pytest.raises(ImageError, match="9000x8000 pixels exceeds the 64,000,000 pixel limit"):
        decode_image_bytes((tmp_path / "dark.png").read_bytes(), 32)

    monkeypatch.setattr(images, "MAX_PIXELS", 1_000_000)
    pixels = np.tile(np.linspace(0, 255, 1200).astype(np.uint8), (1000, 1))
    (tmp_path / "folder" / "good").mkdir(parents=True)
    for name, value in (("a.png", pixels), ("a.jpg", pixels), ("b.png", pixels[::-1, ::-1])):
        Image.fromarray(value).save(tmp_path / "folder" / "good" / name)
    with pytest.raises(ImageError, match=r"a\.png: 1200x1000 pixels exceeds the 1,000,000 pixel limit"):
        read_image(tmp_path / "folder" / "good" / "a.png", 64)
    assert read_image(tmp_path / "folder" / "good" / "a.jpg", 64).shape == (1, 64, 64)  # decoded at 1/4: 300 x 250
    data, report = load_image_folder(tmp_path / "folder", size=64, classes=("good",))
    assert len(data) == 1 and sorted(Path(p).name for p, _ in report.skipped) == ["a.png", "b.png"]

    import tifffile  # a deep colour TIFF (read by tifffile, not Pillow) meets the same limit, by the same words

    monkeypatch.setattr(images, "MAX_DEEP_PIXELS", 100_000)
    deep = np.repeat(np.tile(np.linspace(0, 65535, 400), (300, 1))[..., None], 3, axis=2).astype(np.uint16)
    tifffile.imwrite(tmp_path / "deep.tif", deep, photometric="rgb")
    tifffile.imwrite(tmp_path / "small.tif", deep[:200, :200], photometric="rgb")
    assert read_image(tmp_path / "small.tif", 64, 3, bit_depth=16).shape == (3, 64, 64)
    with pytest.raises(ImageError, match=r"deep\.tif: 400x300 pixels exceeds the 100,000 pixel limit for images of more than 8 bits"):
        read_image(tmp_path / "deep.tif", 64, 3, bit_depth=16)


def test_a_photographs_exif_orientation_is_applied_as_a_viewer_shows_it(tmp_path):
    """A camera that stores a portrait photograph as landscape pixels plus an orientation tag reads like the photograph
    an export already turned upright, in every format, from a folder and from an inspection request alike; a large JPEG
    decoded at a reduced scale is turned too. An EXIF block that cannot be parsed leaves the pixels as stored."""
    import io

    from common.data.images import decode_image_bytes

    rng = np.random.default_rng(1)
    stored = (rng.random((30, 60)) * 255).astype(np.uint8)
    stored[:, :12] = 255  # a bright strip on the left of the stored pixels
    turns = {3: np.rot90(stored, 2), 6: np.rot90(stored, -1), 8: np.rot90(stored, 1), 2: stored[:, ::-1], 5: stored.T}
    for orientation, upright in turns.items():
        exif = Image.Exif()
        exif[0x0112] = orientation
        Image.fromarray(stored).save(tmp_path / f"tagged-{orientation}.png", exif=exif)
        Image.fromarray(np.ascontiguousarray(upright)).save(tmp_path / f"upright-{orientation}.png")
        tagged = read_image(tmp_path / f"tagged-{orientation}.png", 32)
        assert np.array_equal(tagged, read_image(tmp_path / f"upright-{orientation}.png", 32)), orientation
        assert np.array_equal(tagged, decode_image_bytes((tmp_path / f"tagged-{orientation}.png").read_bytes(), 32))
    assert read_image(tmp_path / "tagged-6.png", 32)[0, :4, 10:22].mean() > 0.9  # the strip on top, letterboxed: as a viewer shows it

    photo = Image.fromarray(stored).resize((1500, 750), Image.BICUBIC).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6
    photo.save(tmp_path / "camera.jpg", quality=95, exif=exif)
    photo.rotate(-90, expand=True).save(tmp_path / "exported.jpg", quality=95)
    for channels in (1, 3):
        camera, exported = read_image(tmp_path / "camera.jpg", 64, channels), read_image(tmp_path / "exported.jpg", 64, channels)
        assert np.abs(camera - exported).mean() < 2 / 255 and camera[:, :10, 20:44].mean() > 0.9

    encoded = io.BytesIO()
    Image.fromarray(stored).save(encoded, "JPEG", quality=95)
    plain = encoded.getvalue()
    broken = plain[:2] + b"\xff\xe1\x00\x10Exif\x00\x00MM\x00\x2a\xff\xff\xff\xff" + plain[2:]  # an IFD offset past the end
    with pytest.warns(UserWarning, match="EXIF"):
        assert np.array_equal(decode_image_bytes(broken, 32), decode_image_bytes(plain, 32))


def test_cmyk_images_read_like_their_rgb_originals(tmp_path):
    """CMYK JPEGs and TIFFs (8 and 16 bits per sample), as image-management and print workflows write them, read as the
    RGB picture they hold, in colour and in grey, from a folder and from an inspection request alike."""
    import tifffile

    from common.data.images import decode_image_bytes

    rng = np.random.default_rng(2)
    rgb = (rng.random((40, 60, 3)) * 255).astype(np.uint8)
    rgb[:, :20] = (200, 30, 30)  # a red band: CMYK read as anything but colour loses it
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    cmyk = Image.fromarray(rgb).convert("CMYK")
    cmyk.save(tmp_path / "cmyk.jpg", quality=98)
    cmyk.save(tmp_path / "cmyk.tif")
    tifffile.imwrite(tmp_path / "cmyk16.tif", np.asarray(cmyk).astype(np.uint16) * 257, photometric="separated")
    for channels in (3, 1):
        original = read_image(tmp_path / "rgb.png", 32, channels)
        for name in ("cmyk.jpg", "cmyk.tif", "cmyk16.tif"):
            read = read_image(tmp_path / name, 32, channels)
            assert read.shape == original.shape and np.abs(read - original).mean() < 2 / 255, (name, channels)
            assert np.array_equal(decode_image_bytes((tmp_path / name).read_bytes(), 32, channels), read), name
    assert np.allclose(read_image(tmp_path / "cmyk.jpg", 32, 3)[:, 16, 2], np.array([200, 30, 30]) / 255, atol=0.02)  # red, not grey


def test_sixteen_bit_and_float_camera_images_keep_their_range(tmp_path):
    """A 16-bit grey PNG or TIFF (an industrial camera's) reads as its 8-bit copy does, not clipped white as Pillow's
    convert("L") would make it; a float TIFF in [0, 1] too, of half, single or double precision, and a 16-bit one with
    alpha (Pillow opens neither); pixel values beyond the container's range are refused by name."""
    from common.data.images import ImageError, decode_image_bytes

    ramp = np.linspace(0, 65535, 40 * 60).reshape(40, 60).astype(np.uint16)
    Image.fromarray((ramp // 257).astype(np.uint8)).save(tmp_path / "eight.png")
    eight = read_image(tmp_path / "eight.png", 32)
    for name, image in (("sixteen.png", Image.fromarray(ramp)), ("sixteen.tif", Image.fromarray(ramp)),
                        ("float.tif", Image.fromarray((ramp / 65535).astype(np.float32)))):
        image.save(tmp_path / name)
        grey = read_image(tmp_path / name, 32)
        assert grey.shape == (1, 32, 32) and grey.dtype == np.float32
        assert np.abs(grey - eight).max() < 0.01, name  # the same picture, letterboxed alike, not clipped at 255
        rgb = read_image(tmp_path / name, 32, channels=3)
        assert rgb.shape == (3, 32, 32) and np.array_equal(rgb[0], rgb[2]) and np.allclose(rgb[0], grey[0])
    assert np.allclose(decode_image_bytes((tmp_path / "sixteen.png").read_bytes(), 32), read_image(tmp_path / "sixteen.png", 32))
    Image.fromarray(ramp.astype(np.float32)).save(tmp_path / "counts.tif")  # float pixels that are not in [0, 1]
    with pytest.raises(ImageError, match=r"counts\.tif: float \(F\) image with pixel values in \[0, 65535\]"):
        read_image(tmp_path / "counts.tif", 32)
    Image.fromarray(ramp.astype(np.int32) * 10).save(tmp_path / "wide.tif")  # 32-bit integers beyond 16 bits
    with pytest.raises(ImageError, match=r"wide\.tif: .*expected 16-bit \(0\.\.65535\)"):
        read_image(tmp_path / "wide.tif", 32)
    import tifffile  # 32-bit unsigned samples, which Pillow reads into its signed mode I: small values as they are
    tifffile.imwrite(tmp_path / "unsigned.tif", ramp.astype(np.uint32))
    assert np.array_equal(read_image(tmp_path / "unsigned.tif", 32), read_image(tmp_path / "sixteen.tif", 32))
    tifffile.imwrite(tmp_path / "huge.tif", ramp.astype(np.uint32) * 65537)  # up to 2**32 - 1: refused by its true range
    with pytest.raises(ImageError, match=r"huge\.tif: 32-bit unsigned grey image with pixel values in \[0, 4\.29497e\+09\]; "
                                         r"expected 16-bit \(0\.\.65535\)"):
        read_image(tmp_path / "huge.tif", 32)
    # grey TIFFs Pillow cannot open ("cannot identify image file"): half- and double-precision floats, 16 bits with alpha
    tifffile.imwrite(tmp_path / "half.tif", (ramp / 65535).astype(np.float16), photometric="minisblack")
    tifffile.imwrite(tmp_path / "double.tif", ramp / 65535, photometric="minisblack")
    alpha = np.full_like(ramp, 65535)
    alpha[:, :12] = 0  # the left fifth transparent: reads white, as an 8-bit grey image with alpha does
    tifffile.imwrite(tmp_path / "alpha.tif", np.stack([ramp, alpha], -1), photometric="minisblack", extrasamples=[2])
    white = ramp.copy()
    white[:, :12] = 65535
    Image.fromarray((white // 257).astype(np.uint8)).save(tmp_path / "white.png")
    for name, like in (("half.tif", "eight.png"), ("double.tif", "eight.png"), ("alpha.tif", "white.png")):
        grey = read_image(tmp_path / name, 32, bit_depth=16)
        assert np.abs(grey - read_image(tmp_path / like, 32)).max() < 0.01, name
        assert np.allclose(decode_image_bytes((tmp_path / name).read_bytes(), 32, bit_depth=16), grey), name
        rgb = read_image(tmp_path / name, 32, channels=3, bit_depth=16)
        assert np.array_equal(rgb[0], rgb[2]) and np.allclose(rgb[0], grey[0], atol=1e-6), name
    tifffile.imwrite(tmp_path / "hdr.tif", (ramp / 6553.5).astype(np.float16), photometric="minisblack")  # radiance, not [0, 1]
    with pytest.raises(ImageError, match=r"hdr\.tif: float grey TIFF with pixel values in \[0, 10\]; expected \[0, 1\]"):
        read_image(tmp_path / "hdr.tif", 32)


def test_deep_colour_tiffs_read_as_their_eight_bit_copies_planar_interleaved_float_and_twelve_bit(tmp_path):
    """A colour camera's 16-bit TIFFs read as their 8-bit copy: interleaved, planar (Pillow reads planar 16-bit RGB as
    garbage: a red square as light grey), float in [0, 1] (which Pillow cannot open), and 12 significant bits with
    bit-depth 12 (which Pillow reads by the high byte, nearly black); with an alpha channel flattened onto white; turned
    by the TIFF's orientation tag; LZW-compressed (tifffile with imagecodecs); Inspection's bytes read alike. Samples beyond
    the range are refused by name, and so is a deep TIFF that cannot be decoded (cut short, or a codec missing), never
    handed to Pillow to misread; a
    16-bit colour PNG, which Pillow reads by the high byte only, is refused below bit-depth 16."""
    import tifffile

    from common.data.images import ImageError, decode_image_bytes

    rgb = np.zeros((30, 50, 3))
    rgb[..., 0] = np.linspace(0, 1, 50)[None]  # a ramp in red, a blue square, a green bar: every channel differs
    rgb[5:20, 30:45, 2] = 0.8
    rgb[22:28, :, 1] = 0.6
    Image.fromarray(np.round(rgb * 255).astype(np.uint8)).save(tmp_path / "eight.png")
    eight = read_image(tmp_path / "eight.png", 32, channels=3)
    sixteen = np.round(rgb * 65535).astype(np.uint16)
    tifffile.imwrite(tmp_path / "interleaved.tif", sixteen, photometric="rgb")
    tifffile.imwrite(tmp_path / "planar.tif", np.moveaxis(sixteen, -1, 0), photometric="rgb", planarconfig="separate")
    tifffile.imwrite(tmp_path / "float.tif", rgb.astype(np.float32), photometric="rgb")
    tifffile.imwrite(tmp_path / "twelve.tif", np.round(rgb * 4095).astype(np.uint16), photometric="rgb")
    alpha = np.full((30, 50, 1), 65535, np.uint16)
    alpha[:, :10] = 0  # a cut-out: the left fifth is transparent and reads white, whatever it hides
    tifffile.imwrite(tmp_path / "cut-out.tif", np.concatenate([sixteen, alpha], -1), photometric="rgb", extrasamples=[2])
    tifffile.imwrite(tmp_path / "turned.tif", np.ascontiguousarray(np.rot90(sixteen, 1)), photometric="rgb",
                     extratags=[(274, "H", 1, 6, True)])  # stored turned a quarter anticlockwise; orientation 6 turns it back
    # LZW, as most camera SDKs and ImageJ write them: tifffile decodes it only with imagecodecs; Pillow would read the high byte
    tifffile.imwrite(tmp_path / "lzw.tif", sixteen, photometric="rgb", compression="lzw", predictor=True)
    tifffile.imwrite(tmp_path / "lzw-planar.tif", np.moveaxis(sixteen, -1, 0), photometric="rgb", planarconfig="separate",
                     compression="lzw")
    tifffile.imwrite(tmp_path / "lzw-twelve.tif", np.round(rgb * 4095).astype(np.uint16), photometric="rgb", compression="lzw")
    assert np.abs(np.asarray(Image.open(tmp_path / "planar.tif").convert("RGB"), np.float64) / 255 - rgb).max() > 0.3  # Pillow's reading
    for name, bits in (("interleaved.tif", 16), ("planar.tif", 16), ("float.tif", 16), ("twelve.tif", 12), ("turned.tif", 16),
                       ("lzw.tif", 16), ("lzw-planar.tif", 16), ("lzw-twelve.tif", 12)):
        got = read_image(tmp_path / name, 32, channels=3, bit_depth=bits)
        assert got.shape == (3, 32, 32) and got.dtype == np.float32
        assert np.abs(got - eight).max() < 0.01, name
        assert np.allclose(decode_image_bytes((tmp_path / name).read_bytes(), 32, 3, bit_depth=bits), got), name
        grey = read_image(tmp_path / name, 32, channels=1, bit_depth=bits)
        assert np.abs(grey - read_image(tmp_path / "eight.png", 32, channels=1)).max() < 0.01, name
    white = rgb.copy()
    white[:, :10] = 1.0
    Image.fromarray(np.round(white * 255).astype(np.uint8)).save(tmp_path / "white.png")
    assert np.abs(read_image(tmp_path / "cut-out.tif", 32, channels=3) - read_image(tmp_path / "white.png", 32, channels=3)).max() < 0.01
    with pytest.raises(ImageError, match=r"interleaved\.tif: colour TIFF with pixel values in \[0, 65535\]; expected 12-bit \(0\.\.4095\); "
                                         r"is it a camera's 16-bit image\? then bit-depth is 16"):
        read_image(tmp_path / "interleaved.tif", 32, channels=3, bit_depth=12)
    tifffile.imwrite(tmp_path / "counts.tif", (rgb * 1000).astype(np.float32), photometric="rgb")
    with pytest.raises(ImageError, match=r"counts\.tif: float colour TIFF with pixel values in \[0, 1000\]; expected \[0, 1\]"):
        read_image(tmp_path / "counts.tif", 32, channels=3)
    (tmp_path / "cut.tif").write_bytes((tmp_path / "planar.tif").read_bytes()[:2000])  # a copy that broke off
    with pytest.raises(ImageError, match=r"cut\.tif"):
        read_image(tmp_path / "cut.tif", 32, channels=3)
    lzw = (tmp_path / "lzw-twelve.tif").read_bytes()
    (tmp_path / "cut-lzw.tif").write_bytes(lzw[:len(lzw) // 2])  # refused naming why, never handed to Pillow to misread
    with pytest.raises(ImageError, match=r"cut-lzw\.tif: colour TIFF of 16-bit samples compressed by LZW cannot be decoded"):
        read_image(tmp_path / "cut-lzw.tif", 32, channels=3, bit_depth=12)
    unknown = bytearray((tmp_path / "twelve.tif").read_bytes())  # a compression no codec here decodes (a camera maker's own)
    offset = tifffile.TiffFile(tmp_path / "twelve.tif").pages[0].tags["Compression"].valueoffset
    unknown[offset:offset + 2] = (65000).to_bytes(2, "little")
    (tmp_path / "unknown.tif").write_bytes(bytes(unknown))
    with pytest.raises(ImageError, match=r"unknown\.tif: colour TIFF of 16-bit samples compressed by \w+ cannot be decoded"):
        read_image(tmp_path / "unknown.tif", 32, channels=3, bit_depth=12)
    png = _sixteen_bit_png(sixteen)
    (tmp_path / "sixteen.png").write_bytes(png)
    assert np.abs(read_image(tmp_path / "sixteen.png", 32, channels=3) - eight).max() < 0.01  # at 16 bits Pillow's high byte is right
    with pytest.raises(ImageError, match=r"sixteen\.png: a 16-bit colour PNG cannot be read at bit-depth 12 .*save it as a TIFF"):
        read_image(tmp_path / "sixteen.png", 32, channels=3, bit_depth=12)


def _sixteen_bit_png(rgb: np.ndarray) -> bytes:
    """A 16-bit RGB PNG of ``rgb`` (uint16 (H, W, 3)), which Pillow cannot write."""
    import struct

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    h, w = rgb.shape[:2]
    rows = b"".join(b"\x00" + rgb[y].astype(">u2").tobytes() for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def test_a_twelve_bit_camera_reads_as_its_eight_bit_copy_with_bit_depth_12(tmp_path, caplog):
    """A Mono12 camera's 16-bit files (0..4095) read dark at the default 16 bits; with bit-depth 12, at the factory (training,
    streamed sets, Inspection), the central site (`data-bit-depth`) and the demo's factories, they read as their 8-bit copies.
    A pixel above 4095 is then refused, naming the file; features cached by file bytes are keyed by the bit depth too."""
    from client.config import AgentConfig
    from client.data import DataRequest, factory_data, open_source
    from client.inspection import decode_image
    from common.data.datasets import StreamedImages, SyntheticSpec
    from common.data.images import ImageError
    from common.features import content_keys
    from server.config import FederationConfig
    from server.demo import own_folders

    ramp = np.linspace(0, 4095, 40 * 60).reshape(40, 60).astype(np.uint16)
    eight = np.round(ramp / 4095 * 255).astype(np.uint8)
    for factory in ("plant-a", "plant-b"):
        for part in ("train", "test"):
            (tmp_path / factory / part / "ok").mkdir(parents=True)
            Image.fromarray(ramp).save(tmp_path / factory / part / "ok" / "0.png")
            Image.fromarray(eight).save(tmp_path / factory / part / "ok" / "1.png")
            _write(tmp_path / factory / part / "dent" / "2.png", value=0)
    twelve = tmp_path / "plant-a" / "train" / "ok" / "0.png"
    (tmp_path / "plant-a" / "train" / "ok" / "1.png").unlink()  # a folder of the camera's images only: read at 16 bits, it says so
    load_image_folder(tmp_path / "plant-a" / "train", 32, ("ok", "dent"))
    assert re.search(r"exceeds 40\d\d of 65535: a 12-bit camera's 16-bit files\? then set --bit-depth 12", caplog.text)
    caplog.clear()
    load_image_folder(tmp_path / "plant-a" / "train", 32, ("ok", "dent"), bit_depth=12)
    assert "camera's 16-bit files" not in caplog.text
    Image.fromarray(eight).save(tmp_path / "plant-a" / "train" / "ok" / "1.png")
    assert read_image(twelve, 32).max() <= 4095 / 65535 + 1e-6  # dark at 16 bits
    as_eight = read_image(tmp_path / "plant-a" / "train" / "ok" / "1.png", 32)
    assert np.abs(read_image(twelve, 32, bit_depth=12) - as_eight).max() < 0.01
    assert np.abs(decode_image(twelve.read_bytes(), 32, bit_depth=12) - as_eight).max() < 0.01  # Inspection reads it alike
    source = open_source(str(tmp_path / "plant-a" / "train"), "ok,dent", (), SyntheticSpec(), 0, bit_depth=12)
    for limit in (1 << 30, 0):  # kept in memory, and streamed from disk
        data, _ = source.load(DataRequest(("ok", "dent"), 32, 1), limit)
        assert np.abs(data.images_at(np.array([1]))[0] - as_eight).max() < 0.01  # dent/2.png, ok/0.png (12-bit), ok/1.png
    # what the agent and each of its DDP/FSDP workers open (`client.workers` trains on it): the factory's --bit-depth too
    factory = factory_data(AgentConfig(factory_id="plant-a", data=str(tmp_path / "plant-a" / "train"), classes="ok,dent", bit_depth=12,
                                       val_fraction=0.0))
    assert np.abs(factory.split(DataRequest(("ok", "dent"), 32, 1)).train.images_at(np.array([1]))[0] - as_eight).max() < 0.01
    streamed = StreamedImages((twelve,), np.zeros(1, np.int64), ("ok",), 32, 1)
    assert content_keys(streamed) != content_keys(StreamedImages((twelve,), np.zeros(1, np.int64), ("ok",), 32, 1, bit_depth=12))
    Image.fromarray(np.full((8, 8), 5000, np.uint16)).save(tmp_path / "bright.png")
    with pytest.raises(ImageError, match=r"bright\.png: .*expected 12-bit \(0\.\.4095\); is it a camera's 16-bit image"):
        read_image(tmp_path / "bright.png", 32, bit_depth=12)
    with pytest.raises(ValueError, match="bit-depth must be an integer from 8 to 16"):
        AgentConfig(factory_id="plant-a", bit_depth=17)
    with pytest.raises(ValueError, match="data-bit-depth: bit-depth must be an integer from 8 to 16"):
        FederationConfig(data_bit_depth=7)
    *_, flags = own_folders(tmp_path, tmp_path.parent / "demo", {"data-bit-depth": 12})
    assert flags[0][-2:] == ["--bit-depth", "12"]


def test_truncated_and_garbage_files_are_skipped_by_name(tmp_path, caplog):
    for i in range(2):
        _write(tmp_path / "ok" / f"{i}.png", 100 + i)
        _write(tmp_path / "crack" / f"{i}.png", 200 + i)
    good = (tmp_path / "ok" / "0.png").read_bytes()
    (tmp_path / "ok" / "truncated.png").write_bytes(good[: len(good) // 2])
    (tmp_path / "crack" / "garbage.jpg").write_bytes(b"not an image at all")
    data, report = load_image_folder(tmp_path, size=16)
    assert len(data) == 4
    skipped = {p.rsplit("/", 1)[1] for p, _ in report.skipped}
    assert skipped == {"truncated.png", "garbage.jpg"}
    assert "truncated.png" in caplog.text and "garbage.jpg" in caplog.text


def test_every_format_a_camera_or_export_tool_writes_reads_like_its_png(tmp_path):
    """JPEG under its other suffixes (.jfif, .jpe), JPEG 2000 (lossless here, as inspection cameras write it), Targa,
    Windows DIB, PNM/PBM and AVIF are read, not left out for their suffix (uppercase included)."""
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (48, 64), dtype=np.uint8))
    smooth = Image.fromarray(np.tile(np.linspace(0, 255, 64, dtype=np.uint8), (48, 1)))  # what lossy codecs keep
    folder = tmp_path / "good"
    folder.mkdir()
    noise.save(tmp_path / "noise.png")
    smooth.save(tmp_path / "smooth.png")
    exact = {"lossless.jp2": "JPEG2000", "lossless.J2K": "JPEG2000", "frame.tga": "TGA", "frame.dib": "DIB", "frame.pnm": "PPM"}
    for name, fmt in exact.items():
        noise.save(folder / name, format=fmt)
        assert np.array_equal(read_image(folder / name, 32), read_image(tmp_path / "noise.png", 32)), name
    for name, fmt in {"photo.jfif": "JPEG", "photo.JPE": "JPEG", "photo.avif": "AVIF"}.items():
        smooth.save(folder / name, format=fmt, quality=95)
        assert np.abs(read_image(folder / name, 32) - read_image(tmp_path / "smooth.png", 32)).max() < 0.05, name
    bilevel = noise.point(lambda v: 255 if v > 127 else 0).convert("1")
    bilevel.save(folder / "mask.pbm")
    bilevel.save(tmp_path / "mask.png")
    assert np.array_equal(read_image(folder / "mask.pbm", 32), read_image(tmp_path / "mask.png", 32))
    index = index_image_folder(tmp_path, FEDERATION)
    assert sorted(p.name for p in index.paths) == sorted([*exact, "photo.jfif", "photo.JPE", "photo.avif", "mask.pbm"])
    assert index.unread == ()


def test_an_embedded_colour_profile_is_applied_so_a_wide_gamut_cameras_files_read_as_their_srgb_originals(tmp_path):
    """A camera set to Adobe RGB writes its colours in that space, with the profile in the file: read as stored they are
    washed out (this ramp by more than 0.1 of the range); with the profile applied they read as the sRGB original does, in
    PNG, TIFF, JPEG and WebP, with transparency and an EXIF orientation too. A file without a profile, or with a malformed
    one, is read as stored."""
    from PIL import ImageCms

    from tests.icc import wide_gamut_profile

    icc = wide_gamut_profile()
    to_wide = ImageCms.buildTransform(ImageCms.createProfile("sRGB"), ImageCms.ImageCmsProfile(io.BytesIO(icc)), "RGB", "RGB")
    ramp = np.linspace(0, 255, 64)
    original = Image.fromarray(np.stack([np.tile(ramp, (48, 1)), np.full((48, 64), 40.0), np.tile(ramp[::-1], (48, 1))], -1).astype(np.uint8))
    original.save(tmp_path / "original.png")
    want = read_image(tmp_path / "original.png", 32, channels=3)
    wide = Image.fromarray(np.asarray(ImageCms.applyTransform(original, to_wide)))  # its values alone: each save below says its profile
    for name, kw in {"a.png": {}, "a.tif": {}, "a.jpg": {"quality": 95}, "a.webp": {"lossless": True}}.items():
        wide.save(tmp_path / name, icc_profile=icc, **kw)
        assert np.abs(read_image(tmp_path / name, 32, channels=3) - want).max() < (0.05 if name == "a.jpg" else 0.02), name
    wide.save(tmp_path / "stored.png")  # the same values without their profile: taken as sRGB
    assert np.abs(read_image(tmp_path / "stored.png", 32, channels=3) - want).max() > 0.1
    wide.convert("RGBA").save(tmp_path / "cut-out.png", icc_profile=icc)
    assert np.abs(read_image(tmp_path / "cut-out.png", 32, channels=3) - want).max() < 0.02
    exif = Image.Exif()
    exif[0x0112] = 3  # stored upside down
    wide.rotate(180).save(tmp_path / "turned.jpg", quality=95, icc_profile=icc, exif=exif)
    assert np.abs(read_image(tmp_path / "turned.jpg", 32, channels=3) - want).max() < 0.05
    wide.save(tmp_path / "malformed.png", icc_profile=b"not a profile" * 10)
    np.testing.assert_array_equal(read_image(tmp_path / "malformed.png", 32, channels=3), read_image(tmp_path / "stored.png", 32, channels=3))


def test_a_deep_colour_tiffs_embedded_profile_is_applied_as_its_eight_bit_copys_is(tmp_path):
    """A 16-bit colour TIFF exported in a wide-gamut space (Lightroom's 16-bit TIFF export is ProPhoto) reads as the sRGB
    original does, as its 8-bit copy with the same profile does (littlecms, through Pillow), for sRGB's parametric tone
    curve and a pure gamma alike, with alpha too; a profile of no matrix/TRC kind, or a malformed one, leaves the samples
    as stored. The float conversion agrees with littlecms' 8-bit one within a level of 255 on random colours."""
    import tifffile
    from PIL import ImageCms

    from common.data.icc import matrix_shaper_to_srgb
    from common.data.images import _srgb_transform
    from tests.icc import gamma_profile, wide_gamut_profile

    ramp = np.linspace(0, 255, 64)
    original = Image.fromarray(np.stack([np.tile(ramp, (48, 1)), np.full((48, 64), 40.0), np.tile(ramp[::-1], (48, 1))], -1).astype(np.uint8))
    original.save(tmp_path / "original.png")
    want = read_image(tmp_path / "original.png", 32, channels=3)
    colours = np.random.default_rng(0).integers(0, 256, size=(64, 64, 3)).astype(np.uint8)
    for label, icc in (("adobe", wide_gamut_profile()), ("gamma", gamma_profile(1.8))):
        to_wide = ImageCms.buildTransform(ImageCms.createProfile("sRGB"), ImageCms.ImageCmsProfile(io.BytesIO(icc)), "RGB", "RGB")
        wide = np.asarray(ImageCms.applyTransform(original, to_wide)).astype(np.uint16) * 257  # its values as 16-bit samples
        tifffile.imwrite(tmp_path / f"{label}.tif", wide, photometric="rgb", iccprofile=icc)
        tifffile.imwrite(tmp_path / f"{label}-stored.tif", wide, photometric="rgb")
        opaque = np.full((*wide.shape[:2], 1), 65535, np.uint16)
        tifffile.imwrite(tmp_path / f"{label}-alpha.tif", np.concatenate([wide, opaque], -1), photometric="rgb", extrasamples=[2],
                         iccprofile=icc)
        for name in (f"{label}.tif", f"{label}-alpha.tif"):
            assert np.abs(read_image(tmp_path / name, 32, channels=3, bit_depth=16) - want).max() < 0.02, name
        assert np.abs(read_image(tmp_path / f"{label}-stored.tif", 32, channels=3, bit_depth=16) - want).max() > 0.1, label
        littlecms = np.asarray(ImageCms.applyTransform(Image.fromarray(colours), _srgb_transform(icc, "RGB")), np.float64)
        assert np.abs(matrix_shaper_to_srgb(colours / 255.0, icc) * 255 - littlecms).max() < 1.0, label
    stored = read_image(tmp_path / "adobe-stored.tif", 32, channels=3, bit_depth=16)
    wide = tifffile.imread(tmp_path / "adobe-stored.tif")
    lab = ImageCms.ImageCmsProfile(ImageCms.createProfile("LAB")).tobytes()  # a profile of another colour space
    for name, icc in (("lab.tif", lab), ("malformed.tif", b"not a profile" * 10)):
        tifffile.imwrite(tmp_path / name, wide, photometric="rgb", iccprofile=icc)
        np.testing.assert_array_equal(read_image(tmp_path / name, 32, channels=3, bit_depth=16), stored)


def test_files_in_a_format_not_read_are_named_never_dropped_in_silence(tmp_path, caplog):
    """A class folder of a phone's HEIF photographs or a camera's raw files: the index names them (with what to convert
    them to), loading lists them as left out, and a class that gets no image for it is named; notes beside the images are
    mentioned, not listed as left out; a folder of nothing readable says what it holds."""
    for i in range(3):
        _write(tmp_path / "good" / f"{i}.png")
        (tmp_path / "dent" / f"IMG_{i:04d}.HEIC").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "dent" / f"IMG_{i:04d}.HEIC").write_bytes(b"\0\0\0\x18ftypheic" + bytes(64))
    (tmp_path / "good" / "line-3.dng").write_bytes(b"II*\0" + bytes(64))
    (tmp_path / "good" / "xray-7.dcm").write_bytes(bytes(128) + b"DICM")  # an X-ray line's DICONDE file
    (tmp_path / "good" / "README.txt").write_text("shift 2 images")
    with caplog.at_level("INFO"):
        index = index_image_folder(tmp_path, FEDERATION)
    assert index.counts() == {"good": 3}
    assert sorted(p.name for p, _ in index.unread) == ["IMG_0000.HEIC", "IMG_0001.HEIC", "IMG_0002.HEIC", "line-3.dng", "xray-7.dcm"]
    assert all("convert it to PNG, JPEG or TIFF" in why for _, why in index.unread)
    assert "class folder 'dent' holds no image file it reads, so class 'dent' gets no images from it" in caplog.text
    assert "6 files are not read: .heic 3 (e.g. dent/IMG_0000.HEIC), .dcm 1 (e.g. good/xray-7.dcm), .dng 1 (e.g. good/line-3.dng), .txt 1" in caplog.text
    _, report = load_labelled(index, FEDERATION, 16)
    assert report.loaded == 3 and sorted(Path(p).name for p, _ in report.skipped) == sorted(p.name for p, _ in index.unread)
    only_heif = tmp_path / "phone"
    (only_heif / "dent").mkdir(parents=True)
    (only_heif / "dent" / "IMG_0001.heic").write_bytes(bytes(16))
    with pytest.raises(DatasetError, match=r"holds no image files .*1 file is not read: \.heic 1 \(e\.g\. dent/IMG_0001\.heic\)"):
        index_image_folder(only_heif, FEDERATION)


def test_an_agent_indexing_its_folder_every_round_warns_about_the_same_files_once(tmp_path, caplog):
    """The agent indexes its folder again before every round to see images added since: HEIF files, loose images and an
    empty class folder are warned about once, a repeat goes to DEBUG, and a change (one HEIF file more) is warned again."""
    _write(tmp_path / "good" / "0.png")
    _write(tmp_path / "loose.png")
    (tmp_path / "dent").mkdir()
    (tmp_path / "dent" / "IMG_0000.heic").write_bytes(bytes(16))

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

    with caplog.at_level("DEBUG", logger="common.data.folder"):
        for _ in range(3):
            index_image_folder(tmp_path, FEDERATION)
        assert len(warnings()) == 3, warnings()  # loose images, the empty class folder, the file not read: each once
        assert sum("as when this folder was indexed before" in r.getMessage() for r in caplog.records if r.levelname == "DEBUG") == 6
        caplog.clear()
        (tmp_path / "dent" / "IMG_0001.heic").write_bytes(bytes(16))
        index_image_folder(tmp_path, FEDERATION)
    assert any(".heic 2" in w for w in warnings()) and not any("loose.png" in w for w in warnings())


def test_an_image_filed_under_two_classes_is_left_out_naming_every_copy(tmp_path, caplog):
    """An operator copied a dent into good/ instead of moving it: no copy of it trains or is held out, each is named with
    the others, and the factory's split still pairs every image with its own label. A copy within one class, and
    different images of the same size in two classes, are used as they are."""
    rng = np.random.default_rng(0)
    for name, low in (("good", 0), ("dent", 150)):  # dark good parts, bright dents: an image's mean says its folder
        for i in range(6):
            path = tmp_path / name / f"{name}-{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(low, low + 100, (30, 40), dtype=np.uint8)).save(path)
    dent = (tmp_path / "dent" / "dent-0.png").read_bytes()
    (tmp_path / "good" / "dent-0.png").write_bytes(dent)  # the copy in the wrong class
    (tmp_path / "dent" / "dent-0 (2).png").write_bytes(dent)  # and a second copy in its own
    (tmp_path / "good" / "good-0 (2).png").write_bytes((tmp_path / "good" / "good-0.png").read_bytes())  # a copy in its own class only
    index = index_image_folder(tmp_path, FEDERATION)
    data, report = load_labelled(index, FEDERATION, 16)
    left_out = {Path(p).relative_to(tmp_path).as_posix(): why for p, why in report.skipped}
    assert set(left_out) == {"good/dent-0.png", "dent/dent-0.png", "dent/dent-0 (2).png"}
    assert "dent/dent-0.png (dent), good/dent-0.png (good)" in left_out["dent/dent-0 (2).png"]
    assert "delete the wrong ones" in left_out["good/dent-0.png"]
    assert "3 files are copies of one image filed under two or more classes" in caplog.text
    good, dent = FEDERATION.index("good"), FEDERATION.index("dent")
    assert sorted(data.labels.tolist()) == [good] * 7 + [dent] * 5
    source = open_source(str(tmp_path), ",".join(FEDERATION), [], None, 0)  # the factory's held-out split leaves them out too
    split = FactoryData(source, 0.25, 0, 1 << 30).split(DataRequest(FEDERATION, 16, 1))
    assert len(split.train) + len(split.held_out) == 12 and len(split.report.skipped) == 3
    for part in (split.train, split.held_out):  # every image it keeps is paired with its own folder's label
        means = part.images_at(np.arange(len(part))).mean(axis=(1, 2, 3))
        assert np.array_equal(np.where(means > 0.5, dent, good), np.asarray(part.labels))


def test_a_folder_over_the_memory_limit_streams_from_disk(tmp_path):
    for i in range(40):
        _write(tmp_path / ("ok" if i % 2 else "pit") / f"{i}.png", 5 * i, size=(50, 50), mode="RGB")
    in_memory, report = load_image_folder(tmp_path, size=32, channels=3)
    assert not report.streamed
    limit = 10 * 3 * 32 * 32 * 4  # room for 10 decoded images, the folder holds 40
    streamed, report = load_image_folder(tmp_path, size=32, channels=3, memory_limit=limit)
    assert report.streamed and isinstance(streamed, StreamedImages) and not hasattr(streamed, "images")
    idx = np.array([3, 17, 39])
    assert np.array_equal(streamed.images_at(idx), in_memory.images_at(idx))
    assert np.array_equal(streamed.labels, in_memory.labels)
    sub = streamed.subset(np.array([0, 1]))
    assert len(sub) == 2 and sub.images_at(np.array([1])).shape == (1, 3, 32, 32)


def test_empty_and_missing_folders_are_refused(tmp_path):
    (tmp_path / "ok").mkdir()
    with pytest.raises(DatasetError, match="no image files"):
        index_image_folder(tmp_path)
    with pytest.raises(DatasetError, match="does not exist"):
        index_image_folder(tmp_path / "nope")


def test_the_quality_bench_compares_on_your_own_folders(tmp_path):
    """`bench/quality.py --folders --dp`: the issue's comparison (global, pooled, served vs local, and under DP the global
    model and what each factory serves, trained within the subspace of ROOT/proxy's public images) on image folders with
    other class names and a class one factory lacks; a wrong layout is refused naming what is missing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    rng = np.random.default_rng(0)
    for factory, classes in (("plant-a", ("bolt", "nut", "washer")), ("plant-b", ("bolt", "nut"))):
        for part, count in (("train", 12), ("test", 6)):
            for c, name in enumerate(classes):
                for k in range(count):
                    _write(tmp_path / "root" / factory / part / name / f"{k}.png", value=int(40 + 80 * c + rng.integers(0, 20)))
    for k in range(20):  # public images of the domain, unlabelled: the DP factories learn the subspace they train in from them
        _write(tmp_path / "root" / "proxy" / "line-3" / f"{k}.png", value=int(40 + 8 * k))
    bench = Path(__file__).resolve().parents[1] / "bench" / "quality.py"
    run = subprocess.run([sys.executable, str(bench), "--folders", str(tmp_path / "root"), "--recipes", "default", "--seeds", "0",
                          "--workdir", str(tmp_path / "work"), "--threads", "1", "--dp"], capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 factories from" in run.stdout and "['bolt', 'nut', 'washer']" in run.stdout  # proxy/ is no factory
    assert "read as grey at 128 px" in run.stdout  # --channels auto: grey images; the default recipe's backbone input size
    assert '"dp_public_images": 20' in run.stdout
    row = next(line for line in run.stdout.splitlines() if line.startswith("| folders |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # global, pooled (the federation's loss: each image adjusted by its factory's prior), pooled on plain cross-entropy
    assert all(0.0 <= float(cells[i]) <= 1.0 for i in (2, 3, 4)) and cells[6].endswith("/1 seeds"), row
    assert '"pooled_tau": 1.0' in run.stdout  # the head's default head-logit-adjustment
    better, tied, worse = (int(v.split("(")[0]) for v in cells[7].split(" / "))  # served vs local, counted over the 2 factories
    assert better + tied + worse == 2 and "(" in cells[7], row
    dp_mean, dp_worst = (float(v) for v in cells[10].split(","))  # DP served - served: mean, worst factory
    assert 0.0 <= float(cells[9]) <= 1.0 and -1.0 <= dp_worst <= dp_mean <= 1.0, row
    gained = next(line for line in run.stdout.splitlines() if line.startswith("| folders |") and line.count("|") == 6)
    per_factory = [int(v.rstrip("*")) for v in gained.strip("|").split("|")[3].split()]  # served - local in test images, per factory
    assert len(per_factory) == 2 and sum(v > 0 for v in per_factory) == better and sum(v < 0 for v in per_factory) == worse, gained
    # the centralised reference (the pooled model with each factory's prior), counted and listed like the served model
    c_better, c_tied, c_worse = (int(v.split("(")[0]) for v in cells[11].split(" / "))
    central = [int(v.rstrip("*")) for v in gained.strip("|").split("|")[4].split()]
    assert len(central) == 2 and (sum(v > 0 for v in central), sum(v == 0 for v in central), sum(v < 0 for v in central)) == (c_better, c_tied, c_worse)

    assert '"dp_subspace_dims": 19' in run.stdout  # the run's 40 directions, capped by the 20 public images' rank

    # factories that share the secure sum's noise, as a secure round of 2 would let them: the default threshold 2, no colluder;
    # the images read as RGB at another size (a colour line's run config); factory training keys set for the run; no --workdir:
    # the temporary one (feature caches, factory state) is gone when the bench ends
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    run = subprocess.run([sys.executable, str(bench), "--folders", str(tmp_path / "root"), "--recipes", "default", "--seeds", "0",
                          "--threads", "1", "--dp", "--dp-secure-sum", "--dp-rounds", "2",
                          "--channels", "3", "--image-size", "48", "--set", "public-subspace=8", "--set", "personal-epochs=0"],
                         capture_output=True, text=True, timeout=600, check=False, env={**os.environ, "TMPDIR": str(tmpdir)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert not [p.name for p in tmpdir.iterdir() if p.name.startswith("fedforge-quality-")]
    assert '"dp_rounds": 2, "dp_noise_holders": 2' in run.stdout and "read as RGB at 48 px" in run.stdout
    assert '"dp_subspace_dims": 8' in run.stdout and "Set for every factory: personal-epochs = 0, public-subspace = 8" in run.stdout
    for bad, says in (("lr=0.1", "choose a recipe with --recipes"), ("public-subspace=many", "'public-subspace' must be a int"),
                      ("no-such-key=1", "not a factory training key")):
        refused = subprocess.run([sys.executable, str(bench), "--set", bad], capture_output=True, text=True, timeout=120, check=False)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr[-2000:]

    (tmp_path / "root" / "plant-b" / "train").rename(tmp_path / "elsewhere")  # a test folder without a training folder
    run = subprocess.run([sys.executable, str(bench), "--folders", str(tmp_path / "root")], capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "TMPDIR": str(tmpdir)})
    assert run.returncode != 0 and "plant-b/train" in run.stderr + run.stdout
    assert not [p.name for p in tmpdir.iterdir() if p.name.startswith("fedforge-quality-")]  # nor by a refused command


def test_a_recipe_keeps_its_own_training_keys_under_set(monkeypatch):
    """`--set` adds to a recipe's own factory training keys; it does not drop them (a recipe defined with settings, or
    `with_settings` called twice, trains with all of them)."""
    import importlib
    from dataclasses import replace
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    quality = importlib.import_module("quality")

    recipe = replace(quality.RECIPES["default"], settings=(("head-proximal-mu", 1.0),))
    for overrides in ({}, {"public-subspace": 8}):
        training = recipe.with_settings(overrides).federation(0).training
        assert training.head_proximal_mu == 1.0 and training.public_subspace == overrides.get("public-subspace", 40)
    assert recipe.with_settings({"head-proximal-mu": 0.5}).federation(0).training.head_proximal_mu == 0.5


def test_a_recipes_server_step_is_its_lines_and_the_other_line_keeps_the_products(monkeypatch):
    """A recipe's server lr is its family's (head-server-lr or server-lr); the other keeps the product's default, so a cnn-*
    recipe's line steps as `fedforge run` steps a cnn-* line, with the --dp-secure-sum step every line is sent."""
    import importlib
    from pathlib import Path

    from server.config import FederationConfig

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    quality = importlib.import_module("quality")

    product = FederationConfig()
    head, cnn = quality.RECIPES["default"].federation(0), quality.RECIPES["cnn"].federation(0)
    assert head.server_lr_for("effnet-lite0") == product.head_server_lr and cnn.server_lr_for("cnn-small") == product.server_lr
    assert cnn.train_config(1, "cnn-small")["secure-sum-lr"] == product.train_config(1, "cnn-small")["secure-sum-lr"]


def test_an_alias_to_a_spelling_the_case_merge_outvotes_follows_it(tmp_path):
    """--class-alias washer=Nut where most folders spell it "nut": washer's images join the one class "nut", never a
    class "Nut" of their own beside it."""
    from common.data.layout import FolderFederation

    for factory, classes in (("a", ("nut", "bolt")), ("b", ("nut", "washer", "bolt"))):
        for split in ("train", "test"):
            for name in classes:
                _write(tmp_path / factory / split / name / "0.png")
    folders = FolderFederation.at(tmp_path, split_dir=tmp_path.parent / f"{tmp_path.name}-split", aliases={"washer": "Nut"})
    assert folders.classes == ("bolt", "nut") and folders.aliases == {"Nut": "nut", "washer": "nut"}


def test_the_quality_bench_takes_a_class_only_the_central_test_set_holds(monkeypatch, tmp_path):
    """A class that no factory's folders hold but ROOT/test does (a defect no line has seen yet) is one of the run's
    classes, which the global model is scored on, not a folder the bench refuses as fitting no class."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    quality = importlib.import_module("quality")
    for factory, classes in (("plant-a", ("bolt", "nut")), ("plant-b", ("nut",))):
        for part in ("train", "test"):
            for name in classes:
                _write(tmp_path / factory / part / name / "0.png")
    for name in ("bolt", "washer"):
        _write(tmp_path / "test" / name / "0.png")
    (tmp_path / "plant-a" / "train" / ".ipynb_checkpoints").mkdir()  # hidden folders are neither classes nor factories
    (tmp_path / ".cache").mkdir()
    folders = quality.Folders.at(tmp_path)
    assert folders.classes == ("bolt", "nut", "washer") and folders.central_test == tmp_path / "test"
    assert [d.name for d in folders.factories] == ["plant-a", "plant-b"]
    central = folders.test_set(folders.central_test, 32, 1)
    assert sorted(central.labels.tolist()) == [0, 2]


def test_other_names_for_the_central_test_and_proxy_folders_are_never_taken_for_factories(tmp_path):
    """Other data sets write the central test set as `Central-Test/` or `holdout/` and the public images as `unlabelled/`:
    read as unsplit factories, the federation would train on its own test set. They take those roles; two candidates for
    one role are refused by name, and a folder of images without class folders is told where public images go."""
    from common.data.layout import FolderFederation

    for factory in ("plant-a", "plant-b"):
        for part in ("train", "test"):
            _write(tmp_path / factory / part / "bolt" / "0.png")
    _write(tmp_path / "Central-Test" / "nut" / "0.png")
    _write(tmp_path / "unlabelled" / "1.png")
    folders = FolderFederation.at(tmp_path)
    assert [d.name for d in folders.factories] == ["plant-a", "plant-b"]
    assert folders.central_test == tmp_path / "Central-Test" and folders.proxy == tmp_path / "unlabelled"
    assert folders.classes == ("bolt", "nut") and folders.no_public_images() == ""
    _write(tmp_path / "holdout" / "nut" / "0.png")
    with pytest.raises(DatasetError, match=r"\['Central-Test', 'holdout'\] could each be the central test set"):
        FolderFederation.at(tmp_path)
    (tmp_path / "holdout").rename(tmp_path / "extras")
    (tmp_path / "extras" / "nut" / "0.png").rename(tmp_path / "extras" / "0.png")
    (tmp_path / "extras" / "nut").rmdir()
    with pytest.raises(DatasetError, match=r"\['extras'\] hold images but no class folders: .* name the folder proxy/"):
        FolderFederation.at(tmp_path)
    (tmp_path / "extras" / "0.png").unlink()
    (tmp_path / "extras").rmdir()
    (tmp_path / "sites").mkdir()  # the factories in one folder of ROOT's: they are still the factories, beside ROOT's test and proxy
    for factory in ("plant-a", "plant-b"):
        (tmp_path / factory).rename(tmp_path / "sites" / factory)
    nested = FolderFederation.at(tmp_path)
    assert [d.name for d in nested.factories] == ["plant-a", "plant-b"] and nested.trains[0] == tmp_path / "sites" / "plant-a" / "train"
    assert nested.central_test == tmp_path / "Central-Test" and nested.proxy == tmp_path / "unlabelled"
    (tmp_path / "unlabelled" / "1.png").unlink()
    (tmp_path / "unlabelled").rmdir()
    assert "no proxy folder" in FolderFederation.at(tmp_path).no_public_images()  # under DP: the whole head, and the user is told


def test_a_factorys_training_and_test_folders_are_found_whatever_their_case(tmp_path, caplog):
    """`Training/` and `Validation/` (as a Windows export writes them) are a factory's training and test folders, not two
    classes of images. Two folders that name the same one (`train/` and `Train/`) are refused by name. Files and folders
    starting with `.` (macOS resource forks `._x.jpg`, `.thumbnails/`) are never read, nor warned about as loose images;
    linked folders are."""
    from common.data.folder import load_unlabelled_folder
    from common.data.layout import FolderFederation

    for factory in ("Werk A", "Werk B"):
        _write(tmp_path / factory / "Training" / "Kratzer" / "0.png")
        _write(tmp_path / factory / "Hold-Out" / "OK" / "0.png")
        (tmp_path / factory / "Training" / "._0.png").write_bytes(b"\x00\x05\x16\x07 resource fork")
        (tmp_path / factory / "Training" / "Kratzer" / "._0.png").write_bytes(b"\x00\x05\x16\x07 resource fork")
        _write(tmp_path / factory / "Training" / "Kratzer" / ".thumbnails" / "0.png")
    _write(tmp_path / "Public" / "0.png")
    (tmp_path / "Public" / "._0.png").write_bytes(b"\x00\x05\x16\x07 resource fork")
    folders = FolderFederation.at(tmp_path, split_dir=tmp_path.parent / "split")
    assert folders.trains == (tmp_path / "Werk A" / "Training", tmp_path / "Werk B" / "Training") and folders.split == ()
    assert folders.tests[1] == tmp_path / "Werk B" / "Hold-Out" and folders.classes == ("Kratzer", "OK")
    data, report = load_image_folder(folders.trains[0], 16, folders.classes)
    assert len(data) == 1 and report.skipped == [] and "outside any class folder" not in caplog.text
    images, report = load_unlabelled_folder(folders.proxy, 16)
    assert len(images) == 1 and report.skipped == []
    _write(tmp_path.parent / "nas" / "line-2" / "0.png")  # a linked folder is read (each real folder once: no loop)
    (tmp_path / "Werk A" / "Training" / "Kratzer" / "line-2").symlink_to(tmp_path.parent / "nas" / "line-2")
    (tmp_path.parent / "nas" / "line-2" / "loop").symlink_to(tmp_path.parent / "nas")
    data, report = load_image_folder(folders.trains[0], 16, folders.classes)
    assert len(data) == 2 and report.skipped == []
    _write(tmp_path / "Werk B" / "training" / "OK" / "0.png")
    with pytest.raises(DatasetError, match=r"Werk B: \['Training', 'training'\] could each be its train folder"):
        FolderFederation.at(tmp_path, split_dir=tmp_path.parent / "split")
    # `fedforge client --data` pointed at the factory's folder rather than its training folder is told which to use
    with pytest.raises(DatasetError, match=r"holds \['Hold-Out', 'Training'\], which look like a data set's splits.*e.g. .*Werk A/Training"):
        index_image_folder(tmp_path / "Werk A", folders.classes)
    assert len(index_image_folder(tmp_path / "Werk A", ("Hold-Out", "Training")).paths) == 3  # unless the classes are so named


def test_a_root_split_first_holds_the_factories_inside_its_train_and_test_folders(tmp_path):
    """Data sets are as often written split first (`train/<factory>/<class>`, `test/<factory>/<class>`): there `test/` holds
    the factories' own test images, not the central test set, and a factory without a test folder is split as an unsplit
    one. A `test/` of classes beside a `val/` of factories is still the central test set; a test folder of a factory that has
    no training folder is refused by name rather than dropped. In the usual layout, a training folder without a test folder
    beside it is split the same way, and a ROOT that holds one folder is read inside it."""
    from common.data.layout import FolderFederation

    for factory in ("plant-a", "plant-b", "plant-c"):
        for i in range(4):
            _write(tmp_path / "Train" / factory / "bolt" / f"{i}.png")
    for factory in ("plant-a", "plant-b"):
        _write(tmp_path / "test" / factory / "nut" / "0.png")
    _write(tmp_path / "unlabeled" / "0.png")
    _write(tmp_path / "central" / "washer" / "0.png")  # not a name of the central test set: said to be unread, never dropped silently
    folders = FolderFederation.at(tmp_path, split_dir=tmp_path.parent / "split")
    assert [d.name for d in folders.factories] == ["plant-a", "plant-b", "plant-c"] and folders.central_test is None
    assert folders.ignored == ("central",) and re.search(r"\['central'\] not read.*central test set \(test_set/, central_test/.*rename",
                                                          folders.describe_ignored())
    assert folders.trains[:2] == (tmp_path / "Train" / "plant-a", tmp_path / "Train" / "plant-b")
    assert folders.tests[:2] == (tmp_path / "test" / "plant-a", tmp_path / "test" / "plant-b")
    assert folders.split == ("plant-c",) and len(list((tmp_path.parent / "split" / "plant-c" / "test" / "bolt").iterdir())) == 1
    assert folders.classes == ("bolt", "nut") and folders.proxy == tmp_path / "unlabeled"
    (tmp_path / "test").rename(tmp_path / "val")
    _write(tmp_path / "test" / "washer" / "0.png")
    both = FolderFederation.at(tmp_path, split_dir=tmp_path.parent / "split")
    assert both.central_test == tmp_path / "test" and both.tests[0] == tmp_path / "val" / "plant-a" and both.ignored == ("central",)
    assert both.classes == ("bolt", "nut", "washer")
    _write(tmp_path / "val" / "plant-z" / "nut" / "0.png")
    with pytest.raises(DatasetError, match=r"\['plant-z'\] have no training folder in .*Train"):
        FolderFederation.at(tmp_path, split_dir=tmp_path.parent / "split")
    usual = tmp_path.parent / "usual"  # the usual layout, one factory with a training folder and no test folder: it is split too
    for i in range(4):
        _write(usual / "plant-a" / "train" / "bolt" / f"{i}.png")
        _write(usual / "plant-b" / "train" / "bolt" / f"{i}.png")
    _write(usual / "plant-b" / "test" / "nut" / "0.png")
    one = FolderFederation.at(usual, split_dir=tmp_path.parent / "split-usual")
    assert one.describe_ignored() == ""  # in the usual layout every other folder is a factory
    assert one.split == ("plant-a",) and one.tests[1] == usual / "plant-b" / "test"
    assert len(list(one.trains[0].glob("bolt/*"))) == 3 and len(list(one.tests[0].glob("bolt/*"))) == 1
    _write(usual / "holdout" / "nut" / "0.png")  # all of it inside one folder of ROOT (an unpacked archive): found there
    (tmp_path.parent / "archive").mkdir()
    usual.rename(tmp_path.parent / "archive" / "usual")
    wrapped = FolderFederation.at(tmp_path.parent / "archive", split_dir=tmp_path.parent / "split-archive")
    assert [d.name for d in wrapped.factories] == ["plant-a", "plant-b"] and wrapped.central_test == tmp_path.parent / "archive" / "usual" / "holdout"
    for name in ("bolt", "nut"):  # but one factory whose class folders hold dated folders is one factory, not a federation of classes
        _write(tmp_path.parent / "one" / "plant-a" / name / "2024-05" / "0.png")
    with pytest.raises(DatasetError, match=r"expected two or more factory folders.*found \['plant-a'\]"):
        FolderFederation.at(tmp_path.parent / "one")


def test_the_quality_bench_reads_val_folders_and_splits_a_factory_without_any(monkeypatch, tmp_path):
    """Data sets name a factory's held-out folder `val` as often as `test`, or give a factory only its class folders: the
    bench takes the first and holds every 4th image of each class out of the second, the same images on every run."""
    import importlib
    import shutil
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    quality = importlib.import_module("quality")
    work, tmp_path = tmp_path, tmp_path / "root"  # ROOT, and beside it where the splits go
    for part in ("training", "val"):
        _write(tmp_path / "plant-a" / part / "bolt" / "0.png")
    for offset, (name, count) in enumerate((("bolt", 8), ("nut", 3), ("washer", 1))):
        for i in range(count):
            _write(tmp_path / "plant-b" / name / "deep" / f"{i}.png", 10 * i + 100 * offset)
    folders = quality.Folders.at(tmp_path, split_dir=work / "split")
    assert folders.classes == ("bolt", "nut", "washer")
    assert folders.trains[0] == tmp_path / "plant-a" / "training" and folders.tests[0] == tmp_path / "plant-a" / "val"
    train, test = (load_image_folder(d, 8, folders.classes)[0] for d in (folders.trains[1], folders.tests[1]))
    assert np.bincount(test.labels, minlength=3).tolist() == [2, 1, 0] and np.bincount(train.labels, minlength=3).tolist() == [6, 2, 1]
    held_out = sorted(p.resolve() for p in folders.tests[1].rglob("*.png"))
    assert sorted(p.resolve() for p in quality.Folders.at(tmp_path, split_dir=work / "again").tests[1].rglob("*.png")) == held_out
    assert not set(held_out) & {p.resolve() for p in folders.trains[1].rglob("*.png")}
    monkeypatch.chdir(work)  # a relative ROOT gives paths other processes (the demo's server and factories) can open
    relative = quality.Folders.at("root", split_dir="inside-no-factory")
    assert all(p.is_absolute() for p in (*relative.trains, *relative.tests, relative.proxy or work)) and len(relative.factories) == 2
    (tmp_path / "fedforge-demo" / "split").mkdir(parents=True)  # the demo's work directory inside ROOT is no factory either
    assert [d.name for d in quality.Folders.at(tmp_path, split_dir=tmp_path / "fedforge-demo" / "split").factories] == ["plant-a", "plant-b"]
    shutil.rmtree(tmp_path / "fedforge-demo")
    assert folders.case_clashes() == ""
    (tmp_path / "plant-z" / "train" / "bolt").mkdir(parents=True)  # a factory with folders but no images is named, not trained
    (tmp_path / "plant-z" / "test").mkdir()
    with pytest.raises(DatasetError, match=r"plant-z/train', '.*plant-z/test'\] hold no image files"):
        quality.Folders.at(tmp_path, split_dir=work / "empty")
    shutil.rmtree(tmp_path / "plant-z")
    _write(tmp_path / "plant-a" / "training" / "Nut" / "0.png")  # two folders that differ only in case: one class, as most folders spell it
    clash = quality.Folders.at(tmp_path, split_dir=work / "clash")
    assert clash.classes == ("bolt", "nut", "washer") and clash.alias_flags() == ["--class-alias", "Nut=nut"]
    assert "one class (Nut=nut" in clash.case_clashes()
    nuts = load_image_folder(clash.trains[0], 8, clash.classes, aliases=clash.aliases)[0].labels.tolist().count(1)
    assert nuts == len(list((clash.trains[0] / "nut").glob("*.png"))) + 1  # Nut's image is a nut
    listed = quality.Folders.at(tmp_path, classes="Nut,bolt,nut,washer", split_dir=work / "listed")  # a list given is the user's word
    assert listed.classes == ("Nut", "bolt", "nut", "washer") and "drop 'nut' from it and add --class-alias nut=Nut" in listed.case_clashes()
    shutil.rmtree(tmp_path / "plant-a" / "training" / "Nut")
    aliased = quality.Folders.at(tmp_path, split_dir=work / "aliased", aliases={"washer": "nut"})  # --class-alias washer=nut
    assert aliased.classes == ("bolt", "nut") and aliased.alias_flags() == ["--class-alias", "washer=nut"]
    central = aliased.central_test_folder(work / "central")  # no ROOT/test: links to every factory's test images, by class
    assert sorted(p.name for p in central.iterdir()) == ["bolt", "nut"] and len(list(central.rglob("*.png"))) == 1 + 2 + 1
    # --channels auto: grey images (also saved as RGB JPEG) read as grey; one colour factory makes the run read RGB
    _write(tmp_path / "plant-a" / "training" / "nut" / "grey.jpg", 120, mode="RGB")
    assert folders.channels() == 1
    tinted = np.zeros((30, 40, 3), np.uint8) + np.array([150, 110, 60], np.uint8)
    Image.fromarray(tinted).save(tmp_path / "plant-a" / "training" / "bolt" / "0.png")
    assert folders.channels() == 3


def test_class_names_with_spaces_and_other_scripts_load_and_survive_the_run_config(tmp_path):
    """A factory's own folder names ("Scratch Mark", "Ölfleck") are class names: they load, match across Unicode forms
    (a folder written in NFD, as macOS does, is the NFC name in the list), and reach the ServerApp unchanged through
    Flower's --run-config parsing; characters the plumbing gives a meaning are refused, naming the class."""
    import unicodedata

    from flwr.common.config import parse_config_args

    from server.launch import _overrides

    classes = "ok, Scratch Mark ,Ölfleck,破损"
    assert parse_classes(classes) == ("ok", "Scratch Mark", "Ölfleck", "破损")
    _write(tmp_path / "ok" / "a.png", 10)
    _write(tmp_path / "Scratch Mark" / "b.png", 90)
    _write(tmp_path / unicodedata.normalize("NFD", "Ölfleck") / "c.png", 200)
    _write(tmp_path / "Schmutz" / "d.png", 250)
    data, _ = load_image_folder(tmp_path, 8, parse_classes(classes), aliases=parse_aliases(["Schmutz=破损"]))
    assert sorted(data.labels.tolist()) == [0, 1, 2, 3]
    assert parse_config_args([_overrides({"classes": classes, "lr": 0.1})]) == {"classes": classes, "lr": 0.1}
    for bad, char in (("ok,scratch=mark", "'='"), ('ok,"mark"', "'\\\"'"), ("ok,a/b", "'/'"), ("ok,tab\tmark", "'\\\\t'")):
        with pytest.raises(ClassListError, match=f"class name .* must not contain {char}"):
            parse_classes(bad)
    with pytest.raises(ClassListError, match="must not start with '.'"):
        parse_classes("ok,.hidden")
    with pytest.raises(ClassListError, match="1-64 characters"):
        parse_classes(["ok", "x" * 65])


def test_a_factory_with_colour_images_in_a_grey_run_says_so(tmp_path, caplog):
    """Colour read as grey throws information away (3.8-4.7 points on two held-out colour data sets): the factory's log
    says so when a run asks for grey; grey images, also saved as RGB, read as grey without a word."""
    import logging

    for i in range(4):
        _write(tmp_path / "grey" / "ok" / f"{i}.jpg", 100 + i, mode="RGB")
        tint = np.zeros((30, 40, 3), np.uint8) + np.array([140 + i, 100, 60], np.uint8)
        (tmp_path / "colour" / "ok").mkdir(parents=True, exist_ok=True)
        Image.fromarray(tint).save(tmp_path / "colour" / "ok" / f"{i}.png")
    for folder, warned in (("grey", False), ("colour", True)):
        source = open_source(str(tmp_path / folder), ",".join(CLASSES), (), None, 0)  # type: ignore[arg-type]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="client.data"):
            source.load(DataRequest(CLASSES, 16, 1), 1 << 30)
            source.load(DataRequest(CLASSES, 16, 3), 1 << 30)
        assert ("holds colour images" in caplog.text and "channels = 3" in caplog.text) == warned, caplog.text
