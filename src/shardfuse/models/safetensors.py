"""The safetensors format: tensors of a checkpoint directory, read lazily, and written.

A file is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, byte offsets) and the raw bytes. `SafetensorsDir` memory-maps the files
of a directory (one `model.safetensors`, or the shards of
`model.safetensors.index.json`), so reading a slice reads only its bytes;
bfloat16 comes through `ml_dtypes`. `shardfuse.models.hf` builds on it.
"""

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}  # fmt: skip
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsDir:
    """The tensors of a checkpoint directory (`model.safetensors` or an index of shards).

    Files are opened (memory-mapped) on first use, so a process that reads only some
    tensors opens only their files; `opened` records which, `reads` every slice read
    as `(name, index)`, and `bytes_read` the bytes of those slices. `on_read`, when set
    to a callable, is called as `on_read(name, index, nbytes)` after each read (the
    hook `load_hf(on_read=...)` uses to attribute reads to parameters).

    Raises:
      ValueError: no safetensors file, an index naming a missing file, a corrupt header.

    Example:
      >>> import numpy as np, tempfile
      >>> from shardfuse.models import safetensors as st
      >>> d = tempfile.mkdtemp()
      >>> st.write_safetensors(f"{d}/model.safetensors", {"w": np.eye(3, dtype=np.float32)})
      >>> st.SafetensorsDir(d).read("w", (slice(1, 3), slice(None))).tolist()
      [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    """

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"checkpoint path {str(path)!r} is not a directory")
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            self.files = dict(json.loads(index.read_text())["weight_map"])
        elif (self.path / "model.safetensors").exists():
            self.files = None  # one file: its header names the tensors
        else:
            raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path}")
        for file in set((self.files or {}).values()):
            if not (self.path / file).exists():
                raise ValueError(f"the index names shard file {file!r}, missing from {path}")
        self._open = {}
        self.opened, self.reads, self.bytes_read, self.on_read = [], [], 0, None
        if self.files is None:
            self.files = {name: "model.safetensors" for name in self._header("model.safetensors")}

    def _header(self, file):
        if file not in self._open:
            raw = np.memmap(self.path / file, dtype=np.uint8, mode="r")
            if raw.size < 8:
                raise ValueError(f"{file}: not a safetensors file (too short)")
            (size,) = struct.unpack("<Q", bytes(raw[:8]))
            try:
                header = json.loads(bytes(raw[8 : 8 + size]))
            except ValueError as err:
                raise ValueError(f"{file}: corrupt safetensors header ({err})") from None
            header.pop("__metadata__", None)
            self._open[file] = (raw, 8 + size, header)
            self.opened.append(file)
        return self._open[file][2]

    def names(self):
        """The tensor names, sorted."""
        return sorted(self.files)

    def info(self, name):
        """`(shape, numpy dtype)` of tensor `name` (ValueError when the checkpoint lacks it)."""
        if name not in self.files:
            raise ValueError(f"tensor {name!r} is not in the checkpoint {self.path}")
        entry = self._header(self.files[name])[name]
        return tuple(entry["shape"]), np.dtype(_DTYPES[entry["dtype"]])

    def read(self, name, index=()):
        """`tensor[index]` (a tuple of slices) as a numpy array, reading only those bytes."""
        shape, dtype = self.info(name)
        raw, start, header = self._open[self.files[name]]
        begin, end = header[name]["data_offsets"]
        array = raw[start + begin : start + end].view(dtype).reshape(shape)
        block = np.array(array[tuple(index)])
        self.reads.append((name, index))
        self.bytes_read += block.nbytes
        if self.on_read is not None:
            self.on_read(name, tuple(index), block.nbytes)
        return block


def write_safetensors(path, tensors: dict, metadata: dict | None = None):
    """Writes numpy `tensors` (name -> array) as one safetensors file.

    Example:
      >>> import numpy as np, tempfile
      >>> from shardfuse.models import safetensors as st
      >>> st.write_safetensors(tempfile.mktemp(), {"b": np.zeros(2, np.float32)})
    """
    header, offset = {}, 0
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        header[name] = dict(
            dtype=_NAMES[array.dtype],
            shape=list(array.shape),
            data_offsets=[offset, offset + array.nbytes],
        )
        offset += array.nbytes
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).tobytes())


__all__ = ["SafetensorsDir", "write_safetensors"]
