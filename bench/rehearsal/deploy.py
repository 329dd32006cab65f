"""The deploy/README.md commands on one machine: its `rehearsal` blocks read as commands, and a
real two-node Ray cluster (`Rehearsal`: a head and a worker started with `ray start` on
127.0.0.1, each with its own temp dir, a private HOME, free ports and token authentication) to
run them against. Shared by tests/test_deploy.py, tests/test_deploy_rehearsal.py and
`python -m bench.rehearsal.submit_repeat`.

Every process a `Rehearsal` starts carries a marker in its environment; `close` stops each by its
id (the process groups of `ray start`, then what is left, by pid), never with Ray's own stop
command, which would end every Ray process on the machine.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def readme_blocks() -> dict[str, str]:
    """The fenced bash blocks of deploy/README.md marked `<!-- rehearsal: NAME -->`, by name."""
    text = (DEPLOY / "README.md").read_text()
    found = re.findall(r"<!-- rehearsal: ([\w-]+) -->\s*```bash\n(.*?)```", text, flags=re.S)
    return {name: body for name, body in found}


def shell_commands(block: str) -> list[list[str]]:
    """The commands of a bash block as words (continuations joined, comments dropped); shell
    variables are left as they are ($RAY_ADDRESS), quotes removed."""
    joined = re.sub(r"\\\n", " ", block)
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            commands.append(words)
    return commands


def readme_command(name: str, program: str) -> list[str]:
    """The one command of README block `name` whose first word is `program`."""
    matches = [c for c in shell_commands(readme_blocks()[name]) if c[0] == program]
    assert len(matches) == 1, (name, program, matches)
    return matches[0]


def after_double_dash(words: list[str]) -> list[str]:
    return words[words.index("--") + 1:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replace_flags(words: list[str], values: dict[str, str | None], extra: list[str] = ()) -> list[str]:
    """`words` with the value of each flag in `values` replaced (None drops the flag), every
    repeated flag collapsed into its first place, and `extra` appended."""
    out, seen, i = [], set(), 0
    while i < len(words):
        word = words[i]
        if word in values:
            if word not in seen and values[word] is not None:
                replacement = values[word]
                out += [word, *replacement] if isinstance(replacement, list) else [word, replacement]
            seen.add(word)
            i += 2
            continue
        out.append(word)
        i += 1
    missing = [f for f in values if f not in seen]
    assert not missing, f"the README command has no {missing}"
    return out + list(extra)


def swap(text: str, values: dict[str, str]) -> str:
    """`text` with each key replaced by its value; every key must be there."""
    for old, new in values.items():
        assert old in text, f"the README block has no {old!r}"
        text = text.replace(old, new)
    return text


class Processes:
    """Finds and stops every process started under one marker (an environment variable)."""

    def __init__(self, marker: str):
        self.marker = f"FADRM_REHEARSAL={marker}".encode()

    def alive(self) -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # a zombie holds nothing but its pid
                if self.marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except (OSError, IndexError):
                continue
        return pids

    def stop(self, leaders: list[subprocess.Popen], grace: float = 40.0) -> list[int]:
        """SIGTERM to the process groups of `leaders`, then SIGKILL to every marked process left;
        returns the pids still alive after that (none, normally)."""
        for proc in leaders:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + grace
        while time.time() < deadline and self.alive():
            for proc in leaders:
                proc.poll()
            time.sleep(0.5)
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        while time.time() < deadline and self.alive():
            time.sleep(0.2)
        for proc in leaders:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        return self.alive()


class Rehearsal:
    """A head and a worker on 127.0.0.1, the README's token step done, and the shell env to run
    the README's commands in (HOME private, RAY_AUTH_MODE=token, RAY_ADDRESS the head's Jobs API)."""

    def __init__(self, root: Path):
        self.root = root
        self.home = root / "home"
        self.home.mkdir()
        self.processes = Processes(uuid.uuid4().hex)
        self.leaders: list[subprocess.Popen] = []
        bindir = str(Path(sys.executable).parent)  # `ray` and `fadrm` of this Python, not a shim
        self.env = {**os.environ, "HOME": str(self.home), "PATH": f"{bindir}:{os.environ.get('PATH', '')}",
                    "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
                    "FADRM_REHEARSAL": self.processes.marker.decode().split("=", 1)[1],
                    "RAY_USAGE_STATS_ENABLED": "0"}
        for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            self.env.pop(name, None)
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.gcs = f"127.0.0.1:{self.gcs_port}"
        self.jobs_api = f"http://127.0.0.1:{self.dashboard_port}"

    def bash(self, script: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def run(self, words: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(words, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)

    def start(self):
        # README step 2, as written: the Ray token (~/.ray/auth_token) and the API token
        done = self.bash(readme_blocks()["token"])
        assert done.returncode == 0, done.stderr
        assert (self.home / ".ray" / "auth_token").stat().st_size > 0
        assert (self.home / ".fadrm" / "api_token").stat().st_size > 0
        self.env["RAY_AUTH_MODE"] = "token"  # the block's `export`, kept for every later command
        self.env["RAY_ADDRESS"] = self.jobs_api  # README step 3: the head's Jobs API
        # One temp dir per node, as on two machines (short: Ray's socket paths must fit 107 bytes)
        tag = uuid.uuid4().hex[:8]
        self.temps = {"head": Path(f"/tmp/fr-{tag}-h"), "worker": Path(f"/tmp/fr-{tag}-w")}
        head_cmd, worker_cmd = readme_command_pair()

        def local(node: str) -> list[str]:
            return ["--node-ip-address=127.0.0.1", f"--temp-dir={self.temps[node]}", "--disable-usage-stats",
                    "--object-store-memory=150000000", "--block", f"--dashboard-agent-listen-port={free_port()}"]

        head = replace_flags(head_cmd, {"--port": str(self.gcs_port), "--num-cpus": "1", "--dashboard-host": "127.0.0.1"},
                             [f"--dashboard-port={self.dashboard_port}", "--include-dashboard=true",
                              f"--ray-client-server-port={free_port()}", *local("head")])
        self.leaders.append(self.popen(head, "head"))
        self.wait_for_jobs_api()
        worker = replace_flags(worker_cmd, {"--address": self.gcs}, ["--num-cpus=1", *local("worker")])
        self.leaders.append(self.popen(worker, "worker"))
        self.wait_for_nodes(2)
        # each raylet keeps its session under its own --temp-dir, none under the other's
        for node, temp in self.temps.items():
            sessions = list(temp.glob("session_2*"))
            assert len(sessions) == 1, f"{node}: {temp} holds {sessions}"

    def popen(self, words: list[str], name: str) -> subprocess.Popen:
        env = dict(self.env)
        while words and "=" in words[0] and not words[0].startswith("-"):  # the README's VAR=value prefix
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        log = open(self.root / f"{name}.log", "w")
        return subprocess.Popen(words, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for_jobs_api(self, timeout: float = 150):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.run(["ray", "job", "list", "--address", self.jobs_api], timeout=60).returncode == 0:
                return
            assert self.leaders[0].poll() is None, (self.root / "head.log").read_text()[-3000:]
            time.sleep(2)
        raise TimeoutError("the head's Jobs API did not come up")

    def nodes(self) -> list[dict]:
        listed = self.run(["ray", "list", "nodes", "--address", self.jobs_api, "--format", "json",
                           "--filter", "state=ALIVE"], timeout=60)
        return json.loads(listed.stdout) if listed.returncode == 0 else []

    def wait_for_nodes(self, count: int, timeout: float = 150):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if len(self.nodes()) >= count:
                return
            time.sleep(2)
        raise TimeoutError(f"{count} nodes did not join: {(self.root / 'worker.log').read_text()[-3000:]}")

    def actors(self, class_name: str) -> list[dict]:
        listed = self.run(["ray", "list", "actors", "--address", self.jobs_api, "--format", "json", "--detail",
                           "--filter", f"class_name={class_name}", "--limit", "1000"], timeout=60)
        assert listed.returncode == 0, listed.stderr
        return json.loads(listed.stdout)

    def close(self) -> list[int]:
        left = self.processes.stop(self.leaders)
        for temp in getattr(self, "temps", {}).values():
            shutil.rmtree(temp, ignore_errors=True)
        return left


def readme_command_pair() -> tuple[list[str], list[str]]:
    """The head's and the worker's `ray start` of the README (with their VAR=value prefix)."""
    commands = [shlex.split(line, comments=True) for line in readme_blocks()["ray-start"].splitlines()]
    commands = [c for c in commands if c]
    head = next(c for c in commands if "--head" in c)
    worker = next(c for c in commands if "--head" not in c)
    assert head[0] == worker[0] == "RAY_AUTH_MODE=token"
    # --port=6379 style flags as two words, so that replace_flags can swap their values
    def split(words):
        return [part for w in words for part in (w.split("=", 1) if w.startswith("--") and "=" in w else [w])]
    return split(head), split(worker)
