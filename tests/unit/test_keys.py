"""router.keys' pure parts: the keys file, the route table, the buckets and the gate."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from router.keys import keyfile
from router.keys.access import RULES, Access, access_for, classify
from router.keys.keyfile import Key, KeyFileError, Keyring, Role, add_key, hash_key, load_keyring, load_keys
from router.keys.limits import Gate, GateFull, KeyLimits, TokenBucket

H = hash_key("k")


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "keys.toml"
    p.write_text(text)
    return p


def test_a_key_file_entry_becomes_a_frozen_key(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        f'[keys.alice]\nsha256 = "{H}"\nrole = "user"\nmodels = ["tiny*", "b"]\n'
        "rpm = 60\ntpm = 1000\nconcurrency = 4\nqueue = 8\n"
        f'[keys.root]\nsha256 = "{H.upper()}"\nrole = "admin"\n',
    )
    alice, root = load_keys(p)
    assert alice == Key("alice", Role.USER, hashlib.sha256(b"k").digest(), ("tiny*", "b"), 60, 1000, 4, 8)
    assert root.is_admin and root.models == () and root.rpm is None and root.queue == keyfile.DEFAULT_QUEUE
    assert alice.may_use(("tiny-chat",)) and alice.may_use(("x", "b")) and not alice.may_use(("c",))
    assert root.may_use(("anything",))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[keys.a]\nkey = "sk-plain"\n', "keys.a.key: the file holds no plain keys"),
        ('[keys.a]\nrole = "user"\n', "keys.a.sha256: required"),
        (f'[keys.a]\nsha256 = "{H}"\nrole = "root"\n', "keys.a.role: 'root' is not one of admin, user"),
        (f'[keys.a]\nsha256 = "{H}"\nrpm = 0\n', "keys.a.rpm: a whole number >= 1"),
        (f'[keys.a]\nsha256 = "{H}"\nrpm = "fast"\n', "keys.a.rpm"),
        (f'[keys.a]\nsha256 = "{H}"\nmodels = [1]\n', "keys.a.models"),
        (f'[keys.a]\nsha256 = "{H}"\nbudget = 3\n', "keys.a.budget: unknown field"),
        (f'[keys."a b"]\nsha256 = "{H}"\n', "a key name is letters"),
        ('[key.a]\nsha256 = "x"\n', "unknown top-level key 'key'"),
        ("[keys.a\n", "not valid TOML"),
    ],
)
def test_a_bad_keys_file_is_one_line_naming_the_key_path(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(KeyFileError, match=None) as e:
        load_keys(write(tmp_path, text))
    assert says in str(e.value) and str(tmp_path) in str(e.value)


def test_api_keys_are_admin_keys_and_names_cannot_clash(tmp_path: Path) -> None:
    ring = load_keyring(None, ["one", "two"])
    assert [(k.name, k.role) for k in ring.keys] == [("api-key", Role.ADMIN), ("api-key-2", Role.ADMIN)]
    assert (
        ring.identify(b"two") is ring.keys[1]
        and ring.identify(b"three") is None
        and ring.identify(b"") is None
    )
    assert not load_keyring(None, []).is_enabled
    assert load_keyring(write(tmp_path, ""), []).is_enabled  # an empty keys file: nobody gets in
    with pytest.raises(KeyFileError, match="'api-key' is used twice"):
        load_keyring(write(tmp_path, f'[keys.api-key]\nsha256 = "{H}"\n'), ["x"])


def test_keys_are_compared_in_constant_time_against_every_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    ring = Keyring(
        tuple(Key(f"k{i}", Role.USER, hashlib.sha256(f"s{i}".encode()).digest()) for i in range(3))
    )
    calls: list[tuple[bytes, bytes]] = []
    real = keyfile.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(keyfile.hmac, "compare_digest", counting)
    assert ring.identify(b"s0") is ring.keys[0]  # the first matches: the other two are compared still
    assert len(calls) == 3 and all(a == hashlib.sha256(b"s0").digest() for a, _ in calls)


def test_keys_add_writes_only_the_hash_and_refuses_a_second_name(tmp_path: Path) -> None:
    p = tmp_path / "keys.toml"
    plain = add_key(
        p, "alice", Role.USER, ["tiny", "qwen*"], {"rpm": 5, "tpm": None, "concurrency": 2, "queue": None}
    )
    second = add_key(p, "bob", Role.ADMIN, [], {})
    text = p.read_text()
    assert plain not in text and second not in text and hash_key(plain) in text and hash_key(second) in text
    alice, bob = load_keys(p)
    assert (alice.models, alice.rpm, alice.concurrency, alice.tpm) == (("tiny", "qwen*"), 5, 2, None)
    assert bob.is_admin and load_keyring(p, []).identify(plain.encode()) == alice
    with pytest.raises(KeyFileError, match="already there"):
        add_key(p, "alice", Role.USER, [], {})
    assert p.stat().st_mode & 0o077 == 0  # the hashes are nobody else's business either


@pytest.mark.parametrize(
    ("method", "path", "query", "access"),
    [
        ("GET", "/health", "", Access.PUBLIC),
        ("HEAD", "/static/vendor/highlight.min.js", "", Access.PUBLIC),
        ("POST", "/v1/chat/completions", "", Access.USER),
        ("POST", "/v1/messages", "", Access.USER),
        ("GET", "/v1/models/org/model-7b", "", Access.USER),
        ("GET", "/v1/responses/resp_1/input_items", "", Access.USER),
        ("GET", "/models", "", Access.USER),
        ("GET", "/models", "reload=1", Access.ADMIN),
        ("POST", "/models/unload", "", Access.ADMIN),
        ("POST", "/slots/0", "action=save&model=a", Access.ADMIN),
        ("DELETE", "/api/delete", "", Access.ADMIN),
        ("POST", "/api/pull", "", Access.ADMIN),
        ("POST", "/api/chat", "", Access.USER),
        ("GET", "/keys/usage", "", Access.ADMIN),
        ("GET", "/no/such/route", "", Access.ADMIN),  # unknown: fail closed
    ],
)
def test_access_for_a_concrete_request(method: str, path: str, query: str, access: Access) -> None:
    assert access_for(method, path, query) is access


def test_every_rule_is_found_by_its_own_template() -> None:
    for method, template, access in RULES:
        assert classify("GET" if method == "*" else method, template) is access


def test_a_token_bucket_bursts_a_minute_then_refills() -> None:
    b = TokenBucket(60)
    for _ in range(60):
        assert b.wait_s(100.0) == 0
        b.take(100.0, 1)
    assert b.wait_s(100.0) == pytest.approx(1.0)
    assert b.wait_s(100.5) == pytest.approx(0.5)
    assert b.wait_s(101.0) == 0


def test_limits_say_what_is_exhausted_and_for_how_long() -> None:
    lim = KeyLimits.of(Key("k", Role.USER, b"", rpm=120, tpm=600))
    assert lim.admit(0.0) is None
    lim.spend_tokens(0.0, 900)  # an answer larger than the whole minute: 300 below zero
    kind, wait = lim.admit(0.0) or ("", 0.0)
    assert kind == "tokens" and wait == pytest.approx(30.0, rel=1e-3)
    assert lim.admit(30.01) is None


def test_the_gate_admits_its_limit_queues_a_bounded_line_then_refuses() -> None:
    async def run() -> None:
        gate = Gate(limit=2, queue=1)
        await gate.acquire()
        await gate.acquire()
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        assert (gate.active, gate.num_waiting) == (2, 1)
        with pytest.raises(GateFull):
            await gate.acquire()
        gate.release()  # handed over to the waiter: still two at once
        await waiter
        assert (gate.active, gate.num_waiting) == (2, 0)
        cancelled = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert gate.num_waiting == 0
        gate.release()
        gate.release()
        assert gate.active == 0

    asyncio.run(run())
