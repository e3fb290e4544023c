"""Archives and downloads: safe tar extraction, extract-once caching, md5-checked downloads."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tarfile
import urllib.request
from pathlib import Path
from typing import IO

from tqdm import tqdm

from lgvit.core.atomic import atomic_write, writing_to
from lgvit.core.errors import LgvitError

__all__ = [
    "ARCHIVE_SUFFIXES",
    "archive_stem",
    "default_cache_dir",
    "download_checked",
    "extract_cached",
    "file_md5",
    "is_archive",
    "safe_extract",
]

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$LGVIT_CACHE`` if set, else ``~/.cache/lgvit``."""
    return Path(os.environ.get("LGVIT_CACHE") or Path.home() / ".cache" / "lgvit").expanduser()


ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _member_problem(member: tarfile.TarInfo, root: str, parents: dict[str, str]) -> str | None:
    """Why ``member`` must not be extracted under ``root`` (a realpath), or None if it is safe.

    ``parents`` memoises parent-directory realpaths (60k members share a few dozen parents); the
    caller clears it whenever a symlink is extracted, as that can change what a path resolves to.
    """
    name = member.name
    if name.startswith(("/", "\\")) or os.path.isabs(name) or re.match(r"^[A-Za-z]:", name):
        return "has an absolute path"
    if member.isdev():
        return "is a device file or FIFO"
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        return f"has an unsupported type {member.type!r}"
    # realpath of the parent follows links the archive created earlier in this extraction, so
    # a chain like "a -> ." then "a/../../x" is caught, not only a literal "../x".
    dirname = os.path.dirname(name)
    parent = parents.get(dirname)
    if parent is None:
        parent = parents[dirname] = os.path.realpath(os.path.join(root, dirname))
    target = os.path.join(parent, os.path.basename(name))
    if not _within(os.path.normpath(target), root):
        return "would be written outside the destination"
    if member.issym():
        link = os.path.realpath(os.path.join(parent, member.linkname))
        if not _within(link, root):
            return f"is a symlink to {member.linkname!r}, outside the destination"
    if member.islnk():
        if os.path.isabs(member.linkname):
            return f"is a hard link to the absolute path {member.linkname!r}"
        link = os.path.realpath(os.path.join(root, member.linkname))
        if not _within(link, root):
            return f"is a hard link to {member.linkname!r}, outside the destination"
    return None


def safe_extract(tar_path: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Extract ``tar_path`` into ``dest``, refusing any member that could escape ``dest``.

    Refused (LgvitError naming the member): absolute paths, ``..`` that leaves ``dest``, symlinks
    or hard links pointing outside ``dest``, device files and FIFOs. Python's ``filter='data'``
    is applied on top where this Python has it (3.10.12+/3.11.4+), but is not relied on.
    """
    dest_path = Path(dest)
    dest_path.mkdir(parents=True, exist_ok=True)
    root = os.path.realpath(dest_path)
    has_filter = hasattr(tarfile, "data_filter")
    try:
        with tarfile.open(tar_path, "r:*") as tf:
            # Check and extract member by member (one sequential pass) so each check sees the
            # links extracted before it.
            parents: dict[str, str] = {}
            for member in tf:
                problem = _member_problem(member, root, parents)
                if problem is not None:
                    raise LgvitError(
                        f"refusing to extract {tar_path}: member {member.name!r} {problem}"
                    )
                if has_filter:
                    tf.extract(member, root, filter="data")
                else:  # no filter: at least do not restore owners or odd permission bits
                    tf.extract(member, root, set_attrs=False)
                if member.issym():
                    parents.clear()
    except tarfile.TarError as e:  # includes tarfile.FilterError from filter="data"
        raise LgvitError(f"cannot extract {tar_path}: {e}") from e
    except (OSError, EOFError) as e:
        raise LgvitError(f"cannot read archive {tar_path}: {e}") from e
    return dest_path


def is_archive(path: Path) -> bool:
    """Whether ``path``'s name ends in one of :data:`ARCHIVE_SUFFIXES`."""
    return path.name.lower().endswith(ARCHIVE_SUFFIXES)


def archive_stem(path: Path) -> str:
    """``path``'s name without its archive suffix."""
    lower = path.name.lower()
    for suffix in ARCHIVE_SUFFIXES:
        if lower.endswith(suffix):
            return path.name[: -len(suffix)]
    return path.name


def extract_cached(archive: Path, cache: Path) -> Path:
    """Safe-extract ``archive`` under ``cache/extracted`` once; later calls reuse the folder."""
    st = archive.stat()
    ident = f"{os.path.realpath(archive)}|{st.st_size}|{st.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    dest = cache / "extracted" / f"{archive_stem(archive)}-{key}"
    if dest.is_dir():
        return dest
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    logger.info("extracting %s to %s", archive, dest)
    try:
        safe_extract(archive, tmp)
        os.replace(tmp, dest)  # atomic: a half-extracted tree never carries the final name
    except OSError:
        if not dest.is_dir():  # another process finishing first is fine; anything else is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def file_md5(path: Path) -> str:
    """The md5 hex digest of the file at ``path``, read in 1 MiB chunks."""
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch(url: str, out: IO[bytes], desc: str) -> str:
    """Stream ``url`` into ``out`` with a progress bar; returns the md5 of what was read."""
    h = hashlib.md5(usedforsecurity=False)
    with urllib.request.urlopen(url, timeout=60) as resp:
        total = resp.headers.get("Content-Length")
        with tqdm(
            total=int(total) if total else None, unit="B", unit_scale=True, desc=desc, disable=None
        ) as bar:
            for chunk in iter(lambda: resp.read(1 << 20), b""):
                out.write(chunk)
                h.update(chunk)
                bar.update(len(chunk))
    return h.hexdigest()


def download_checked(url: str, dest: Path, md5: str) -> Path:
    """Download ``url`` to ``dest``; the file only appears under its name once its md5 matches."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    logger.info("downloading %s to %s", url, dest)

    def fetch_checked(out: IO[bytes]) -> None:
        got = _fetch(url, out, dest.name)
        if got != md5:  # raised inside the atomic write, so the bad file is removed
            raise LgvitError(
                f"md5 mismatch for downloaded {dest}: expected {md5}, got {got} "
                "(the bad download was deleted)"
            )

    try:
        atomic_write(dest, writing_to(fetch_checked))
    except (OSError, ValueError) as e:  # URLError, HTTPError and timeouts are all OSErrors
        reason = getattr(e, "reason", e)
        raise LgvitError(
            f"could not download {url} ({reason}); download {dest.name} yourself "
            "and pass --data-dir pointing at it"
        ) from e
    return dest
