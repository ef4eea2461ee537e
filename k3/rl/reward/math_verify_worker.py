"""math-verify in a child process with a hard deadline, callable from any thread.

math-verify bounds its own work with ``signal.alarm``, which only works on the main thread of the main
interpreter; from a thread (a Ray actor's, the trainer's reward thread) it must be called with
``parsing_timeout=None`` / ``timeout_seconds=None``, i.e. unbounded. A worker thread with a deadline is no fix:
sympy can sit in one long C call (a huge power, a big-int conversion) that holds the GIL, so the caller could
not even observe its own deadline. Here the expressions are graded in a child process instead:

- the child runs math-verify on *its* main thread, so math-verify's own alarms (``soft_timeout_s``) work and
  handle the common slow case without losing the process;
- the parent waits at most ``timeout_s`` for each answer; past that (or if the child dies) it kills the child,
  counts the pair as not equivalent, and starts a fresh child on the next call;
- the child's address space is capped (``memory_limit_bytes``) so a pathological expansion fails with
  MemoryError instead of taking the machine's memory.

Protocol: one JSON object per line on the child's stdin/stdout: ``{"gold", "pred"}`` → ``{"equal", "error"?}``;
the child first writes ``{"ready": true}`` once math-verify is imported.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger(__name__)


class MathVerifyError(RuntimeError):
    """The math-verify worker could not be started or keeps dying."""


def _as_latex(answer: str) -> str:
    # Boxed so math-verify's extraction takes the whole answer as one expression (bare text would be searched
    # for the first number-like span instead).
    return "\\boxed{" + answer + "}"


def _serve(soft_timeout_s: int, memory_limit_bytes: int) -> None:
    """Child main loop: grade ``(gold, pred)`` requests from stdin until it closes."""
    if memory_limit_bytes > 0:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
        except (ImportError, ValueError, OSError):  # platform without RLIMIT_AS: run uncapped
            pass
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # per-call timeout warnings would flood stderr
    from math_verify import parse, verify

    channel = sys.stdout
    sys.stdout = sys.stderr  # a stray print from a library must not corrupt the protocol
    # math-verify builds its LaTeX grammar and sympy's caches on first use; doing that before "ready" keeps the
    # start-up cost under startup_timeout_s, so timeout_s bounds a grading alone, in a fresh child too.
    verify(parse("$\\frac{1}{2}$", parsing_timeout=soft_timeout_s), parse("0.5", parsing_timeout=soft_timeout_s),
           timeout_seconds=soft_timeout_s)
    channel.write(json.dumps({"ready": True}) + "\n")
    channel.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            gold = parse(_as_latex(req["gold"]), parsing_timeout=soft_timeout_s)
            pred = parse(_as_latex(req["pred"]), parsing_timeout=soft_timeout_s)
            equal = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=soft_timeout_s))
            resp: dict = {"equal": equal}
        except MemoryError:
            resp = {"equal": False, "error": "MemoryError"}
        except Exception as e:  # a grading failure is "not equivalent", never a dead worker
            resp = {"equal": False, "error": f"{type(e).__name__}: {e}"[:300]}
        channel.write(json.dumps(resp) + "\n")
        channel.flush()


class MathVerifyWorker:
    """Equivalence of two answer strings by math-verify, bounded in time and memory; thread-safe.

    ``equivalent(gold, pred)`` returns within about ``timeout_s`` seconds whatever the input. ``restarts``
    counts children killed for running past the deadline or dying. Results are cached (``cache_size`` pairs).
    """

    def __init__(
        self,
        *,
        timeout_s: float = 10.0,
        soft_timeout_s: int = 3,
        memory_limit_bytes: int = 2 << 30,
        startup_timeout_s: float = 120.0,
        cache_size: int = 4096,
    ) -> None:
        if timeout_s <= 0 or soft_timeout_s < 1:
            raise ValueError(f"timeout_s must be > 0 and soft_timeout_s >= 1, got {timeout_s}, {soft_timeout_s}")
        self.timeout_s = timeout_s
        self.soft_timeout_s = int(soft_timeout_s)
        self.memory_limit_bytes = int(memory_limit_bytes)
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0
        self._cache: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner_pid = -1
        self._buf = b""
        self._consecutive_failures = 0

    @property
    def pid(self) -> int | None:
        """The child's pid, or None before the first call / after a kill."""
        return self._proc.pid if self._proc is not None and self._owner_pid == os.getpid() else None

    def equivalent(self, gold: str, pred: str) -> bool:
        key = (gold, pred)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            equal, definitive = self._ask(gold, pred)
            if definitive:  # a timeout is not cached: the same pair may be lucky on a less loaded machine
                self._cache[key] = equal
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return equal

    def close(self) -> None:
        with self._lock:
            self._stop(kill=False)

    # -- internals (called with the lock held) --

    def _start(self) -> None:
        package_root = str(Path(__file__).resolve().parents[3])  # so the child finds k3 wherever we were run
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [
            sys.executable,
            "-m",
            "k3.rl.reward.math_verify_worker",
            "--soft-timeout",
            str(self.soft_timeout_s),
            "--memory-limit",
            str(self.memory_limit_bytes),
        ]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._owner_pid = os.getpid()
        self._buf = b""
        ready = self._read_line(time.monotonic() + self.startup_timeout_s)
        if ready is None or not json.loads(ready).get("ready"):
            self._stop(kill=True)
            raise MathVerifyError(
                f"the math-verify worker did not start within {self.startup_timeout_s:.0f} s "
                f"(`{' '.join(cmd)}`; is math-verify installed? `pip install 'math-verify>=0.9,<0.10'`)"
            )

    def _stop(self, *, kill: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is None or self._owner_pid != os.getpid():  # a forked copy must not touch the parent's child
            return
        try:
            if kill:
                proc.kill()
            else:
                proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            proc.stdout.close()

    def _read_line(self, deadline: float) -> bytes | None:
        """One line from the child, or None on deadline or EOF."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def _ask(self, gold: str, pred: str) -> tuple[bool, bool]:
        """(equal, definitive): definitive is False when the child ran out of time or died."""
        if self._proc is None or self._owner_pid != os.getpid() or self._proc.poll() is not None:
            self._proc = None
            self._start()
        started = time.monotonic()
        try:
            self._proc.stdin.write((json.dumps({"gold": gold, "pred": pred}) + "\n").encode())
            self._proc.stdin.flush()
            line = self._read_line(started + self.timeout_s)
        except (BrokenPipeError, OSError):
            line = None
        if line is None:
            died = self._proc.poll() is not None
            self._stop(kill=True)
            self.restarts += 1
            self._consecutive_failures += 1
            log.warning(
                "math-verify %s after %.1f s on gold=%.80r pred=%.80r: counted as not equivalent, worker restarted",
                "died" if died else "ran past its deadline",
                time.monotonic() - started,
                gold,
                pred,
            )
            if died and self._consecutive_failures >= 3:
                raise MathVerifyError("the math-verify worker died on 3 requests in a row; see its stderr above")
            return False, False
        self._consecutive_failures = 0
        resp = json.loads(line)
        if resp.get("error"):
            log.debug("math-verify error on gold=%.80r pred=%.80r: %s", gold, pred, resp["error"])
        return bool(resp["equal"]), True


_default: MathVerifyWorker | None = None
_default_lock = threading.Lock()


def default_worker() -> MathVerifyWorker:
    """The process-wide worker the reward functions use (started on first use, stopped at exit)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathVerifyWorker()
            atexit.register(_default.close)
        return _default


def main() -> None:
    p = argparse.ArgumentParser(description="math-verify grading worker (spoken to over stdin/stdout JSON lines)")
    p.add_argument("--soft-timeout", type=int, default=3, help="math-verify's own per-step timeout, seconds")
    p.add_argument("--memory-limit", type=int, default=2 << 30, help="address-space cap in bytes (0: none)")
    args = p.parse_args()
    _serve(args.soft_timeout, args.memory_limit)


if __name__ == "__main__":
    main()
