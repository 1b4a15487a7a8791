"""Content hashes, atomic file writes and deterministic JSON.

Every artifact converge writes goes through :func:`atomic_write_bytes`
(temp file -> fsync -> re-read and hash -> rename), so a crash leaves either
the old file or the new one, never a torn one. Temp files are named
``.NAME.*`` + :data:`TEMP_SUFFIX` in the target's directory, so that a reader of
that directory can tell them apart and delete the ones a crash left behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

TEMP_SUFFIX = ".tmp"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> str:
    """Write ``data`` to ``path`` atomically; return its sha256.

    The bytes go to a temp file in the same directory, are flushed and fsynced,
    read back and hashed, and only then renamed over ``path``; a crash at any
    point leaves either the old file or the new one, never a torn one.
    """
    path = Path(path)
    expected = sha256_bytes(data)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; artifacts get the usual mode
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        found = sha256_file(temp_name)
        if found != expected:
            raise OSError(f"{path}: bytes read back do not match those written (disk or filesystem fault)")
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return expected


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable (directories cannot be opened for fsync on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def json_bytes(obj: Any) -> bytes:
    """Deterministic JSON (sorted keys, fixed indent, trailing newline)."""
    return (json.dumps(obj, sort_keys=True, indent=2) + "\n").encode()


def json_round_trip(obj: Any) -> Any:
    """Normalise through JSON so tuples and lists compare equal."""
    return json.loads(json.dumps(obj, sort_keys=True))
