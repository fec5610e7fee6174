"""A Hugging Face checkpoint directory on disk: ``config.json`` and safetensors, read lazily.

:class:`Checkpoint` opens ``model.safetensors`` or the shards listed by
``model.safetensors.index.json`` and knows every tensor's name, shape and dtype from the
file headers alone, so a loader can check a checkpoint against its config before reading
a single weight. Tensors are read one at a time as numpy arrays through ``safetensors``'
numpy API; numpy has no bfloat16 or float8, so tensors of those dtypes are read from their
raw bytes (the file layout: an 8-byte little-endian header length, a JSON header with each
tensor's dtype, shape and byte offsets, then the data) and viewed as ``ml_dtypes`` types,
which jax ships. Nothing here imports torch or touches the network.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Optional

import numpy as np

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
  """A checkpoint directory that cannot be loaded as asked (names what and why)."""


def _raw_dtypes() -> dict[str, Any]:
  import ml_dtypes

  return {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": getattr(ml_dtypes, "float8_e8m0fnu", None),
  }


# safetensors dtype names numpy reads itself.
NUMPY_DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U8": np.uint8,
  "U16": np.uint16,
  "U32": np.uint32,
  "U64": np.uint64,
  "BOOL": np.bool_,
}


def read_header(path: str) -> dict[str, Any]:
  """The JSON header of one safetensors file: ``{name: {"dtype", "shape", "data_offsets"}}``."""
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise CheckpointError(f"{path} is not a safetensors file (shorter than its header)")
    (size,) = struct.unpack("<Q", raw)
    if size > os.path.getsize(path):
      raise CheckpointError(
        f"{path} is not a safetensors file (header length {size} exceeds the file)"
      )
    try:
      header = json.loads(f.read(size))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise CheckpointError(f"{path} is not a safetensors file ({e})") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{path} is not a safetensors file (its header is not a JSON object)")
  header.pop("__metadata__", None)
  # The tensors' bytes must all be there: a file cut short (an interrupted download or copy)
  # otherwise fails later in safetensors with "incomplete metadata", naming no file.
  ends = [
    e["data_offsets"][1]
    for e in header.values()
    if isinstance(e, dict) and isinstance(e.get("data_offsets"), (list, tuple))
  ]
  have = os.path.getsize(path) - 8 - size
  if ends and max(ends) > have:
    raise CheckpointError(
      f"{path} is truncated: its header lists {max(ends)} bytes of tensors but the file holds "
      f"{max(have, 0)} (an interrupted download or copy?); fetch the file again"
    )
  return header


class Checkpoint:
  """A checkpoint directory: its config, and its tensors by name.

  Args:
    path: a directory holding ``config.json`` and ``model.safetensors`` or
      ``model.safetensors.index.json`` with its shards.

  Attributes:
    path: the directory.
    config: ``config.json`` as a dict.
    files: tensor name -> the safetensors file holding it.

  Raises:
    CheckpointError: the path is not such a directory, or a file is missing or
      unreadable (each named).
  """

  def __init__(self, path: str):
    path = os.fspath(path)
    if not os.path.isdir(path):
      what = "a file" if os.path.isfile(path) else "not found"
      raise CheckpointError(
        f"{path!r} is not a checkpoint directory ({what}); pass the folder "
        f"holding config.json and *.safetensors"
      )
    self.path = path
    config_path = os.path.join(path, CONFIG)
    if not os.path.isfile(config_path):
      raise CheckpointError(f"{path!r} is not a checkpoint directory: it has no {CONFIG}")
    try:
      with open(config_path) as f:
        self.config = json.load(f)
    except json.JSONDecodeError as e:
      raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(self.config, dict):
      raise CheckpointError(
        f"{config_path} must hold a JSON object, got {type(self.config).__name__}"
      )
    self.files = self._tensor_files()
    self._headers: dict[str, dict] = {}
    self._open: dict[str, Any] = {}

  def _tensor_files(self) -> dict[str, str]:
    index = os.path.join(self.path, INDEX)
    single = os.path.join(self.path, SINGLE)
    if os.path.isfile(index):
      with open(index) as f:
        weight_map = json.load(f).get("weight_map")
      if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no weight_map")
      files = {}
      for name, shard in weight_map.items():
        shard_path = os.path.join(self.path, shard)
        if not os.path.isfile(shard_path):
          raise CheckpointError(
            f"{index} lists shard {shard!r} (for tensor {name!r}), which is not in {self.path!r}"
          )
        files[name] = shard_path
      return files
    if os.path.isfile(single):
      return {name: single for name in read_header(single)}
    others = sorted(
      f for f in os.listdir(self.path) if f.endswith((".bin", ".pt", ".pth", ".safetensors"))
    )
    hint = (
      f" (it has {others}: only safetensors are read; save with safe_serialization)"
      if others
      else ""
    )
    raise CheckpointError(
      f"{self.path!r} is not a checkpoint directory: it has neither {SINGLE} nor {INDEX}{hint}"
    )

  def _header(self, file: str) -> dict:
    if file not in self._headers:
      self._headers[file] = read_header(file)
    return self._headers[file]

  def _entry(self, name: str) -> dict:
    file = self.files[name]
    header = self._header(file)
    if name not in header:
      raise CheckpointError(
        f"tensor {name!r} is listed for {os.path.basename(file)} but the file does not hold it"
      )
    return header[name]

  def names(self) -> list[str]:
    return sorted(self.files)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._entry(name)["shape"])

  def dtype(self, name: str) -> str:
    """The safetensors dtype name (``"F32"``, ``"BF16"``, ...)."""
    return self._entry(name)["dtype"]

  def read(self, name: str) -> np.ndarray:
    """The tensor ``name`` as a numpy array (bfloat16 / float8 as ``ml_dtypes`` arrays)."""
    if name not in self.files:
      raise CheckpointError(f"the checkpoint has no tensor {name!r}")
    file = self.files[name]
    entry = self._entry(name)
    dtype = entry["dtype"]
    if dtype in NUMPY_DTYPES:
      from safetensors import SafetensorError, safe_open

      try:
        with safe_open(file, framework="np") as f:
          return f.get_tensor(name)
      except SafetensorError as e:
        raise CheckpointError(f"{file}: tensor {name!r} cannot be read: {e}") from None
    raw = _raw_dtypes().get(dtype)
    if raw is None:
      raise CheckpointError(f"tensor {name!r} has dtype {dtype}, which cannot be read")
    # The raw bytes: after the 8-byte header length and the header, at the tensor's offsets.
    start, end = entry["data_offsets"]
    with open(file, "rb") as f:
      (header_size,) = struct.unpack("<Q", f.read(8))
    data = np.fromfile(file, dtype=np.uint8, count=end - start, offset=8 + header_size + start)
    return data.view(raw).reshape(entry["shape"])

  def total_bytes(self) -> int:
    return sum(
      int(np.prod(self.shape(n), dtype=np.int64)) * _itemsize(self.dtype(n)) for n in self.files
    )


def _itemsize(dtype: str) -> int:
  if dtype in NUMPY_DTYPES:
    return np.dtype(NUMPY_DTYPES[dtype]).itemsize
  return 1 if dtype.startswith("F8") else 2


def torch_dtype_name(config: dict) -> Optional[str]:
  """The checkpoint's declared dtype (``"float32"``, ``"bfloat16"``, ...), or None."""
  value = config.get("dtype", config.get("torch_dtype"))
  if isinstance(value, str):
    return value.replace("torch.", "")
  return None
