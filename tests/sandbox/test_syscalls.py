"""`syscalls`' tree removal on the host: depth, locked directories, links it must not follow.

(The same code runs in the zygote after each job; test_hostile_slot.py checks it there.)
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import pytest

from jaxrl.sandbox import syscalls as kernel


def _nest(top: str, depth: int) -> None:
    """`depth` nested directories under `top`, built by fd (the path is longer than PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            with open(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as f:
                f.write("x")
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        os.chmod(fd, 0o500)
    finally:
        os.close(fd)


@pytest.fixture
def scratch(tmp_path):
    """A directory on tmpfs where there is one (the zygote's scratch space is tmpfs; on this
    machine's disk-backed /tmp 5,000 mkdirs alone take seconds)."""
    if not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    d = tempfile.mkdtemp(prefix="jaxrl-kernel-test-", dir="/dev/shm")
    try:
        yield pathlib.Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_deep_tree_is_removed_where_shutil_recurses_out(scratch):
    tmp_path = scratch
    top = tmp_path / "job"
    top.mkdir()
    _nest(str(top), 5000)
    with pytest.raises((RecursionError, OSError)):  # what the zygote used to die of
        shutil.rmtree(top)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        kernel.remove_entry(fd, "job")
    finally:
        os.close(fd)
    assert not top.exists()


def test_locked_dirs_and_links_are_not_followed(tmp_path):
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "keep.txt").write_text("keep")
    os.chmod(outside, 0o500)  # the removal must not touch it, not even its mode
    job = tmp_path / "job"
    (job / "a" / "b").mkdir(parents=True)
    (job / "a" / "b" / "f").write_text("x")
    os.symlink(outside, job / "link-dir")
    os.symlink(outside / "keep.txt", job / "a" / "link-file")
    os.mkfifo(job / "a" / "fifo")
    os.chmod(job / "a" / "b", 0)
    os.chmod(job / "a", 0o500)
    os.chmod(job, 0o500)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        kernel.remove_entry(fd, "job")
        kernel.remove_entry(fd, "missing")  # gone already: not an error
    finally:
        os.close(fd)
    assert not job.exists()
    assert (outside / "keep.txt").read_text() == "keep" and (outside / "sub").is_dir()
    assert os.stat(outside).st_mode & 0o777 == 0o500
    os.chmod(outside, 0o700)


def test_empty_dir_keeps_what_was_there_before(tmp_path):
    (tmp_path / "null").write_text("")  # e.g. tier A's /dev nodes at zygote start
    keep = frozenset(os.listdir(tmp_path))
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "x").write_text("x")
    for i in range(100):
        (tmp_path / f"f{i}").write_text("x")
    assert kernel.empty_dir(str(tmp_path), keep) == []
    assert os.listdir(tmp_path) == ["null"]
    assert kernel.empty_dir(str(tmp_path / "absent")) == []
