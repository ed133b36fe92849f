"""The identity of what determines a model's K/V: every weight byte, the model config, and the
library versions and device that compute them. KV snapshots carry it; a mismatch means recompute.

Hashing every byte costs about 0.3 s per 100 MB on the 2-core CPU, so each file's digest is
cached by its identity (resolved path, size, mtime_ns, inode) in a small JSON file in the data
dir: a file rewritten in place gets a new mtime, a replaced one a new inode.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_FILE = "weights-hashes.json"
# The libraries whose kernels produce the K/V bytes: a new version may round differently.
NUMERIC_LIBRARIES = ("torch", "transformers", "bitsandbytes")
# config.json keys that record who saved the file, not how the model computes.
NON_NUMERIC_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path"})


def sha256_file(path: Path) -> str:
    """The SHA-256 of every byte of `path`."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _read_cache(cache: Path) -> dict[str, dict]:
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}  # absent or damaged: everything is hashed again, which is only slower
    return data if isinstance(data, dict) else {}


def _write_cache(cache: Path, entries: dict[str, dict]) -> None:
    # Written whole to a temp file and renamed, so a concurrent reader never sees half of it.
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".weights-hashes-")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, cache)
    except OSError as e:
        log.warning("cannot write the weights hash cache %s: %s", cache, e)


def file_hash(path: Path, cache: Path) -> str:
    """SHA-256 of `path`, from `cache` while the file's identity is unchanged."""
    key = str(path.resolve())
    entries = _read_cache(cache)
    entry = entries.get(key)
    identity = _identity(path)
    if entry and entry.get("identity") == identity and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    log.info("hashing %s (%.1f MB, once)", path, identity[0] / 2**20)
    digest = sha256_file(path)
    entries = _read_cache(cache)  # another process may have added entries meanwhile
    entries[key] = {"identity": identity, "sha256": digest}
    _write_cache(cache, entries)
    return digest


def weights_hash(paths: list[Path], cache: Path) -> str:
    """One digest over every byte of every weight file (names and sizes included)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(f"{p.name}:{p.stat().st_size}:{file_hash(p, cache)}\n".encode())
    return h.hexdigest()[:16]


def config_hash(config_json: Path) -> str:
    """A digest of the model config as canonical JSON (rope_theta, rope_scaling, head sizes...),
    ignoring the keys that only say which library version wrote it."""
    config = json.loads(config_json.read_text())
    kept = {k: v for k, v in config.items() if k not in NON_NUMERIC_CONFIG_KEYS}
    canonical = json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def numerics_versions() -> str:
    """`torch=2.13.0 transformers=5.24.0 bitsandbytes=0.50.2` (`none` for a missing one)."""

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "none"

    return " ".join(f"{name}={installed(name)}" for name in NUMERIC_LIBRARIES)
