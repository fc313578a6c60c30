"""Read DCP checkpoints without unpickling arbitrary objects.

DCP stores tensors with ``torch.save`` and reads them back with
``torch.load(weights_only=True)``, but its ``.metadata`` index is a plain pickle.
``SafeReader`` loads that index with an unpickler that only admits DCP's own
metadata classes, ``torch.Size``, dtypes and layouts, and refuses checkpoints that
hold pickled non-tensor objects (llmforge never writes any).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from llmforge.errors import fail
from llmforge.storage import filesystem, is_url, join

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only an allow-list of harmless globals."""

    def find_class(self, module: str, name: str) -> Any:
        """Resolve an allowed global; refuse everything else."""
        if module == _METADATA_MODULE and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _open_metadata(path: Any) -> tuple[Any, Any]:
    """(name, binary stream) of the ``.metadata`` of a folder or an object-storage prefix."""
    if is_url(path):
        meta_url = join(path, ".metadata")
        return meta_url, filesystem(meta_url).open(meta_url, "rb")
    meta_file = Path(path) / ".metadata"
    return meta_file, meta_file.open("rb")


def load_metadata(path: Any) -> Metadata:
    """DCP's index of a checkpoint folder (or object prefix), read safely; a UserError if it is not one."""
    meta_file: Any = path
    try:
        meta_file, stream = _open_metadata(path)
        with stream as fh:
            metadata = _RestrictedUnpickler(fh).load()
    except FileNotFoundError:
        raise fail(f"{meta_file}: missing; this is not a DCP checkpoint", title="damaged checkpoint") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
        raise fail(f"{meta_file}: unreadable or unsafe ({exc})", title="damaged checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise fail(f"{meta_file}: not a DCP metadata index", title="damaged checkpoint")
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            raise fail(f"{meta_file}: entry {key!r} is a pickled object; llmforge loads tensors only", title="unsafe checkpoint")
    return metadata


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata comes from the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's index via the restricted unpickler."""
        if kwargs.get("rank") is not None:
            raise fail(f"{self.path}: per-rank metadata files are not supported", title="damaged checkpoint")
        metadata = load_metadata(self.path if is_url(str(self.path)) else Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safe_reader(path: Any) -> FileSystemReader:
    """A DCP reader for a folder or an object-storage URL, with the safe metadata index."""
    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        class SafeFsspecReader(FsspecReader):
            read_metadata = SafeReader.read_metadata

        return SafeFsspecReader(path)
    return SafeReader(path)
