"""Writing a checkpoint file into the run directory itself, a storage failure kept for every rank to report.

Lightning's own checkpoint IO serialises into memory and stages the file in ``$TMPDIR``: a kill
there leaves a full-size copy behind, and the checkpoint needs space in two places. Here the
checkpoint goes straight to the path it is given (`save_atomically`'s ``.tmp`` beside the final
name). A failure does not raise inside Lightning's save, where the other ranks are about to wait
at a barrier: it is kept for `take_failure`, which `save_atomically` reports on every rank.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from rlcli.storage import StorageError, storage_error


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors in a (nested) checkpoint: the size of the file, give or take its metadata."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class _WholeWrites:
    """A file for `torch.save` that keeps the first `OSError` of its writes in ``error``: torch's writer
    swallows what its file raises (and later fails on a wrong position), and a buffered file may write
    part of a block at a size limit and return as if all went well."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.error: OSError | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            while view and self.error is None:
                view = view[os.write(self.fd, view):]
        except OSError as err:
            self.error = err
        if self.error is not None:
            raise self.error
        return len(data)

    def flush(self) -> None:
        pass

    def __enter__(self) -> _WholeWrites:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


class RunDirCheckpointIO(TorchCheckpointIO):
    def __init__(self) -> None:
        super().__init__()
        self._failure: StorageError | None = None

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = Path(path)
        needed = _tensor_bytes(checkpoint)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if needed > shutil.disk_usage(path.parent).free:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            with _WholeWrites(path) as handle:
                try:
                    torch.save(checkpoint, handle)
                except RuntimeError:
                    if handle.error is None:
                        raise
                if handle.error is not None:
                    raise handle.error
        except OSError as err:
            path.unlink(missing_ok=True)
            self._failure = storage_error(path, err, needed)

    def take_failure(self) -> StorageError | None:
        """The failure of the last save on this process, if any (and forget it)."""
        failure, self._failure = self._failure, None
        return failure
