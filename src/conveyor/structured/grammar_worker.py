"""The grammar worker: a process that checks output constraints, one forked child per check.

    server (GrammarChecker)  ──frames on stdin──►  worker (this module's main)
                                                      loads xgrammar and the vocabulary once
                                                      forks one child per check ──► child:
                                                        rlimits (memory, CPU seconds)
                                                        the grammar's shape, a frame
                                                        its compile, the result frame
    server  ◄──frames on a pipe── children (each writes once) and the worker (a child that died)

xgrammar cannot stop a compile, nor the search for a grammar's forced text, once started;
a child can be killed. Each check runs in a fresh child forked from this process, so it
starts in milliseconds with xgrammar and the vocabulary already loaded, under a memory limit
(RLIMIT_AS: what this process has mapped plus the budget) and a CPU-time limit, and the
server has the worker kill it when its time is up. The worker itself never runs xgrammar
work, so it stays single-threaded and fit to fork.

A frame is a 4-byte big-endian length and a JSON object. A child writes each of its frames
at once, at most PIPE_BUF bytes, so children sharing the pipe never interleave.

    to the worker    {"op": "init", "tokenizer_info" (xgrammar's TokenizerInfo as JSON),
                      "vocab_size", "stop_ids", "memory_mb", "cpu_s"},
                     then {"op": "check", "id", "kind", "spec", "disable_any_whitespace",
                      "where"} or {"op": "kill", "id"};
                     or {"op": "idle", "id"} (a check moved to the slow lane: SCHED_IDLE);
                     EOF: kill every child, exit
    from it          {"ready": true} | {"fatal": msg}; per check {"id", "work"} once the
                     grammar is built (its limits of structured/limits.py and its shape of
                     structured/grammar_bounds.py checked; work -1: the shape was not read),
                     then {"id", "ok": true} once it compiled for the model's vocabulary and
                     allows some output, or at any point
                     {"id", "error": msg, "reason": "invalid" | "memory" | "died"}
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import struct
import sys
from typing import Any

from conveyor.structured.grammar import GrammarUnsatisfiableError, build_checked, can_start
from conveyor.structured.grammar_bounds import CHEAP_COMPILE_COST
from conveyor.structured_params import _from_spec

PIPE_BUF = 4096
_HEADER = struct.Struct(">I")
_MAX_MESSAGE = 1500  # characters of an error message (a frame stays under PIPE_BUF)
# Before numpy or torch load: no BLAS or OpenMP thread pools in a process that forks.
SINGLE_THREADED_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def encode_frame(message: dict[str, Any]) -> bytes:
    data = json.dumps(message).encode()
    return _HEADER.pack(len(data)) + data


def decode_frames(buffer: bytearray, limit: int = -1) -> list[dict[str, Any]]:
    """The complete frames at the start of `buffer` (removed from it), `limit` at most."""
    out: list[dict[str, Any]] = []
    while len(buffer) >= _HEADER.size and len(out) != limit:
        (size,) = _HEADER.unpack_from(buffer)
        if len(buffer) < _HEADER.size + size:
            break
        out.append(json.loads(bytes(buffer[_HEADER.size : _HEADER.size + size])))
        del buffer[: _HEADER.size + size]
    return out


class _Worker:
    def __init__(self, init: dict[str, Any]) -> None:
        import xgrammar as xgr

        self.vocab_size = int(init["vocab_size"])
        info = xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"])
        # Made here, once, so a check starts at its own work (one thread: nothing to fork).
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.memory_bytes = int(init["memory_mb"]) << 20
        self.cpu_s = max(1, int(init["cpu_s"]))
        self.children: dict[int, int] = {}  # pid -> check id

    def serve(self, stdin: int, buffer: bytearray) -> None:
        """Fork a child per check, kill on request, until stdin closes. `buffer`: bytes read
        past the init frame."""
        for message in decode_frames(buffer):
            self.handle(message)
        while True:
            ready, _, _ = select.select([stdin], [], [], 0.2)
            self.reap()
            if not ready:
                continue
            chunk = os.read(stdin, 1 << 16)
            if not chunk:  # the server closed the pipe (or died): nothing is wanted any more
                self.kill_all()
                return
            buffer += chunk
            for message in decode_frames(buffer):
                self.handle(message)

    def handle(self, message: dict[str, Any]) -> None:
        if message["op"] == "check":
            self.fork(message)
        elif message["op"] == "kill":
            self.signal(int(message["id"]), signal.SIGKILL)
        elif message["op"] == "idle":
            self.signal(int(message["id"]), None)

    def fork(self, message: dict[str, Any]) -> None:
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 0
            try:
                _limit(self.memory_bytes, self.cpu_s)
                _write(_run_check(message, self.compiler, self.vocab_size))
            except BaseException:
                code = 1
            os._exit(code)
        self.children[pid] = int(message["id"])

    def signal(self, check_id: int, sig: int | None) -> None:
        """Send `sig` to the check's child; None: let it run only on otherwise idle CPU."""
        for pid, cid in self.children.items():
            if cid == check_id:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if sig is None:
                        _idle(pid)
                    else:
                        os.kill(pid, sig)

    def kill_all(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while self.children:
            pid, _ = os.waitpid(-1, 0)
            self.children.pop(pid, None)

    def reap(self) -> None:
        """Collect ended children; one that did not exit normally gets a frame of its own
        (the server keeps a check's first frame, so one sent after its result is ignored)."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            check_id = self.children.pop(pid, None)
            if check_id is None or (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
                continue
            how = (
                f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                else f"status {os.WEXITSTATUS(status)}"
            )  # fmt: skip
            _write({"id": check_id, "error": f"the check ended abnormally ({how})",
                    "reason": "died"})  # fmt: skip


def _limit(memory_bytes: int, cpu_s: int) -> None:
    """This child's limits: its address space may grow by `memory_bytes`, its CPU time is
    capped (SIGXCPU, then SIGKILL a second later) in case nobody kills it in time. And it
    dies with the worker (Linux)."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + memory_bytes, mapped + memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _run_check(message: dict[str, Any], compiler: Any, vocab_size: int) -> dict[str, Any]:
    """One check (see the module docstring): its shape frame written, its result returned."""
    import xgrammar as xgr

    check_id = int(message["id"])
    so = _from_spec(message["kind"], message["spec"], bool(message["disable_any_whitespace"]))
    where = message["where"]
    try:
        grammar, shape = build_checked(so, where)
        _write({"id": check_id, "work": -1 if shape is None else shape.work})
        if shape is None or shape.work * vocab_size > CHEAP_COMPILE_COST:
            _idle(0)  # a costly compile (the server's slow lane)
        compiled = compiler.compile_grammar(grammar)
        if not can_start(xgr.GrammarMatcher(compiled), vocab_size, shape is not None):
            raise GrammarUnsatisfiableError(
                f"{where} can never be satisfied: no output of this model's tokens matches it."
            )
        return {"id": check_id, "ok": True}
    except MemoryError:
        return _memory_error(check_id, where)
    except (ValueError, RuntimeError) as exc:
        if "bad_alloc" in str(exc):  # xgrammar's C++ out of memory (the RLIMIT_AS budget)
            return _memory_error(check_id, where)
        return {"id": check_id, "error": str(exc)[:_MAX_MESSAGE], "reason": "invalid"}


def _idle(pid: int) -> None:
    """SCHED_IDLE for `pid` (0: this process): a costly check runs only on CPU the engine
    leaves idle, so it holds up no step (docs/kernels.md#measured-choices)."""
    with contextlib.suppress(AttributeError, OSError):  # no SCHED_IDLE off Linux
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))


def _memory_error(check_id: int, where: str) -> dict[str, Any]:
    return {"id": check_id, "error": f"{where} needs more memory than this server allows a "
            "grammar (--grammar-memory-limit).", "reason": "memory"}  # fmt: skip


def _write(message: dict[str, Any]) -> None:
    frame = encode_frame(message)
    if len(frame) > PIPE_BUF:  # never: messages are cut to _MAX_MESSAGE characters
        frame = encode_frame({"id": message.get("id"), "error": "result too large",
                              "reason": "died"})  # fmt: skip
    os.write(_result_fd, frame)


_result_fd = -1  # the pipe every result frame goes to (its number is main's argument)


def main() -> int:
    global _result_fd
    _result_fd = int(sys.argv[1])
    stdin = sys.stdin.fileno()
    buffer = bytearray()
    while not (frames := decode_frames(buffer, limit=1)):
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            return 0
        buffer += chunk
    try:
        worker = _Worker(frames[0])
    except Exception as exc:  # a vocabulary it cannot load: every check fails with this
        _write({"fatal": f"the grammar worker could not start: {exc}"[:_MAX_MESSAGE]})
        return 1
    _write({"ready": True})
    worker.serve(stdin, buffer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
