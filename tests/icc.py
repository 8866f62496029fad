"""A wide-gamut ICC profile for tests, made here: no profile file ships with Pillow, and none can be downloaded."""

import struct

# Adobe RGB (1998)'s primaries, adapted to the D50 white of ICC's connection space
ADOBE_RGB_PRIMARIES = {b"rXYZ": (0.6097, 0.3111, 0.0195), b"gXYZ": (0.2053, 0.6257, 0.0609), b"bXYZ": (0.1492, 0.0632, 0.7446)}


def wide_gamut_profile() -> bytes:
    """littlecms' built-in sRGB profile with its colorant tags set to Adobe RGB's primaries: a matrix profile that converts
    as an Adobe RGB camera's does (within a level of 255; its tone curve stays sRGB's), with the profile ID cleared."""
    from PIL import ImageCms

    data = bytearray(ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes())
    (count,) = struct.unpack(">I", data[128:132])
    for i in range(count):
        signature, offset, _ = struct.unpack(">4sII", data[132 + 12 * i:144 + 12 * i])
        if signature in ADOBE_RGB_PRIMARIES:  # an XYZ tag: 'XYZ ', 4 reserved bytes, three s15Fixed16 numbers
            data[offset + 8:offset + 20] = struct.pack(">3i", *(round(v * 65536) for v in ADOBE_RGB_PRIMARIES[signature]))
    data[84:100] = bytes(16)
    return bytes(data)


def gamma_profile(gamma: float = 1.8) -> bytes:
    """`wide_gamut_profile` with a pure power tone curve (a ``curv`` tag of one gamma, as ProPhoto's 1.8) in place of
    sRGB's parametric one: the other kind of tone curve an editor's profile carries."""
    data = bytearray(wide_gamut_profile())
    (count,) = struct.unpack(">I", data[128:132])
    for i in range(count):
        signature, offset, size = struct.unpack(">4sII", data[132 + 12 * i:144 + 12 * i])
        if signature in (b"rTRC", b"gTRC", b"bTRC"):  # the three share one tag's bytes
            data[offset:offset + size] = (b"curv" + bytes(4) + struct.pack(">IH", 1, round(gamma * 256))).ljust(size, b"\0")
    return bytes(data)
