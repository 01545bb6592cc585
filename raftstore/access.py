"""Users and per-table grants: the cluster's access control, kept by the catalog group.

DolphinDB's model. A user is an admin or not. An admin may do everything: create and drop
tables, manage users and grants, remove offsets, move leadership. Anyone else holds rules:
TABLE_READ (subscribe, read, table info, own offsets) or TABLE_WRITE (publish), granted or
denied on one table or on "*" (every table). A denial beats any grant; `revoke` removes the
rule on exactly that (privilege, table).

The state changes only by applying the catalog group's committed PutUser, DeleteUser and
SetRule commands, in log order, on every replica alike: every node decides the same. Each
user records the LSN of the entry that set its password (`generation`); a login token names
it, so a password reset or a delete ends every token issued before.

Threads: `apply_*` run on the catalog group's apply thread; reads (`user`, `allows`) run on
request threads. Every change builds new dicts and swaps them in, so a reader always sees
one whole state, old or new, and never a dict that changes under its iteration.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

from hastream.errors import (
    InvalidArgument,
    RaftStoreError,
    TooManyAccessRules,
    UserExists,
    UserNotFound,
    shown,
)
from raftstore import limits, passwords
from raftstore.commands import DeleteUser, Privilege, PutUser, RuleEffect, SetRule, UserMode

ALL_TABLES: Final = "*"
ADMIN: Final = "ADMIN"  # what PermissionDenied names for an admin-only call
BOOTSTRAP_ADMIN: Final = "admin"

_USER_NAME: Final = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_TABLE_NAME: Final = re.compile(limits.TABLE_NAME_PATTERN)

Rules = dict[tuple[Privilege, str], RuleEffect]


@dataclass(frozen=True, slots=True)
class User:
    name: str
    password_hash: bytes = b""
    admin: bool = False
    generation: int = 0  # LSN of the entry that set the password


def check_user_name(name: str) -> str:
    """Raises InvalidArgument unless `name` is 1..USER_NAME_CHARS_MAX characters of
    [A-Za-z0-9_] starting with a letter."""
    if not _USER_NAME.fullmatch(name) or len(name) > limits.USER_NAME_CHARS_MAX:
        reason = (
            f"{shown(name)}: want 1..{limits.USER_NAME_CHARS_MAX} characters of [A-Za-z0-9_] "
            "starting with a letter"
        )
        raise InvalidArgument("userid", reason)
    return name


def check_rule_table(table: str) -> str:
    """Raises InvalidArgument unless `table` is a table name or "*"."""
    if table != ALL_TABLES and (
        not _TABLE_NAME.fullmatch(table) or len(table) > limits.TABLE_NAME_BYTES_MAX
    ):
        raise InvalidArgument("table", f"{shown(table)} is neither a table name nor '*'")
    return table


class AccessControl:
    """The users and their rules (see the module docstring)."""

    def __init__(self) -> None:
        self._users: dict[str, User] = {}
        self._rules: dict[str, Rules] = {}

    # -- reads (any thread) ------------------------------------------------------------

    def user(self, name: str) -> User | None:
        return self._users.get(name)

    def has_users(self) -> bool:
        return bool(self._users)

    def allows(self, name: str, privilege: Privilege, table: str) -> bool:
        """Whether user `name` may use `privilege` on `table` (an unknown user may not)."""
        user = self._users.get(name)
        if user is None:
            return False
        if user.admin:
            return True
        rules = self._rules.get(name, {})
        exact = rules.get((privilege, table))
        every = rules.get((privilege, ALL_TABLES))
        if RuleEffect.DENY in (exact, every):
            return False
        return RuleEffect.GRANT in (exact, every)

    def describe(self) -> list[dict[str, Any]]:
        """Every user with its rules, sorted (never the hashes): for admins and status."""
        users, rules = self._users, self._rules
        return [
            {
                "user": name,
                "admin": users[name].admin,
                "rules": [
                    {"privilege": privilege.name, "table": table, "effect": effect.name}
                    for (privilege, table), effect in sorted(rules.get(name, {}).items())
                ],
            }
            for name in sorted(users)
        ]

    # -- apply (the catalog group's apply thread) ---------------------------------------

    def apply_put_user(self, lsn: int, command: PutUser) -> RaftStoreError | None:
        try:
            check_user_name(command.user)
        except InvalidArgument as error:
            return error
        if not passwords.well_formed(command.password_hash):
            return InvalidArgument("password_hash", "not a hash this cluster writes")
        existing = self._users.get(command.user)
        match command.mode:
            case UserMode.BOOTSTRAP:
                if self._users:
                    return None  # another leader's bootstrap came first: nothing to do
                user = User(command.user, command.password_hash, True, lsn)
            case UserMode.CREATE:
                if existing is not None:
                    return UserExists(command.user)
                if len(self._users) >= limits.USERS_MAX:
                    return TooManyAccessRules("users", limits.USERS_MAX)
                user = User(command.user, command.password_hash, command.admin, lsn)
            case UserMode.RESET:
                if existing is None:
                    return UserNotFound(command.user)
                user = User(command.user, command.password_hash, existing.admin, lsn)
            case _:
                raise AssertionError(f"not a user mode: {command.mode!r}")
        self._users = {**self._users, command.user: user}
        return None

    def apply_delete_user(self, command: DeleteUser) -> RaftStoreError | None:
        user = self._users.get(command.user)
        if user is None:
            return UserNotFound(command.user)
        if user.admin and sum(1 for other in self._users.values() if other.admin) == 1:
            return InvalidArgument("userid", f"{command.user!r} is the last admin")
        self._users = {name: u for name, u in self._users.items() if name != command.user}
        self._rules = {name: r for name, r in self._rules.items() if name != command.user}
        return None

    def apply_set_rule(self, command: SetRule) -> RaftStoreError | None:
        if command.user not in self._users:
            return UserNotFound(command.user)
        try:
            check_rule_table(command.table)
        except InvalidArgument as error:
            return error
        rules = dict(self._rules.get(command.user, {}))
        key = (command.privilege, command.table)
        if command.effect == RuleEffect.REVOKE:
            rules.pop(key, None)
        else:
            if key not in rules and len(rules) >= limits.RULES_PER_USER_MAX:
                return TooManyAccessRules(f"rules of {command.user}", limits.RULES_PER_USER_MAX)
            rules[key] = command.effect
        self._rules = {**self._rules, command.user: rules}
        return None

    # -- checkpoint --------------------------------------------------------------------

    def to_json(self) -> list[dict[str, Any]]:
        """Deterministic: sorted users, each with its hash and sorted rules."""
        return [
            {
                "user": name,
                "hash": user.password_hash.decode("ascii"),
                "admin": user.admin,
                "generation": user.generation,
                "rules": [
                    [int(privilege), table, int(effect)]
                    for (privilege, table), effect in sorted(self._rules.get(name, {}).items())
                ],
            }
            for name, user in sorted(self._users.items())
        ]

    @classmethod
    def from_json(cls, entries: list[dict[str, Any]]) -> AccessControl:
        """Raises ValueError, TypeError or KeyError on anything malformed."""
        access = cls()
        users: dict[str, User] = {}
        rules: dict[str, Rules] = {}
        for entry in entries:
            name = check_user_name(str(entry["user"]))
            generation = entry["generation"]
            if type(generation) is not int or type(entry["admin"]) is not bool:
                raise TypeError(f"user {name}: generation or admin of the wrong type")
            password_hash = str(entry["hash"]).encode("ascii")
            users[name] = User(name, password_hash, entry["admin"], generation)
            rules[name] = {}
            for privilege, table, effect in entry["rules"]:
                if effect == RuleEffect.REVOKE:
                    raise ValueError(f"user {name}: a stored rule cannot be a revoke")
                key = (Privilege(privilege), check_rule_table(str(table)))
                rules[name][key] = RuleEffect(effect)
        access._users = users
        access._rules = {name: user_rules for name, user_rules in rules.items() if user_rules}
        return access
