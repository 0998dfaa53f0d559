"""What a model file is, by content: a sha256 of its bytes, computed once per version of the file.

What this module owns: `content_digest(path)`, the key under which anything derived from a file
(converted weights, per-layer digests) is cached. A name, size and modification time do not
identify a file: fine-tunes of one base at one quantisation have the same size, and `cp -p`,
`rsync -t` and `tar x` keep modification times, so two different files can agree on all three
(and then one would be served the other's cached weights). The content does identify it.

Hashing reads the whole file (about 1 s per GB), so the digest is remembered under
`<cache dir>/file-hashes/`, keyed by the file's device, inode, size, modification time and
change time. The change time cannot be set by `cp -p`, `rsync` or `tar`: any write to the file,
even one that restores its size and modification time, gives it a new key and a new hash.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from polylane import catalog

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
MAX_REMEMBERED = 1024  # remembered digests kept, most recently used first


def hashes_dir() -> Path:
    return catalog.cache_dir() / "file-hashes"


def content_digest(path: Path) -> str:
    """The sha256 (hex) of the file's bytes; hashed on the first call for this version of the file."""
    stat = path.stat()
    version = f"{stat.st_dev}-{stat.st_ino}-{stat.st_size}-{stat.st_mtime_ns}-{stat.st_ctime_ns}"
    remembered = hashes_dir() / f"{version}.sha256"
    try:
        digest = remembered.read_text().strip()
        if len(digest) == 64:
            os.utime(remembered)  # recently used: the last to be pruned
            return digest
    except OSError:
        pass
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            hasher.update(chunk)
    digest = hasher.hexdigest()
    _remember(remembered, digest)
    return digest


def _remember(target: Path, digest: str) -> None:
    """A failure (read-only or full disk) only costs hashing again next time."""
    if write_atomically(target, digest, "the hash of a model file"):
        keep_most_recent(target.parent, "*.sha256", MAX_REMEMBERED)


def write_atomically(target: Path, text: str, what: str) -> bool:
    """Write `text` to `target` through a temporary file and a rename (readers never see a partial
    file); False, with a warning naming `what`, where the disk refuses (read-only, full)."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(text)
        os.replace(temporary, target)
    except OSError as error:
        log.warning("could not write %s at %s: %s", what, target, error)
        temporary.unlink(missing_ok=True)
        return False
    return True


def keep_most_recent(folder: Path, pattern: str, keep: int) -> None:
    """Delete all but the `keep` most recently used (modified or touched) files of `folder` that
    match `pattern` (the small caches of derived facts: remembered hashes, layer digests)."""
    try:
        entries = sorted(folder.glob(pattern), key=lambda path: path.stat().st_mtime_ns)
        for stale in entries[: max(0, len(entries) - keep)]:
            stale.unlink(missing_ok=True)
    except OSError:  # another process pruned meanwhile
        pass


__all__ = ["content_digest", "hashes_dir", "keep_most_recent"]
