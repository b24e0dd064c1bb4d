"""datacache.posix_acl: the access-ACL xattr it writes is the kernel's format, and the kernel enforces it.

Read back with ``getfacl`` (the reference reader of this format) and by real users opening the file.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from _users import User, run_as, users, world_dir

from datacache.posix_acl import ACL_XATTR, decode_access_acl, encode_access_acl, set_readers_acl

__all__ = ["users", "world_dir"]


def _acl_or_skip(path: Path) -> None:
    try:
        os.getxattr(path, ACL_XATTR)
    except OSError as error:
        if error.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            pytest.skip(f"{path.parent}: this filesystem refuses POSIX ACLs")
    # ENODATA (no ACL yet) is the usual answer where ACLs are supported


def test_encode_is_sorted_version_2_with_mask_and_no_group_bits() -> None:
    value = encode_access_acl(6, [1002, 1001], [55])
    assert value[:4] == b"\x02\x00\x00\x00" and (len(value) - 4) % 8 == 0
    assert decode_access_acl(value) == [
        (0x01, 6, 0xFFFFFFFF),
        (0x02, 4, 1001),
        (0x02, 4, 1002),
        (0x04, 0, 0xFFFFFFFF),
        (0x08, 4, 55),
        (0x10, 4, 0xFFFFFFFF),
        (0x20, 0, 0xFFFFFFFF),
    ]
    with pytest.raises(ValueError, match="version 2"):
        decode_access_acl(b"\x01\x00\x00\x00")


def test_getfacl_reads_back_what_was_written(tmp_path: Path) -> None:
    if shutil.which("getfacl") is None:
        pytest.skip("getfacl is not installed (apt-get install acl)")
    path = tmp_path / "shard.tar"
    path.write_bytes(b"x")
    _acl_or_skip(path)
    set_readers_acl(str(path), [4242], [4343])
    shown = subprocess.run(["getfacl", "-n", "-c", str(path)], capture_output=True, text=True, check=True).stdout
    lines = {line.split("\t")[0] for line in shown.splitlines() if line}
    assert lines == {"user::rw-", "user:4242:r--", "group::---", "group:4343:r--", "mask::r--", "other::---"}
    assert os.stat(path).st_mode & 0o777 == 0o640  # the group bits show the mask, as the kernel reports it


def _reads(user: User, path: Path) -> bool:
    return run_as(user, ["dd", f"if={path}", "of=/dev/null", "bs=1", "count=1"]).returncode == 0


def test_kernel_admits_exactly_the_acl_readers(users: dict[str, User], world_dir: Path) -> None:
    """A team member not named is refused though the file's group is the team's; a named uid reads."""
    alice, bob, mallory = users["alice"], users["bob"], users["mallory"]
    team = alice.groups[0]
    folder = world_dir / "ds"
    folder.mkdir()
    path = folder / "shard.tar"
    path.write_bytes(b"secret")
    _acl_or_skip(path)
    os.chown(folder, 0, team)
    os.chown(path, 0, team)
    set_readers_acl(str(folder), [mallory.uid, alice.uid], [], directory=True)
    set_readers_acl(str(path), [mallory.uid, alice.uid], [])
    assert _reads(alice, path) and _reads(mallory, path)
    assert not _reads(bob, path)  # in the file's group, not a reader
    set_readers_acl(str(folder), [], [team], directory=True)
    set_readers_acl(str(path), [], [team])
    assert _reads(bob, path) and not _reads(mallory, path)
