"""Check a whole trace file: is it complete, and is every byte of it what was written?

Three outcomes, because they call for different actions:

- ``ok``: marked complete, every record backed by its data, every checksum
  right — use it;
- ``incomplete``: the recording stopped early (interrupt, kill, disk full,
  input error) but everything it holds is intact — finish it with
  ``moetrace record ... --resume``;
- ``damaged``: something in it is not what the writer wrote (truncated file,
  altered bytes or records, counts that disagree) — re-record what is named.

The reader already checks each record (offsets, row-count rule, per-request
CRC); this module adds what only the file as a whole can tell: the root
counts, the running CRC over the request table, duplicate ids and the number
of requests the run expected.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import h5py

from moetrace.errors import MoetraceError
from moetrace.trace.integrity import metadata_problem, table_crc_problem
from moetrace.trace.lock import writer_pid
from moetrace.trace.reader import Trace, not_a_trace_file
from moetrace.trace.records import REQUESTS

# How a merge of some of a split's shards begins its end_reason (analysis/merge.py).
PARTIAL_MERGE = "partial merge"


def _served(attrs) -> bool:
    """Whether ``moetrace serve`` wrote the file (its engine settings say so)."""
    try:
        settings = json.loads(attrs.get("engine_settings", "{}") or "{}")
    except (TypeError, ValueError):
        return False
    return isinstance(settings, dict) and settings.get("served_by") == "moetrace serve"


@dataclass
class VerifyReport:
    path: Path
    problems: list[str] = field(default_factory=list)  # damage, one line each
    notes: list[str] = field(default_factory=list)  # facts about an incomplete file
    complete: bool = False
    num_requests: int = 0  # records backed by data
    num_rows: int = 0
    expected_requests: int | None = None  # None: unknown (standard input)
    end_reason: str = ""
    dropped: int = 0  # tail records not backed by data
    being_written: int | None = None  # pid of the run writing it (0: unknown), None: nobody
    served: bool = False  # written by `moetrace serve`, which has no --resume

    @property
    def status(self) -> str:
        if self.problems:
            return "damaged"
        return "ok" if self.complete else "incomplete"

    @property
    def exit_code(self) -> int:
        """0 ok, 1 damaged, 3 incomplete but intact (resumable)."""
        return {"ok": 0, "damaged": 1, "incomplete": 3}[self.status]

    def summary(self) -> str:
        of = f" of {self.expected_requests}" if self.expected_requests is not None else ""
        held = f"{self.num_requests}{of} requests, {self.num_rows:,} rows"
        if self.status == "ok":
            return f"{self.path}: ok, complete: {held}, every checksum matches"
        if self.being_written is not None:
            pid = f" (pid {self.being_written})" if self.being_written else ""
            return (
                f"{self.path}: incomplete, being written by a running moetrace{pid}: {held} "
                "flushed so far; check it again when the run is done"
            )
        if self.status == "incomplete":
            why = f" ({self.end_reason})" if self.end_reason else ""
            if (self.end_reason or "").startswith(PARTIAL_MERGE):
                return (
                    f"{self.path}: incomplete{why}: {held}, all intact; merge again with every "
                    "shard, or with --as-complete if this subset is what you want"
                )
            if self.served:
                return (
                    f"{self.path}: incomplete{why}: {held}, all intact; a served trace is "
                    "not resumed: read it as it is (serve again with another --trace-out)"
                )
            return (
                f"{self.path}: incomplete{why}: {held}, all intact; "
                "finish it with 'moetrace record ... --resume'"
            )
        n = len(self.problems)
        return f"{self.path}: damaged: {n} problem{'s' if n != 1 else ''}; {held} readable"

    @classmethod
    def from_fields(cls, fields: dict) -> VerifyReport:
        return cls(**{**fields, "path": Path(fields["path"])})

    def to_dict(self) -> dict:
        return {
            "path": str(self.path),
            "status": self.status,
            "complete": self.complete,
            "requests": self.num_requests,
            "expected_requests": self.expected_requests,
            "rows": self.num_rows,
            "dropped_records": self.dropped,
            "end_reason": self.end_reason,
            "problems": self.problems,
            "notes": self.notes,
            "being_written_by": self.being_written,
        }


def verify_trace(
    path: str | os.PathLike, progress: Callable[[], None] | None = None
) -> VerifyReport:
    """Check everything; ``MoetraceError`` only if the path is not a trace file at all.

    Runs HDF5 in this process: on a corrupted file HDF5 itself may hang or
    crash.  ``verify_guarded`` runs this in a child process and reports those.
    """
    path = Path(path)
    writer = writer_pid(path)
    report = _verify(path, progress)
    if writer is not None or (report.problems and (writer := writer_pid(path)) is not None):
        # HDF5 without SWMR reads a file that changes under it inconsistently: what looks
        # damaged now may be a write in progress, so it is not called damaged.
        report.being_written = writer
        report.notes += [f"read while being written: {p}" for p in report.problems]
        report.problems = []
    return report


def _verify(path: Path, progress: Callable[[], None] | None) -> VerifyReport:
    if not path.is_file():
        raise MoetraceError(not_a_trace_file(path))
    if not h5py.is_hdf5(path):
        raise MoetraceError(f"not an HDF5 file: {path}")
    report = VerifyReport(path)
    try:
        trace = Trace(path, verify=False)  # it looks at everything itself, and lists it all
    except MoetraceError as exc:
        if "not a moetrace trace" in str(exc) or "newer than" in str(exc):
            raise
        report.problems.append(f"cannot be read (truncated or corrupted): {_cause(exc)}")
        return report
    with trace:  # open while the file checks read it too (they count its stored rows)
        _fill(report, trace, progress)
        try:
            with h5py.File(path, "r", locking=False) as f:
                _file_checks(report, f, trace)
        except OSError as exc:
            report.problems.append(f"cannot be read (truncated or corrupted): {exc}")
    return report


def _cause(exc: Exception) -> str:
    return str(exc).split(": ", 1)[-1] if "cannot open trace file" in str(exc) else str(exc)


def _fill(report: VerifyReport, trace: Trace, progress: Callable[[], None] | None) -> None:
    md = trace.metadata
    report.complete = trace.complete
    report.num_requests = trace.num_requests
    report.num_rows = trace.num_rows
    report.dropped = trace.num_dropped
    report.end_reason = str(md.get("end_reason", ""))
    expected = int(md.get("expected_requests", -1))
    report.expected_requests = expected if expected >= 0 else None
    report.problems += trace.verify(report_dropped=False, progress=progress)
    if trace.num_dropped:
        report.notes.append(
            f"{trace.num_dropped} record(s) at the end point at data that never reached the "
            "file (killed during a write); they are left out and a resume redoes them"
        )
    if not trace.complete and report.expected_requests is not None:
        missing = report.expected_requests - trace.num_requests
        report.notes.append(f"{missing} request(s) not recorded yet")


def _file_checks(report: VerifyReport, f: h5py.File, trace: Trace) -> None:
    """The metadata and table CRCs, against the raw table (dropped records included).

    Layout attributes, root counts, duplicates and tokenizer files are the
    reader's own checks (``Trace.verify``, ``trace/file_checks.py``).
    """
    attrs = f.attrs
    table = f[REQUESTS]
    problem = metadata_problem(attrs)
    if problem:
        report.problems.append(problem)
    stated = int(attrs.get("num_requests", -1))
    if stated > table.shape[0]:
        report.problems.append(
            f"root attribute num_requests is {stated}, the request table holds {table.shape[0]} "
            "(table truncated)"
        )
        return
    if "requests_crc32" in attrs and stated >= 0:
        try:  # an incomplete file's tail may not read at all: the reader left it out
            records = table[:] if trace.complete else table[: trace.num_requests]
        except (OSError, ValueError) as exc:
            report.problems.append(f"request table unreadable: {' '.join(str(exc).split())}")
            return
        problem = ""
        if trace.complete or stated <= trace.num_requests:
            crc = int(attrs["requests_crc32"])
            problem = table_crc_problem(records, stated, crc, trace.complete)
        else:  # the stated records are not all backed by data: the flush was cut short
            report.notes.append("the last flush did not finish (its records are left out)")
        if problem:
            report.problems.append(problem)
    report.served = _served(attrs)
    skipped = json.loads(attrs.get("skipped_inputs", "[]") or "[]")
    if skipped:
        report.notes.append(f"{len(skipped)} input line(s) were skipped as invalid")
    orphans = trace.num_stored_rows - trace.num_rows
    if not trace.complete and orphans > 0:
        report.notes.append(f"{orphans} row(s) after the last record belong to no request")


# -- guarded run: HDF5 in a child process -------------------------------------------

STALL_S = 60.0  # no progress for this long: HDF5 is stuck on a corrupted structure


def verify_guarded(path: str | os.PathLike, stall_s: float = STALL_S) -> VerifyReport:
    """``verify_trace`` in a child process, so that a file that hangs or crashes HDF5
    (a flipped bit in a B-tree node can do either) is reported as damaged.

    The child sends a heartbeat as it checks requests; only ``stall_s`` seconds
    without one count as stuck, however large the trace.
    """
    path = Path(path)
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_verify_child, args=(str(path), send), daemon=True)
    child.start()
    send.close()
    try:
        while True:
            if not receive.poll(stall_s):
                return _stuck(path, f"HDF5 made no progress for {stall_s:.0f} s reading it")
            try:
                kind, value = receive.recv()
            except EOFError:
                child.join(5)
                return _stuck(path, f"HDF5 crashed reading it (exit code {child.exitcode})")
            if kind == "report":
                return VerifyReport.from_fields(value)
            if kind == "refused":
                raise MoetraceError(value)
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)
        receive.close()


def _stuck(path: Path, why: str) -> VerifyReport:
    writer = writer_pid(path)
    if writer is not None:  # a file changing under HDF5 can trip it up too
        return VerifyReport(path, notes=[f"read while being written: {why}"], being_written=writer)
    return VerifyReport(path, problems=[f"cannot be read (corrupted): {why}"])


def _verify_child(path: str, send) -> None:
    # Ctrl-C reaches the whole process group: the parent alone answers it.  A parent that
    # leaves with os._exit (a signal) runs no clean-up, so the child watches for that itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch_parent, name="moetrace-verify-parent", daemon=True).start()
    last = [0.0]

    def beat() -> None:
        now = time.monotonic()
        if now - last[0] > 1.0:
            last[0] = now
            send.send(("beat", None))

    try:
        beat()
        report = verify_trace(path, progress=beat)
        send.send(("report", asdict(report) | {"path": str(report.path)}))
    except MoetraceError as exc:
        send.send(("refused", str(exc)))
    except Exception as exc:  # a corrupted file can make h5py raise almost anything
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        send.send(("report", asdict(_stuck(Path(path), message)) | {"path": path}))
    finally:
        send.close()
