"""Model-based test of one group's shell, in one process: random sequences of create, drop,
re-create, publish (keyed and unkeyed, producer retries), offsets, checkpoint, restart (replay
from the journal and the data files), power loss (un-fsynced file data and directory entries
dropped, torn tails) and environment errors (ENOSPC, EIO, EMFILE on the data files or the
journal), against a plain in-memory model.

The disk is the simulated one (storage/files.py SimFiles); `ShellModelOnRealFiles` runs the
same rules but crash and faults on a real tmp dir.

Invariants: the group's tables, rows and offsets equal the model's after every step; a restart
or a power loss reaches the acknowledged state; an environment error stalls the group (in
doubt) and the write completes once it clears; no operation raises anything but the typed error
the model predicts. `--hypothesis-profile long` runs it for much longer (docs/durability.md).
"""

from __future__ import annotations

import errno
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hastream.errors import NodeUnavailable, TableExists, TableNotFound, TopicNotFound
from raftstore.storage.files import Fault, SimFiles
from tests.shell import Shell, raises

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
NAMES = ("alpha", "beta")
PRODUCERS = (b"\x01" * 16, b"\x02" * 16)


@dataclass
class TableModel:
    keyed: bool
    rows: list[tuple[int, int]] = field(default_factory=list)

    def keep(self, keys: list[int], values: list[int]) -> list[tuple[int, int]]:
        if not self.keyed:
            return list(zip(keys, values, strict=True))
        seen = {key for key, _ in self.rows}
        kept = []
        for key, value in zip(keys, values, strict=True):
            if key not in seen:
                seen.add(key)
                kept.append((key, value))
        return kept


class ShellModel(RuleBasedStateMachine):
    """On the simulated disk: with power loss and fault rules."""

    simulated = True

    def __init__(self) -> None:
        super().__init__()
        if self.simulated:
            self.files: SimFiles | None = SimFiles(seed=len(SEEDS))
            SEEDS.append(0)
            self.root = Path("/shell")
            self.shell = Shell(self.root, files=self.files).start()
        else:
            self.files = None
            self.root = Path(tempfile.mkdtemp(prefix="shell-model-"))
            self.shell = Shell(self.root).start()
        self.tables: dict[str, TableModel] = {}
        self.topics: dict[str, int] = {}
        self.sequences: dict[bytes, int] = {}
        self.value = 0

    def teardown(self) -> None:
        self.shell.stop()
        if self.files is None:
            shutil.rmtree(self.root, ignore_errors=True)

    @rule(name=st.sampled_from(NAMES), keyed=st.booleans())
    def create(self, name: str, keyed: bool) -> None:
        error = raises(self.shell.create, name, SCHEMA, "k" if keyed else None)
        if name in self.tables:
            assert isinstance(error, TableExists), error
        else:
            assert error is None, error
            self.tables[name] = TableModel(keyed)

    @rule(name=st.sampled_from(NAMES))
    def drop(self, name: str) -> None:
        error = raises(self.shell.g.drop_table, name, force=True)
        if name in self.tables:
            assert error is None, error
            del self.tables[name]
            self.topics = {t: o for t, o in self.topics.items() if not t.startswith(f"{name}/")}
        else:
            assert isinstance(error, TableNotFound), error

    @rule(
        name=st.sampled_from(NAMES),
        keys=st.lists(st.integers(0, 12), min_size=1, max_size=6),
        producer=st.sampled_from((None, *PRODUCERS)),
        retry=st.booleans(),
    )
    def publish(self, name: str, keys: list[int], producer: bytes | None, retry: bool) -> None:
        self._publish(name, keys, producer, retry)

    def _publish(self, name: str, keys: list[int], producer: bytes | None, retry: bool) -> None:
        values = list(range(self.value, self.value + len(keys)))
        self.value += len(keys)
        rows = pa.table({"k": keys, "v": values}, schema=SCHEMA)
        sequence = 0
        if producer is not None:
            last = self.sequences.get(producer, 0)
            sequence = last if retry and last else last + 1
        answer: tuple[int, int] | None = None

        def call() -> None:
            nonlocal answer
            answer = self.shell.publish(name, rows, producer or b"", sequence)

        error = raises(call)
        model = self.tables.get(name)
        if model is None:
            assert isinstance(error, TableNotFound), error
            return
        assert error is None, error
        assert answer is not None
        if producer is not None and sequence <= self.sequences.get(producer, 0):
            return  # a retry: answered from the producer window, nothing appended
        if producer is not None:
            self.sequences[producer] = sequence
        kept = model.keep(keys, values)
        assert answer[0] == len(kept), (answer, kept)
        model.rows.extend(kept)

    @rule(
        name=st.sampled_from(NAMES), action=st.sampled_from(("x", "y")), offset=st.integers(0, 50)
    )
    def commit_offset(self, name: str, action: str, offset: int) -> None:
        topic = f"{name}/{action}"
        error = raises(self.shell.g.commit_offset, topic, offset)
        if name in self.tables:
            assert error is None, error
            self.topics[topic] = offset
        else:
            assert isinstance(error, TableNotFound), error

    @rule(name=st.sampled_from(NAMES), action=st.sampled_from(("x", "y")))
    def remove_offset(self, name: str, action: str) -> None:
        topic = f"{name}/{action}"
        error = raises(self.shell.g.remove_offset, topic)
        if topic in self.topics:
            assert error is None, error
            del self.topics[topic]
        else:
            assert isinstance(error, TopicNotFound), error

    @rule()
    def checkpoint(self) -> None:
        self.shell.checkpoint()
        # A checkpoint collects the files of dropped incarnations: only live ones remain.
        group = self.shell.g
        live = {f"{name}.{group.table_view(name).meta.created_lsn}" for name in self.tables}
        data_dir = self.root / "persistence" / "local"
        names = (
            self.files.listdir(data_dir)
            if self.files is not None
            else [path.name for path in data_dir.iterdir()]
        )
        held = {name for name in names if not name.startswith(".")}
        assert held == live, (held, live)

    @rule()
    def restart(self) -> None:
        self.shell.restart()

    @precondition(lambda self: self.files is not None)
    @rule(torn=st.booleans())
    def power_loss(self, torn: bool) -> None:
        """Everything acknowledged was fsynced (journal) first: it all comes back."""
        self.shell.crash(torn=torn)

    @precondition(lambda self: self.files is not None)
    @rule(
        name=st.sampled_from(NAMES),
        keys=st.lists(st.integers(0, 12), min_size=1, max_size=6),
        error=st.sampled_from((errno.ENOSPC, errno.EIO, errno.EMFILE)),
        op=st.sampled_from(("writev", "open")),
    )
    def publish_through_a_data_file_error(
        self, name: str, keys: list[int], error: int, op: str
    ) -> None:
        """The data file refuses once: apply stalls (the group is in doubt), retries after
        a backoff and the publish is answered as if nothing happened."""
        assert self.files is not None
        self.files.fail(Fault(error, op=op, path_part=f"/{name}.", times=1))
        self._publish(name, keys, None, False)
        self.files.clear_faults()

    @precondition(lambda self: self.files is not None)
    @rule(
        name=st.sampled_from(NAMES),
        keys=st.lists(st.integers(0, 12), min_size=1, max_size=6),
        error=st.sampled_from((errno.ENOSPC, errno.EIO)),
    )
    def publish_refused_by_the_journal(self, name: str, keys: list[int], error: int) -> None:
        """The journal refuses the entry: nothing is committed, the publish fails with a
        typed retryable error and changes nothing."""
        assert self.files is not None
        self.files.fail(Fault(error, op="pwritev", path_part="raft.journal", times=1))
        rows = pa.table({"k": keys, "v": [0] * len(keys)}, schema=SCHEMA)
        failure = raises(self.shell.publish, name, rows)
        self.files.clear_faults()
        if name not in self.tables:
            assert isinstance(failure, TableNotFound), failure
        else:
            assert isinstance(failure, NodeUnavailable), failure

    @invariant()
    def state_equals_the_model(self) -> None:
        group = self.shell.g
        assert sorted(group.table_names()) == sorted(self.tables)
        for name, model in self.tables.items():
            rows = self.shell.rows(name)
            held = list(
                zip(rows.column("k").to_pylist(), rows.column("v").to_pylist(), strict=True)
            )
            assert held == model.rows, name
        assert group.topics() == self.topics
        assert not group.health().in_doubt, group.health()


class ShellModelOnRealFiles(ShellModel):
    """The same rules on a real tmp dir (power loss and faults need the simulated disk)."""

    simulated = False


SEEDS: list[int] = []
TestShellModel = pytest.mark.property(ShellModel.TestCase)
TestShellModelOnRealFiles = pytest.mark.property(ShellModelOnRealFiles.TestCase)
