"""vllm_fafo.kernel_cache: numba's caches dropped where any kernel file changed."""

from __future__ import annotations

from pathlib import Path

from vllm_fafo.kernel_cache import STAMP_NAME, drop_stale_caches, kernel_sources


def _package(root: Path) -> Path:
    package = root / "pkg"
    (package / "sub" / "__pycache__").mkdir(parents=True)
    (package / "__pycache__").mkdir()
    (package / "calls.py").write_text("from numba import njit\n\n@njit(cache=True)\ndef outer(x):\n    return inner(x)\n")
    (package / "sub" / "inner.py").write_text("from numba import njit\n\n@njit(cache=True)\ndef inner(x):\n    return x\n")
    (package / "plain.py").write_text("X = 1\n")
    return package


def _caches(package: Path) -> list[Path]:
    for name in ("__pycache__/calls.outer-3.py311.nbi", "__pycache__/calls.outer-3.py311.1.nbc",
                 "sub/__pycache__/inner.inner-3.py311.nbi"):
        (package / name).write_bytes(b"cache")
    return sorted(package.rglob("*.nb?"))


def test_caches_are_dropped_when_any_kernel_file_changes_and_kept_otherwise(tmp_path):
    package = _package(tmp_path)
    assert [path.name for path in kernel_sources(package)] == ["calls.py", "inner.py"]
    caches = _caches(package)
    assert drop_stale_caches(package)  # no stamp yet: caches of unknown sources go
    assert not any(path.exists() for path in caches)
    assert (package / "__pycache__" / STAMP_NAME).exists()

    caches = _caches(package)
    assert not drop_stale_caches(package)  # nothing changed: numba's caches stay
    (package / "plain.py").write_text("X = 2\n")
    assert not drop_stale_caches(package)  # not a kernel file
    assert all(path.exists() for path in caches)

    # the callee changed, in another file than the caller: numba alone would load the
    # caller's old machine code; both callers' and callees' caches go
    (package / "sub" / "inner.py").write_text("from numba import njit\n\n@njit(cache=True)\ndef inner(x):\n    return x + 1\n")
    assert drop_stale_caches(package)
    assert not any(path.exists() for path in caches)
    assert list((package / "__pycache__").iterdir()) == [package / "__pycache__" / STAMP_NAME]


def test_a_package_folder_that_cannot_be_written_is_left_as_it_is(tmp_path, monkeypatch):
    """A wheel installed read-only (numba then caches in its user-wide folder)."""
    package = _package(tmp_path)
    caches = _caches(package)

    def refused(path, *args, **kwargs):
        raise PermissionError(f"read-only: {path}")

    monkeypatch.setattr(Path, "unlink", refused)
    monkeypatch.setattr(Path, "write_text", refused)
    assert not drop_stale_caches(package)
    assert all(path.exists() for path in caches)
    assert not (package / "__pycache__" / STAMP_NAME).exists()
