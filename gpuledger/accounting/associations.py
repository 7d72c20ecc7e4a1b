"""Slurm association trees: the accounts and users that fairshare is computed over.

An association is an account (``user is None``) or a user inside an account. The tree is rooted at the
account ``root``. Shares are a non-negative integer or ``"parent"`` (Slurm's ``FairShare=parent``).

Three pure constructors, each reporting bad input with its location:

* :meth:`AssocTree.from_sacctmgr` reads ``sacctmgr -P show associations`` output, with or without the
  header line. Without a header the columns are ``Cluster|Account|User|ParentName|Share``. With a
  header, only Account, User and Share(s) are required: when ParentName is absent (the ``tree``
  format) the parents come from the one-space-per-level indentation of the Account column.
  ParentName is filled only on account rows; a user's parent is its Account.
* :meth:`AssocTree.from_csv` reads ``account,parent,user,shares``: an account row has an empty user and
  its parent (empty for a child of root); a user row has its account and an empty parent. ``root`` is
  implicit; a user directly under root has the account ``root``.
* :meth:`AssocTree.from_toml` reads the demo configuration (an already-parsed TOML table)::

      [accounts.proj_a]          # an account; parent defaults to "root", shares to 1
      shares = 60
      [accounts.proj_a.users]    # its users: name = shares (an integer or "parent")
      alice = 1
      bob = 3
      [accounts.proj_a_ml]
      parent = "proj_a"
      shares = 2
      [accounts.root.users]      # users directly under root; root itself takes no parent or shares
      root = 1
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

ROOT = "root"
PARENT = "parent"
# The columns a tree needs (the Slurm client asks for them; plain `sacctmgr -P show associations` lacks ParentName).
SACCTMGR_FORMAT = "cluster,account,parentname,user,share"
# Slurm stores FairShare=parent as SLURMDB_FS_USE_PARENT (0x7fffffff); real shares stay below it.
MAX_SHARES = 0x7FFFFFFF - 1

Shares = int | Literal["parent"]
AssocKey = tuple[str, str | None]
UserKey = tuple[str, str]  # a user association: (account, user)


class AssociationError(ValueError):
    """Bad association input; the message names where (line, row or TOML path) and what."""


@dataclass(frozen=True, slots=True)
class Assoc:
    """One association. ``parent`` is the parent account: the account itself for a user row,
    None only for the root account."""

    account: str
    user: str | None
    parent: str | None
    shares: Shares

    @property
    def key(self) -> AssocKey:
        return (self.account, self.user)

    @property
    def is_user(self) -> bool:
        return self.user is not None


def parse_shares(text: str, where: str) -> Shares:
    """``"parent"`` or an integer in 0..MAX_SHARES."""
    value = text.strip()
    if value.lower() == PARENT:
        return "parent"
    try:
        shares = int(value)
    except ValueError:
        raise AssociationError(
            f"{where}: shares {value!r} is neither an integer nor 'parent'"
        ) from None
    if not 0 <= shares <= MAX_SHARES:
        raise AssociationError(f"{where}: shares {shares} outside 0..{MAX_SHARES}")
    return shares


# \s in a str pattern is Py_UNICODE_ISSPACE, the test str.isspace() makes, character by character
_BAD_NAME_CHAR = re.compile(r"[\s|]")


def _check_name(name: str, what: str, where: str) -> str:
    if not name:
        raise AssociationError(f"{where}: empty {what} name")
    if _BAD_NAME_CHAR.search(name):
        raise AssociationError(f"{where}: {what} name {name!r} contains whitespace or '|'")
    return name


class AssocTree:
    """A validated association tree (immutable once built).

    ``assocs`` holds every association, the root account first; ``where`` (same length, optional)
    names each one's source location for error messages.
    """

    def __init__(self, assocs: Iterable[Assoc], where: Sequence[str] | None = None) -> None:
        items = list(assocs)
        locs = list(where) if where is not None else [f"association {i + 1}" for i in range(len(items))]
        if len(locs) != len(items):
            raise ValueError("where must have one entry per association")
        by_key: dict[AssocKey, Assoc] = {}
        loc_of: dict[AssocKey, str] = {}
        # The root account is implicit unless given; given, it must have no parent.
        if not any(a.account == ROOT and a.user is None for a in items):
            items.insert(0, Assoc(ROOT, None, None, 1))
            locs.insert(0, "implicit root")
        for a, loc in zip(items, locs):
            _check_name(a.account, "account", loc)
            if a.user is not None:
                _check_name(a.user, "user", loc)
                if a.parent != a.account:
                    raise AssociationError(
                        f"{loc}: user {a.user!r} has parent {a.parent!r}, expected its account {a.account!r}"
                    )
            elif a.account == ROOT:
                if a.parent is not None:
                    raise AssociationError(f"{loc}: the root account cannot have a parent ({a.parent!r})")
            elif a.parent is None:
                raise AssociationError(f"{loc}: account {a.account!r} has no parent")
            if not (a.shares == PARENT or (isinstance(a.shares, int) and 0 <= a.shares <= MAX_SHARES)):
                raise AssociationError(f"{loc}: bad shares {a.shares!r}")
            if a.key in by_key:
                what = f"user {a.user!r} in account {a.account!r}" if a.user else f"account {a.account!r}"
                raise AssociationError(f"{loc}: duplicate association {what} (first at {loc_of[a.key]})")
            by_key[a.key] = a
            loc_of[a.key] = loc
        for a in items:
            if a.parent is not None and (a.parent, None) not in by_key:
                what = "user" if a.user else "account"
                raise AssociationError(
                    f"{loc_of[a.key]}: {what} {a.user or a.account!r} has unknown parent account {a.parent!r}"
                )
        # Each account has one parent, so a cycle is a walk up that never reaches root.
        state: dict[str, int] = {ROOT: 2}
        for a in items:
            if a.user is not None:
                continue
            path: list[str] = []
            name: str | None = a.account
            while name is not None and state.get(name) != 2:
                if state.get(name) == 1:
                    cycle = " -> ".join(path[path.index(name):] + [name])
                    raise AssociationError(f"{loc_of[(name, None)]}: account parent cycle {cycle}")
                state[name] = 1
                path.append(name)
                name = by_key[(name, None)].parent
            for p in path:
                state[p] = 2
        root_first = [by_key[(ROOT, None)]] + [a for a in items if a.key != (ROOT, None)]
        self._assocs: tuple[Assoc, ...] = tuple(root_first)
        self._by_key = by_key
        self._index: Any = None  # built lazily by accounting.fairshare

    # -- access -----------------------------------------------------------------------------
    @property
    def assocs(self) -> tuple[Assoc, ...]:
        return self._assocs

    def __len__(self) -> int:
        return len(self._assocs)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def get(self, account: str, user: str | None = None) -> Assoc | None:
        return self._by_key.get((account, user))

    def user_keys(self) -> list[AssocKey]:
        return [a.key for a in self._assocs if a.user is not None]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AssocTree) and set(self._assocs) == set(other._assocs)

    def __repr__(self) -> str:
        return f"AssocTree({len(self._assocs)} associations)"

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def from_sacctmgr(cls, text: str, cluster: str | None = None) -> AssocTree:
        """Parse ``sacctmgr -P show associations`` (see the module docstring).

        With several clusters in the output, ``cluster`` selects one (required then).
        """
        lines = [(n, line.rstrip("\r\n")) for n, line in enumerate(text.splitlines(), 1)]
        lines = [(n, line) for n, line in lines if line.strip()]
        if not lines:
            raise AssociationError("sacctmgr output: no associations")
        first = [f.strip().lower() for f in lines[0][1].split("|")]
        if "account" in first and "user" in first:
            header = first
            lines = lines[1:]
        else:
            header = ["cluster", "account", "user", "parentname", "share"]
        if header and header[-1] == "" and len(header) > 1:
            header = header[:-1]  # `sacctmgr -p` ends every line with '|'
        col: dict[str, int] = {}
        for i, name in enumerate(header):
            name = {"par name": "parentname", "shares": "share", "fairshare": "share"}.get(name, name)
            col.setdefault(name, i)
        for need in ("account", "user", "share"):
            if need not in col:
                raise AssociationError(f"sacctmgr output line 1: header lacks the {need!r} column")
        if "partition" in col:
            part_col = col["partition"]
        else:
            part_col = None
        rows: list[tuple[int, list[str]]] = []
        for n, line in lines:
            fields = line.split("|")
            if len(fields) == len(header) + 1 and fields[-1] == "":
                fields = fields[:-1]
            if len(fields) != len(header):
                raise AssociationError(
                    f"sacctmgr output line {n}: {len(fields)} fields, expected {len(header)} ({line!r})"
                )
            rows.append((n, fields))
        if "parentname" not in col and not any(f[col["account"]].startswith(" ") for _, f in rows) \
                and any(f[col["account"]].strip() != ROOT for _, f in rows):
            # Plain `sacctmgr -P show associations`: neither ParentName nor the tree's indentation, so where the
            # accounts hang cannot be known.
            raise AssociationError(
                "sacctmgr output has no ParentName column (plain `sacctmgr -P show associations`); run "
                f"`sacctmgr -P show associations format={SACCTMGR_FORMAT}` or pass --associations slurm")
        if "cluster" in col:
            clusters = sorted({f[col["cluster"]].strip() for _, f in rows})
            if cluster is None and len(clusters) > 1:
                raise AssociationError(f"sacctmgr output holds clusters {clusters}; choose one with cluster=")
            if cluster is not None:
                rows = [(n, f) for n, f in rows if f[col["cluster"]].strip() == cluster]
                if not rows:
                    raise AssociationError(f"sacctmgr output: no associations for cluster {cluster!r}")
        assocs: list[Assoc] = []
        where: list[str] = []
        # For the `tree` format: the account at each indentation level seen last.
        level_account: list[str] = []
        for n, f in rows:
            loc = f"sacctmgr output line {n}"
            if part_col is not None and f[part_col].strip():
                raise AssociationError(f"{loc}: per-partition associations are not supported")
            raw_account = f[col["account"]]
            account = raw_account.strip()
            depth = len(raw_account) - len(raw_account.lstrip(" "))
            user = f[col["user"]].strip() or None
            shares = parse_shares(f[col["share"]], loc)
            if user is not None:
                parent: str | None = account
            elif "parentname" in col:
                parent = f[col["parentname"]].strip() or None
            else:
                # tree format: an account's parent is the account one indentation level up
                if depth > len(level_account):
                    raise AssociationError(f"{loc}: account {account!r} indented past its parent")
                del level_account[depth:]
                parent = level_account[-1] if level_account else None
                level_account.append(account)
            if user is None and account != ROOT and parent is None:
                raise AssociationError(f"{loc}: account {account!r} has an empty ParentName")
            assocs.append(Assoc(account, user, parent, shares))
            where.append(loc)
        return cls(assocs, where)

    @classmethod
    def from_csv(cls, text: str) -> AssocTree:
        """Parse the ``account,parent,user,shares`` CSV (see the module docstring)."""
        reader = csv.reader(io.StringIO(text))
        try:
            header = next(reader)
        except StopIteration:
            raise AssociationError("associations CSV: empty input") from None
        names = [h.strip().lower() for h in header]
        if sorted(names) != ["account", "parent", "shares", "user"]:
            raise AssociationError(
                f"associations CSV line 1: header must be account,parent,user,shares (got {header})"
            )
        col = {name: i for i, name in enumerate(names)}
        assocs: list[Assoc] = []
        where: list[str] = []
        for row in reader:
            line = reader.line_num
            loc = f"associations CSV line {line}"
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != 4:
                raise AssociationError(f"{loc}: {len(row)} fields, expected 4")
            account = row[col["account"]].strip()
            parent = row[col["parent"]].strip()
            user = row[col["user"]].strip()
            shares = parse_shares(row[col["shares"]], loc)
            if user:
                if parent:
                    raise AssociationError(f"{loc}: user row for {user!r} must have an empty parent")
                assocs.append(Assoc(account, user, account, shares))
            else:
                if account == ROOT:
                    raise AssociationError(f"{loc}: the root account is implicit; do not list it")
                assocs.append(Assoc(account, None, parent or ROOT, shares))
            where.append(loc)
        return cls(assocs, where)

    @classmethod
    def from_toml(cls, data: Mapping[str, Any]) -> AssocTree:
        """Build from a parsed TOML table holding ``accounts`` (see the module docstring)."""
        unknown = set(data) - {"accounts"}
        if unknown:
            raise AssociationError(f"associations TOML: unknown key(s) {sorted(unknown)}")
        accounts = data.get("accounts", {})
        if not isinstance(accounts, Mapping):
            raise AssociationError("associations TOML: 'accounts' must be a table")
        assocs: list[Assoc] = []
        where: list[str] = []

        def shares_of(value: Any, path: str) -> Shares:
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise AssociationError(f"{path}: shares must be an integer or \"parent\", got {value!r}")
            return parse_shares(str(value), path)

        for name, table in accounts.items():
            path = f"accounts.{name}"
            if not isinstance(table, Mapping):
                raise AssociationError(f"{path}: must be a table")
            extra = set(table) - {"parent", "shares", "users"}
            if extra:
                raise AssociationError(f"{path}: unknown key(s) {sorted(extra)}")
            if name == ROOT:
                if "parent" in table or "shares" in table:
                    raise AssociationError(f"{path}: the root account takes no parent or shares")
            else:
                parent = table.get("parent", ROOT)
                if not isinstance(parent, str):
                    raise AssociationError(f"{path}.parent: must be a string")
                assocs.append(Assoc(name, None, parent, shares_of(table.get("shares", 1), f"{path}.shares")))
                where.append(path)
            users = table.get("users", {})
            if not isinstance(users, Mapping):
                raise AssociationError(f"{path}.users: must be a table")
            for user, value in users.items():
                upath = f"{path}.users.{user}"
                assocs.append(Assoc(name, user, name, shares_of(value, upath)))
                where.append(upath)
        return cls(assocs, where)
