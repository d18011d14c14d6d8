"""The keys file against another local user: planted links at any name it writes, and places others can write."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import orjson
import pytest

from gateway.config import AuthConfig
from gateway.keys import private_file
from gateway.keys.auth import Authenticator
from gateway.keys.keystore import KeyStore, StoreUnavailable
from gateway.keys.principal import hash_key
from gateway.keys.private_file import UnsafePlace, check_private_place, private_path
from gateway.keys.storage import FileKeys

CONFIG = AuthConfig(keys=[{"id": "ops", "sha256": hash_key("k-ops"), "admin": True}])
ATTACKER_KEY = "sk-attacker-chosen-admin-key"
ATTACKER_FILE = orjson.dumps({"keys": [{"id": "evil", "sha256": hash_key(ATTACKER_KEY), "admin": True,
                                        "created": 1.0}]})


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def place(tmp_path: Path) -> tuple[Path, Path]:
    """(a private directory for the keys file, the attacker's file elsewhere that planted links point to)."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    target = tmp_path / "attacker.json"
    target.write_bytes(ATTACKER_FILE)
    return private, target


async def store(path: Path) -> KeyStore:
    s = KeyStore(FileKeys(str(path)))
    await s.start()
    return s


def assert_untouched(link: Path, target: Path) -> None:
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == ATTACKER_FILE


async def test_a_link_planted_at_the_old_predictable_temp_name_changes_nothing(place):
    private, target = place
    keys = private / "keys.json"
    link = Path(f"{keys}.{os.getpid()}.tmp")  # the name every write used before
    link.symlink_to(target)
    s = await store(keys)
    await s.create("mine", admin=False, limits=None)
    await s.stop()
    assert_untouched(link, target)
    assert not keys.is_symlink() and [r["id"] for r in orjson.loads(keys.read_bytes())["keys"]] == ["mine"]


async def test_a_link_at_whatever_temp_name_is_drawn_is_never_followed(place, monkeypatch):
    private, target = place
    keys = private / "keys.json"
    drawn: list[str] = []
    real = private_file.temp_name

    def planted_first(path: str) -> str:
        # The attacker guessed the first name: a link is there before the gateway opens it.
        name = real(path)
        if not drawn:
            Path(name).symlink_to(target)
        drawn.append(name)
        return name

    monkeypatch.setattr(private_file, "temp_name", planted_first)
    s = await store(keys)
    await s.create("mine", admin=False, limits=None)
    s.used["mine"] = 1.0
    await s.publish_used()  # the `.used` file is written the same way
    await s.stop()
    assert len(drawn) == 3 and len(set(drawn)) == 3  # the planted name was skipped, a fresh one drawn
    assert_untouched(Path(drawn[0]), target)
    assert [r["id"] for r in orjson.loads(keys.read_bytes())["keys"]] == ["mine"]
    for name in (keys, Path(f"{keys}.lock"), Path(f"{keys}.used")):
        assert stat.S_ISREG(os.lstat(name).st_mode) and mode(name) == 0o600, name
    assert sorted(p.name for p in private.iterdir() if p.name.endswith(".tmp")) == [Path(drawn[0]).name]


async def test_when_every_temp_name_is_planted_the_change_is_refused_and_nothing_moves(place, monkeypatch):
    private, target = place
    keys = private / "keys.json"
    s = await store(keys)
    await s.create("before", admin=False, limits=None)
    before = keys.read_bytes()
    link = private / "planted.tmp"
    link.symlink_to(target)
    monkeypatch.setattr(private_file, "temp_name", lambda path: str(link))
    with pytest.raises(StoreUnavailable, match="temporary names"):
        await s.create("after", admin=True, limits=None)
    assert keys.read_bytes() == before and "after" not in s.records
    assert_untouched(link, target)
    await s.stop()


async def test_a_link_at_the_lock_is_refused_at_start_and_when_planted_later(place):
    private, target = place
    keys = private / "keys.json"
    lock = Path(f"{keys}.lock")
    lock.symlink_to(target)
    with pytest.raises(UnsafePlace, match="not a regular file"):
        FileKeys(str(keys))
    lock.unlink()
    s = await store(keys)
    lock.unlink(missing_ok=True)
    lock.symlink_to(target)  # planted while it runs
    with pytest.raises(StoreUnavailable, match="symbolic link"):
        await s.create("x", admin=True, limits=None)
    assert_untouched(lock, target)
    assert not keys.exists()
    await s.stop()


async def test_a_keys_file_swapped_for_a_link_is_never_read(place):
    private, target = place
    keys = private / "keys.json"
    s = await store(keys)
    await s.create("mine", admin=False, limits=None)
    auth = Authenticator(CONFIG, s)
    keys.unlink()
    keys.symlink_to(target)
    await s.refresh()  # refused and logged; the loaded keys stay
    assert "mine" in s.records and auth.principal_for_key(ATTACKER_KEY) is None
    with pytest.raises(StoreUnavailable, match="symbolic link"):
        await s.create("other", admin=False, limits=None)
    assert_untouched(keys, target)
    await s.stop()
    with pytest.raises(UnsafePlace, match="not a regular file"):
        FileKeys(str(keys))  # and at the next start, a clear refusal


@pytest.mark.parametrize("dir_mode", [0o777, 0o770, 0o1777, 0o1770, 0o722])
def test_a_directory_others_can_write_is_refused_with_a_clear_message(tmp_path, dir_mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, dir_mode)  # sticky or not: others could still create the file's name first
    with pytest.raises(UnsafePlace) as refused:
        FileKeys(str(shared / "keys.json"))
    message = str(refused.value)
    assert isinstance(refused.value, ValueError)  # a start-up configuration error (exit 2)
    assert f"directory {shared} can be written by other users" in message
    assert f"mode {dir_mode:04o}" in message and f"chmod go-w {shared}" in message
    assert not list(shared.iterdir())  # nothing was made there


def test_an_ancestor_others_can_write_is_refused_unless_sticky(tmp_path):
    outer, inner = tmp_path / "outer", tmp_path / "outer" / "inner"
    inner.mkdir(parents=True, mode=0o700)
    os.chmod(outer, 0o777)  # another user could rename `inner` away and put their own in its place
    with pytest.raises(UnsafePlace, match=f"directory {outer} can be written by other users"):
        FileKeys(str(inner / "keys.json"))
    os.chmod(outer, 0o1777)  # as /tmp: nobody else can rename or remove `inner`
    FileKeys(str(inner / "keys.json"))


def test_a_keys_file_or_lock_others_can_write_is_refused(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_bytes(b'{"keys": []}')
    os.chmod(keys, 0o666)
    with pytest.raises(UnsafePlace, match=f"chmod 600 {keys}"):
        FileKeys(str(keys))
    os.chmod(keys, 0o600)
    lock = tmp_path / "keys.json.lock"
    lock.touch(mode=0o622)
    os.chmod(lock, 0o622)
    with pytest.raises(UnsafePlace, match="can be written by other users"):
        FileKeys(str(keys))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UnsafePlace, match=r"belongs to another user \(uid 65534\)"):
        FileKeys(str(theirs / "keys.json"))


def test_a_missing_directory_is_a_clear_refusal(tmp_path):
    with pytest.raises(UnsafePlace, match="does not exist"):
        FileKeys(str(tmp_path / "nowhere" / "keys.json"))


def test_the_file_is_used_through_its_checked_directory_not_a_link_to_it(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "alias").symlink_to(real)
    path = private_path(str(tmp_path / "alias" / "keys.json"))
    assert path == str(real / "keys.json")
    check_private_place(path, "test")
    assert FileKeys(str(tmp_path / "alias" / "keys.json")).path == path


async def test_written_files_are_owner_only_whatever_the_umask(tmp_path):
    old = os.umask(0o000)
    try:
        s = await store(tmp_path / "keys.json")
        await s.create("k", admin=False, limits=None)
        s.used["k"] = 1.0
        await s.publish_used()
        await s.stop()
    finally:
        os.umask(old)
    for name in ("keys.json", "keys.json.lock", "keys.json.used"):
        assert mode(tmp_path / name) == 0o600, name
