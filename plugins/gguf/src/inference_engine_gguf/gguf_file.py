"""Opening a ``.gguf`` file (or the folder holding one) with errors that say what is wrong.

The ``gguf`` package's :class:`gguf.GGUFReader` memory-maps the file; tensor
data is only read when a tensor is used. This module adds the checks the reader
leaves to its caller: a truncated file, a corrupt header, and a folder that
holds no or several ``.gguf`` files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType

from inference_engine_gguf.ggml_types import check_supported

__all__ = ["GGUFFile", "GGUFFileError", "TensorInfo", "resolve_gguf_path"]

T = GGMLQuantizationType
GGUF_MAGIC = b"GGUF"


class GGUFFileError(ValueError):
    """The path is not a readable, complete GGUF file."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of the file, as GGML describes it."""

    # GGML tensor name (``blk.0.attn_q.weight``).
    name: str
    # Its GGML type.
    qtype: GGMLQuantizationType
    # Logical shape, outermost first (torch order): ``[N, K]`` for a matrix.
    shape: tuple[int, ...]
    # Position in the file's tensor list.
    index: int


def resolve_gguf_path(path: str) -> str:
    """The ``.gguf`` file a model path names: the file itself, or the one inside a folder.

    Raises:
        GGUFFileError: for a missing path, or a folder with no or several .gguf files.
    """
    if os.path.isdir(path):
        found = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if not found:
            raise GGUFFileError(f"folder {path!r} holds no .gguf file")
        if len(found) > 1:
            raise GGUFFileError(
                f"folder {path!r} holds several .gguf files ({', '.join(found)}); pass the one "
                f"to load as --model (split GGUF files are not supported)"
            )
        return os.path.join(path, found[0])
    if not os.path.exists(path):
        raise GGUFFileError(f"GGUF file {path!r} does not exist")
    return path


class GGUFFile:
    """A parsed GGUF file: metadata by key and tensors by GGML name.

    Raises (from the constructor):
        GGUFFileError: not a GGUF file, a corrupt header, or a file shorter than
            its tensor table says (truncated).
    """

    def __init__(self, path: str) -> None:
        self.path = resolve_gguf_path(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise GGUFFileError(
                f"{self.path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')"
            )
        try:
            self._reader = GGUFReader(self.path)
        except Exception as exc:  # the reader raises ValueError, IndexError, KeyError...
            raise GGUFFileError(
                f"{self.path} ({size} bytes) cannot be parsed as GGUF; it is truncated or "
                f"corrupt: {type(exc).__name__}: {exc}"
            ) from exc
        self.tensors: dict[str, TensorInfo] = {}
        for index, t in enumerate(self._reader.tensors):
            end = t.data_offset + t.n_bytes
            if end > size:
                raise GGUFFileError(
                    f"{self.path} is truncated: tensor {t.name!r} ends at byte {end} but the "
                    f"file has {size} bytes"
                )
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            self.tensors[t.name] = TensorInfo(t.name, T(int(t.tensor_type)), shape, index)

    # ----------------------------------------------------------------- metadata
    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (str, number, bool or list), or ``default`` if absent."""
        field = self._reader.get_field(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        """A metadata value that must be present.

        Raises:
            GGUFFileError: naming the missing key.
        """
        value = self.get(key)
        if value is None:
            raise GGUFFileError(f"{self.path} lacks the metadata key {key!r}")
        return value

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    # ------------------------------------------------------------------ tensors
    def raw(self, name: str) -> torch.Tensor:
        """The tensor's stored form, read from the file into memory.

        F32/F16/BF16 come back as float tensors of that dtype ``[..., K]``; block
        types as uint8 ``[..., row_bytes]`` (see :func:`~inference_engine_gguf.dequant.dequantize`).

        Raises:
            UnsupportedGGMLTypeError: for a type this plugin cannot dequantize.
        """
        info = self.tensors[name]
        qtype = check_supported(info.qtype, name)
        data = self._reader.tensors[info.index].data
        array = np.array(data, copy=True)  # out of the memory map
        tensor = torch.from_numpy(array)
        if qtype == T.BF16:
            tensor = tensor.view(torch.bfloat16)
        return tensor
