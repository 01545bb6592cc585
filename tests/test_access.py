"""Users and grants as the catalog group's state machine applies them (raftstore/access.py),
the commands that carry them, password hashes and login tokens (raftstore/auth.py).

Pure and in one process; the same rules on real nodes are in test_auth_cluster.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hastream.errors import (
    ConfigError,
    InvalidArgument,
    NodeUnavailable,
    Overloaded,
    PermissionDenied,
    TooManyAccessRules,
    Unauthenticated,
    UserExists,
    UserNotFound,
)
from raftstore import commands, limits, passwords
from raftstore.access import ALL_TABLES, AccessControl
from raftstore.auth import (
    ADMIN_PASSWORD_ENV,
    Authenticator,
    Principal,
    Tokens,
    bootstrap_password,
)
from raftstore.commands import (
    DeleteUser,
    Privilege,
    PutUser,
    RuleEffect,
    SetRule,
    UserMode,
)
from raftstore.peer_auth import PeerSigner, PeerVerifier
from raftstore.state_machine import GroupStateMachine

READ, WRITE = Privilege.TABLE_READ, Privilege.TABLE_WRITE
# One real hash for the tests that do not log in (a hash costs ~50 ms).
HASH = passwords.hash_password("password-1")


def put(user: str, mode: UserMode = UserMode.CREATE, *, admin: bool = False) -> PutUser:
    return PutUser(user, HASH, admin, mode)


def rule_of(user: str, privilege: Privilege, table: str, effect: RuleEffect) -> SetRule:
    return SetRule(user, privilege, table, effect)


# -- commands ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        put("alice"),
        put("root", UserMode.BOOTSTRAP, admin=True),
        put("bob", UserMode.RESET),
        DeleteUser("alice"),
        rule_of("alice", WRITE, "trades", RuleEffect.GRANT),
        rule_of("alice", READ, ALL_TABLES, RuleEffect.DENY),
        rule_of("alice", READ, ALL_TABLES, RuleEffect.REVOKE),
    ],
)
def test_access_commands_encode_canonically(command: commands.Command) -> None:
    data = commands.encode(command)
    assert commands.decode(data) == command
    assert commands.encode(commands.decode(data)) == data


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (commands.encode(put("a"))[:-1] + b"\x07", "mode 7"),
        (commands.encode(rule_of("a", READ, "t", RuleEffect.GRANT))[:-1] + b"\x03", "effect 3"),
    ],
)
def test_unknown_enum_values_are_refused_by_decode(data: bytes, field: str) -> None:
    with pytest.raises(InvalidArgument, match=field):
        commands.decode(data)


# -- apply rules ------------------------------------------------------------------------


def test_create_reset_delete_and_their_refusals() -> None:
    access = AccessControl()
    assert access.apply_put_user(5, put("alice")) is None
    assert access.user("alice") is not None
    assert isinstance(access.apply_put_user(6, put("alice")), UserExists)
    assert isinstance(access.apply_put_user(7, put("bob", UserMode.RESET)), UserNotFound)
    assert access.apply_put_user(8, put("alice", UserMode.RESET)) is None
    user = access.user("alice")
    assert user is not None
    assert user.generation == 8
    assert isinstance(access.apply_delete_user(DeleteUser("bob")), UserNotFound)
    assert access.apply_delete_user(DeleteUser("alice")) is None
    assert access.user("alice") is None


def test_bootstrap_creates_the_first_admin_once() -> None:
    access = AccessControl()
    assert access.apply_put_user(1, put("admin", UserMode.BOOTSTRAP)) is None
    first = access.user("admin")
    assert first is not None
    assert first.admin
    other = PutUser("admin", passwords.hash_password("another-password"), True, UserMode.BOOTSTRAP)
    assert access.apply_put_user(2, other) is None  # a second leader's: nothing changes
    assert access.user("admin") == first


def test_the_last_admin_cannot_be_deleted() -> None:
    access = AccessControl()
    access.apply_put_user(1, put("admin", UserMode.BOOTSTRAP))
    assert isinstance(access.apply_delete_user(DeleteUser("admin")), InvalidArgument)
    access.apply_put_user(2, put("second", admin=True))
    assert access.apply_delete_user(DeleteUser("admin")) is None


def test_a_denial_beats_any_grant_and_revoke_removes_exactly_one_rule() -> None:
    access = AccessControl()
    access.apply_put_user(1, put("alice"))
    assert not access.allows("alice", WRITE, "t")
    access.apply_set_rule(rule_of("alice", WRITE, ALL_TABLES, RuleEffect.GRANT))
    assert access.allows("alice", WRITE, "t")
    assert not access.allows("alice", READ, "t")
    access.apply_set_rule(rule_of("alice", WRITE, "t", RuleEffect.DENY))
    assert not access.allows("alice", WRITE, "t")
    assert access.allows("alice", WRITE, "u")
    access.apply_set_rule(rule_of("alice", WRITE, "t", RuleEffect.REVOKE))
    assert access.allows("alice", WRITE, "t")
    assert not access.allows("nobody", WRITE, "t")


def test_rules_need_a_user_and_a_table_name() -> None:
    access = AccessControl()
    error = access.apply_set_rule(rule_of("ghost", READ, "t", RuleEffect.GRANT))
    assert isinstance(error, UserNotFound)
    access.apply_put_user(1, put("alice"))
    error = access.apply_set_rule(rule_of("alice", READ, "bad name", RuleEffect.GRANT))
    assert isinstance(error, InvalidArgument)
    assert isinstance(access.apply_put_user(2, put("9lives")), InvalidArgument)
    bad_hash = PutUser("carol", b"plaintext", False, UserMode.CREATE)
    assert isinstance(access.apply_put_user(3, bad_hash), InvalidArgument)


def test_users_and_rules_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "USERS_MAX", 2)
    monkeypatch.setattr(limits, "RULES_PER_USER_MAX", 1)
    access = AccessControl()
    access.apply_put_user(1, put("a"))
    access.apply_put_user(2, put("b"))
    assert isinstance(access.apply_put_user(3, put("c")), TooManyAccessRules)
    access.apply_set_rule(rule_of("a", READ, "t", RuleEffect.GRANT))
    error = access.apply_set_rule(rule_of("a", READ, "u", RuleEffect.GRANT))
    assert isinstance(error, TooManyAccessRules)
    # Changing an existing rule is not a new one.
    assert access.apply_set_rule(rule_of("a", READ, "t", RuleEffect.DENY)) is None


def test_the_catalog_state_machine_applies_and_checkpoints_access() -> None:
    machine = GroupStateMachine(2)
    machine.apply(1, put("admin", UserMode.BOOTSTRAP, admin=True))
    machine.apply(2, put("alice"))
    _, result = machine.apply(3, rule_of("alice", READ, "t", RuleEffect.GRANT))
    assert result.error is None
    _, result = machine.apply(4, put("alice"))
    assert isinstance(result.error, UserExists)  # an error is a recorded result, not a raise
    restored = GroupStateMachine.restore(2, machine.snapshot())
    assert restored.snapshot() == machine.snapshot()
    assert restored.access.allows("alice", READ, "t")
    assert restored.access.describe() == machine.access.describe()


# -- a model of the rules -----------------------------------------------------------------

NAMES = st.sampled_from(["admin", "alice", "bob", "carol"])
TABLES = st.sampled_from(["t", "u", ALL_TABLES])
PRIVILEGES = st.sampled_from(list(Privilege))


class AccessModel(RuleBasedStateMachine):
    """Random changes against a plain model: who may do what, and the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.access = AccessControl()
        self.lsn = 0
        self.users: dict[str, bool] = {}  # name -> admin
        self.rules: dict[tuple[str, Privilege, str], RuleEffect] = {}

    def _lsn(self) -> int:
        self.lsn += 1
        return self.lsn

    @rule(name=NAMES, admin=st.booleans())
    def create(self, name: str, admin: bool) -> None:
        error = self.access.apply_put_user(self._lsn(), put(name, admin=admin))
        assert (error is None) == (name not in self.users)
        self.users.setdefault(name, admin)

    @rule(name=NAMES)
    def reset(self, name: str) -> None:
        error = self.access.apply_put_user(self._lsn(), put(name, UserMode.RESET))
        assert (error is None) == (name in self.users)

    @rule(name=NAMES)
    def delete(self, name: str) -> None:
        error = self.access.apply_delete_user(DeleteUser(name))
        admins = sum(self.users.values())
        expected_ok = name in self.users and not (self.users[name] and admins == 1)
        assert (error is None) == expected_ok
        if expected_ok:
            del self.users[name]
            self.rules = {key: e for key, e in self.rules.items() if key[0] != name}

    @rule(name=NAMES, privilege=PRIVILEGES, table=TABLES, effect=st.sampled_from(list(RuleEffect)))
    def set_rule(self, name: str, privilege: Privilege, table: str, effect: RuleEffect) -> None:
        error = self.access.apply_set_rule(rule_of(name, privilege, table, effect))
        assert (error is None) == (name in self.users)
        if error is None:
            if effect == RuleEffect.REVOKE:
                self.rules.pop((name, privilege, table), None)
            else:
                self.rules[(name, privilege, table)] = effect

    @invariant()
    def decisions_match_the_model(self) -> None:
        for name in ["admin", "alice", "bob", "carol"]:
            for privilege in Privilege:
                for table in ["t", "u"]:
                    effects = {
                        self.rules.get((name, privilege, table)),
                        self.rules.get((name, privilege, ALL_TABLES)),
                    }
                    expected = name in self.users and (
                        self.users[name]
                        or (RuleEffect.DENY not in effects and RuleEffect.GRANT in effects)
                    )
                    assert self.access.allows(name, privilege, table) == expected

    @invariant()
    def the_checkpoint_reads_back_the_same(self) -> None:
        document = self.access.to_json()
        assert AccessControl.from_json(document).to_json() == document


TestAccessModel = AccessModel.TestCase


# -- passwords and tokens ---------------------------------------------------------------


def test_password_hashes_verify_and_never_hold_the_password() -> None:
    assert passwords.verify_password("password-1", HASH)
    assert not passwords.verify_password("password-2", HASH)
    assert b"password-1" not in HASH
    assert passwords.hash_password("password-1") != HASH  # salted
    for garbage in (b"", b"scrypt:1:2", b"scrypt:99999999:8:1:00:00", b"\xff"):
        assert not passwords.verify_password("password-1", garbage)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_tokens_expire_and_cannot_be_forged() -> None:
    clock = Clock()
    tokens = Tokens(b"k" * 32, clock)
    access = AccessControl()
    access.apply_put_user(7, put("alice"))
    user = access.user("alice")
    assert user is not None
    token, expires_ms = tokens.issue(user)
    assert tokens.check(token) == ("alice", 7)
    name, generation, expires, tag = token.split(":")
    for forged in (
        f"admin:{generation}:{expires}:{tag}",
        f"{name}:{generation}:{int(expires) + 1}:{tag}",
        "x" * (limits.TOKEN_CHARS_MAX + 1),
        "no-colons",
    ):
        with pytest.raises(Unauthenticated):
            tokens.check(forged)
    with pytest.raises(Unauthenticated, match="issued by this cluster"):
        Tokens(b"other key".ljust(32), clock).check(token)
    clock.now = expires_ms / 1000 + 1
    with pytest.raises(Unauthenticated, match="expired"):
        tokens.check(token)


def authenticator(access: AccessControl, *, enabled: bool = True) -> Authenticator:
    return Authenticator(
        enabled=enabled,
        tokens=Tokens(b"k" * 32),
        access=lambda: access,
        leader_access=lambda: access,
        peers=PeerVerifier(b"p" * 32),
    )


def test_login_tokens_and_grants_decide_each_call() -> None:
    access = AccessControl()
    access.apply_put_user(1, put("alice"))
    auth = authenticator(access)
    with pytest.raises(Unauthenticated, match="wrong user name or password") as wrong:
        auth.login("alice", "nope")
    with pytest.raises(Unauthenticated) as unknown:
        auth.login("mallory", "password-1")
    assert str(wrong.value) == str(unknown.value)  # nothing tells which users exist
    token, _, admin = auth.login("alice", "password-1")
    assert not admin
    metadata = [("hastream-token", token)]
    assert auth.principal("Publish", metadata) == Principal("alice", admin=False)
    with pytest.raises(PermissionDenied) as denied:
        auth.require("Publish", metadata, WRITE, "t")
    assert (denied.value.user, denied.value.action, denied.value.table) == (
        "alice",
        "TABLE_WRITE",
        "t",
    )
    access.apply_set_rule(rule_of("alice", WRITE, "t", RuleEffect.GRANT))
    auth.require("Publish", metadata, WRITE, "t")
    with pytest.raises(PermissionDenied, match="ADMIN"):
        auth.require_admin("HaStreamTable", metadata)
    with pytest.raises(Unauthenticated, match="needs a login"):
        auth.principal("Publish", [])
    access.apply_put_user(9, put("alice", UserMode.RESET))
    with pytest.raises(Unauthenticated, match="revoked"):
        auth.principal("Publish", metadata)


def test_peers_act_as_admins_and_authentication_off_lets_anyone() -> None:
    access = AccessControl()
    auth = authenticator(access)
    signed = PeerSigner(b"p" * 32, "node2").metadata("TransferLeadership")
    assert auth.principal("TransferLeadership", list(signed)) == Principal("node:node2", True)
    forged = PeerSigner(b"q" * 32, "node2").metadata("TransferLeadership")
    with pytest.raises(Unauthenticated):
        auth.principal("TransferLeadership", list(forged))
    assert authenticator(access, enabled=False).principal("Publish", []).admin


def test_logins_at_once_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    access = AccessControl()
    access.apply_put_user(1, put("alice"))
    auth = authenticator(access)
    held = [auth._logins.acquire(blocking=False) for _ in range(limits.LOGINS_CONCURRENT_MAX)]
    assert all(held)
    with pytest.raises(Overloaded):
        auth.login("alice", "password-1")
    for _ in held:
        auth._logins.release()
    auth.login("alice", "password-1")


def test_the_first_admin_password_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    path = tmp_path / "admin.password"
    path.write_text("from-the-file\n")
    assert bootstrap_password(path, {}) == "from-the-file"
    assert bootstrap_password(path, {ADMIN_PASSWORD_ENV: "from-the-env"}) == "from-the-env"
    assert bootstrap_password(None, {}) is None
    with pytest.raises(ConfigError, match="at least 8"):
        bootstrap_password(None, {ADMIN_PASSWORD_ENV: "short"})
    with pytest.raises(ConfigError, match="adminPasswordFile"):
        bootstrap_password(tmp_path / "missing", {})


def test_a_login_before_the_first_admin_exists_is_retryable() -> None:
    auth = authenticator(AccessControl())
    with pytest.raises(NodeUnavailable, match="no users yet") as raised:
        auth.login("admin", "password-1")
    assert raised.value.retryable
