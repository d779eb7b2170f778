"""Stale numba caches dropped before any kernel loads.

The kernels are compiled with ``cache=True``, and numba checks a cached kernel
against its own source file only: a change to a kernel it calls in another
file (the step kernel calls the pool kernels, the propose kernel calls all of
them) is not seen, and the old machine code is loaded (numba's documented
caching limit, "changes in symbols defined in other files"). A checkout that
edits one kernel file would then run, test and benchmark the old code. So one
stamp covers every kernel file's source: where it differs from the stamp the
caches were built under, the package's cached kernels are dropped and numba
compiles them afresh.

Only the caches next to the sources (``__pycache__``, numba's choice where the
package folder is writable: a checkout or an editable install) are handled.
Where the folder cannot be written (a wheel installed read-only) numba keeps its
caches in its user-wide folder, and an upgrade rewrites every file, which numba's
own per-file check sees.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
STAMP_NAME = "numba-kernels.stamp"
CACHE_SUFFIXES = (".nbi", ".nbc")


def _kernel_files(package_dir: Path) -> list[tuple[Path, bytes]]:
    """The package's Python files that define numba kernels and their sources, in a fixed order."""
    files = ((path, path.read_bytes()) for path in sorted(package_dir.rglob("*.py")))
    return [(path, source) for path, source in files if b"njit" in source]


def kernel_sources(package_dir: Path) -> list[Path]:
    """The package's Python files that define numba kernels, in a fixed order."""
    return [path for path, _ in _kernel_files(package_dir)]


def sources_stamp(package_dir: Path) -> str:
    """A digest of every kernel file's path and source (each file read once)."""
    digest = hashlib.sha256()
    for path, source in _kernel_files(package_dir):
        digest.update(path.relative_to(package_dir).as_posix().encode())
        digest.update(b"\0")
        digest.update(source)
        digest.update(b"\0")
    return digest.hexdigest()


def drop_stale_caches(package_dir: Path = PACKAGE_DIR) -> bool:
    """Drop the package's in-tree numba caches where the kernel sources changed since
    they were stamped; returns whether any were dropped. Does nothing where the
    package's ``__pycache__`` cannot be written (see the module's docstring)."""
    stamp_file = package_dir / "__pycache__" / STAMP_NAME
    stamp = sources_stamp(package_dir)
    try:
        if stamp_file.read_text() == stamp:
            return False
    except OSError:
        pass  # no stamp yet: caches of unknown sources
    try:
        stamp_file.parent.mkdir(exist_ok=True)
        dropped = False
        for cache_dir in package_dir.rglob("__pycache__"):
            for path in cache_dir.iterdir():
                if path.suffix in CACHE_SUFFIXES:
                    path.unlink(missing_ok=True)
                    dropped = True
        # written whole or not at all: engine processes import the package at once
        partial = stamp_file.with_name(f"{STAMP_NAME}.{os.getpid()}")
        partial.write_text(stamp)
        os.replace(partial, stamp_file)
    except OSError:
        return False  # a read-only install: numba's user-wide caches, rewritten on upgrade
    return dropped
