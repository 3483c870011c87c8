"""Shard file names from a checkpoint's index: plain relative names inside the folder, followed through symlinks to
regular files (RELIABILITY.md F14/F15)."""
from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import CheckpointFormatError


def short(value: Any, limit: int = 120) -> str:
    """repr() for messages, bounded: a hostile header may hold megabytes in one field."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...]"


def shard_path(root: Path, rel: Any, where: Path, tensor: str | None = None) -> tuple[Path, Path]:
    """`root / rel` and its real path. The name must be a plain relative path: not absolute, no `..`
    component, no NUL. Symlinks are followed wherever they point (a `--local-dir` download into the hub cache,
    shards spread over disks); the caller insists the target is a regular file."""
    try:
        ok = isinstance(rel, str) and rel != "" and "\x00" not in rel and bool(os.fsencode(rel))
    except UnicodeError:  # e.g. a lone surrogate from a JSON \ud800 escape: no file can have that name
        ok = False
    if not ok:
        raise CheckpointFormatError(where, f"shard path {short(rel)} is not a valid relative file name", tensor=tensor)
    if os.path.isabs(rel):
        raise CheckpointFormatError(where, f"shard path {rel!r} escapes model directory (absolute path)", tensor=tensor)
    if ".." in PurePosixPath(rel).parts:
        raise CheckpointFormatError(where, f"shard path {rel!r} escapes model directory ('..' component)",
                                    tensor=tensor, hint="index names are file names inside the model folder")
    candidate = root / rel
    try:
        real = candidate.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: symlink loop (Python < 3.13)
        raise CheckpointFormatError(where, f"cannot resolve shard path {rel!r}: {e}", tensor=tensor) from None
    return candidate, real


def file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "a special file"


def index_shard(root: Path, rel: Any, index_path: Path, tensor: str, by_real: dict[Path, Path],
                missing_ok: bool = False) -> Path | None:
    """The shard file an index entry names: a plain relative name, present, and (through any symlinks) a
    regular file. missing_ok: a shard not in the folder is None (a pipeline rank's local copy of the shards its
    layers need: checkpoint/stage.py), still refused if it is present but not a regular file."""
    shard, real = shard_path(root, rel, index_path, tensor=tensor)
    shard = by_real.setdefault(real, shard)
    try:
        mode = shard.stat().st_mode  # follows symlinks
    except FileNotFoundError:
        if missing_ok and not shard.is_symlink():
            return None
        raise CheckpointFormatError(index_path, f"index names missing shard '{rel}'"
                                                + (f" (a symlink to {real}, which does not exist)"
                                                   if shard.is_symlink() else ""),
                                    tensor=tensor, hint="re-download the checkpoint") from None
    except OSError as e:
        raise CheckpointFormatError(index_path, f"cannot stat shard '{rel}': {e.strerror}", tensor=tensor) from None
    if not stat.S_ISREG(mode):
        via = f" (a symlink to {real})" if shard.is_symlink() else ""
        raise CheckpointFormatError(index_path, f"index names shard '{rel}'{via}, which is {file_kind(mode)}, "
                                                f"not a regular file", tensor=tensor)
    return shard
