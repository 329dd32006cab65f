"""Benchmark workers: each side of a speed comparison in a long-lived process of its own.

The parent starts a `Worker` (`python -m MODULE ARGS...`); the worker builds what it times, warms
it up, prints one JSON line (its hello), then `serve`s: one JSON command per stdin line, one JSON
reply per stdout line (`{"error": ...}` when the command raised), until `{"quit": true}` or the
end of stdin. A process of its own per side, because glibc reads its MALLOC_* variables only when
a process starts and a compiled or autotuned side must not warm the other's caches; one process
per side for the whole run, so rounds can take turns (a change of load on a shared machine then
hits every side).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]


class Worker:
    """The parent's handle on one worker process."""

    def __init__(self, name: str, module: str, args: list[str], env: dict | None = None):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
        self.hello: dict = {}

    def ready(self) -> dict:
        """The worker's hello, once it has warmed up (workers started together warm up together)."""
        if not self.hello:
            self.hello = self.read()
        return self.hello

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} worker exited (status {self.proc.wait()}); its error is above")
        reply = json.loads(line)
        if "error" in reply:
            raise SystemExit(f"{self.name}: {reply['error']}")
        return reply

    def send(self, **command) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def ask(self, **command) -> dict:
        self.send(**command)
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(quit=True)
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()


def serve(hello: dict, answer: Callable[[dict], dict]) -> None:
    """The worker's side: print `hello`, then answer each command line with `answer(command)`."""
    print(json.dumps({"ready": True, "pid": os.getpid(), **hello}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        try:
            reply = answer(command)
        except Exception as exc:  # report and go on: the parent decides
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
