"""A real, multi-process Airflow deployment on loopback, without Docker.

The same topology as deploy/docker-compose.yaml, started from Debian's PostgreSQL and Redis and
the project's venv: PostgreSQL (metadata DB + Celery result backend), Redis (Celery broker),
`airflow api-server`, `scheduler`, `dag-processor`, `triggerer` and two `celery worker`s. Every
Airflow component is started through deploy/bin/airflow-component.sh with an env file in the
format of deploy/airflow.env.example, so the documented plain-process recipe is what the tests
run.

Why plain processes in their own process groups: `airflow dags test` runs tasks in one process
and ignores executors, pools, schedules and triggers; only a real scheduler handing work to
separate workers can show what nightly and per-commit runs rely on. Each component is a session
leader (its pid is its process-group id), so stopping one kills its whole tree, and a marker in
the environment of everything the deployment starts lets `leftovers()` find any process that
escaped (e.g. a benchmark server a task started with setsid).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[2]
COMPONENT_SCRIPT = REPO / "deploy" / "bin" / "airflow-component.sh"
ENV_EXAMPLE = REPO / "deploy" / "airflow.env.example"
VENV_BIN = REPO / ".venv" / "bin"
ADMIN_USER = "admin"


def deploy_setting(key: str, *, commented: bool = False) -> str:
    """A setting the production env file (deploy/airflow.env.example) fixes for every
    deployment, read from there so that the tests and the benchmark run what it says.
    `commented`: a setting the file offers commented out (`#KEY=value`), for another topology
    (the LocalExecutor's)."""
    for line in ENV_EXAMPLE.read_text().splitlines():
        if commented:
            if not line.startswith("#"):
                continue
            line = line[1:]
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            return value.strip()
    raise KeyError(f"{key} is not set in {ENV_EXAMPLE}")


class DeploymentError(RuntimeError):
    """The deployment did not come up (or misbehaved); the message carries the log tails."""


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_postgres_bin() -> Path:
    """The directory holding initdb / pg_ctl: PATH first, then Debian's versioned layout."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), reverse=True)
    if candidates:
        return candidates[0].parent
    raise DeploymentError("PostgreSQL not found (initdb); run `make test-deps`")


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<unreadable: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Proc:
    """One started component: its process group (= pid, it is a session leader) and log."""

    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes]
    env: dict[str, str] = field(repr=False, default_factory=dict)

    @property
    def pgid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None


def _group_members(pgid: int) -> list[int]:
    """Pids whose process group is `pgid` (from /proc; zombies excluded)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command (which may hold spaces) start after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def stop_group(proc: Proc, grace_s: float = 20.0) -> None:
    """SIGTERM the component's process group, SIGKILL what is left after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.popen.poll()
        if not _group_members(proc.pgid):
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.popen.wait(timeout=10)


class Deployment:
    """PostgreSQL + Redis + the Airflow components, on loopback, in `root`.

    `dags_folder` is what the dag-processor parses; `extra_env` lands in the shared env file
    (so every component sees it, as a user's env file would); `workers` Celery workers are
    started, each with its own small env file (worker name, log-server port). `warehouse` is
    SPEEDMATRIX_WAREHOUSE: a folder (default `root/warehouse`) or `s3://bucket/prefix`, whose
    endpoint and credentials (AWS_*) then come in `extra_env`, as a deployment's env file
    gives them.
    """

    def __init__(
        self,
        root: Path,
        dags_folder: Path,
        *,
        workers: int = 2,
        worker_concurrency: int = 2,
        extra_env: dict[str, str] | None = None,
        warehouse: str | None = None,
    ) -> None:
        self.root = root
        self.dags_folder = dags_folder
        self.n_workers = workers
        self.worker_concurrency = worker_concurrency
        self.extra_env = dict(extra_env or {})
        self.marker = f"sm-deploy-{secrets.token_hex(6)}"
        self.procs: dict[str, Proc] = {}
        self.airflow_home = root / "airflow-home"
        self.warehouse = warehouse or str(root / "warehouse")
        self.logs = root / "logs"
        self.env_file = root / "airflow.env"
        self.worker_env_files: dict[str, Path] = {}
        self.shared_env: dict[str, str] = {}
        self.password = secrets.token_urlsafe(12)
        self.pg_port = free_port()
        self.redis_port = free_port()
        self.api_port = free_port()
        self.pg_dir: Path | None = None
        self.pg_user: str | None = None
        self._token: str | None = None
        self._session = requests.Session()

    # ------------------------------------------------------------------ configuration
    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def broker_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def _pg_dsn(self, driver: str) -> str:
        return f"{driver}://airflow@127.0.0.1:{self.pg_port}/airflow"

    def settings(self) -> dict[str, str]:
        """The shared env file's content: the same keys as deploy/airflow.env.example."""
        s = {
            "AIRFLOW_HOME": str(self.airflow_home),
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__PARALLELISM": "8",
            "AIRFLOW__CORE__FERNET_KEY": _fernet_key(),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.api_url}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(
                self.airflow_home / "passwords.json"
            ),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self._pg_dsn("postgresql+psycopg2"),
            "AIRFLOW__CELERY__BROKER_URL": self.broker_url,
            "AIRFLOW__CELERY__RESULT_BACKEND": self._pg_dsn("db+postgresql+psycopg2"),
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(self.worker_concurrency),
            "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": deploy_setting(
                "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS"
            ),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.api_port),
            "AIRFLOW__API__BASE_URL": self.api_url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": deploy_setting(
                "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME"
            ),
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            # Test-speed knobs (a production file keeps Airflow's defaults): parse new DAG
            # files within seconds, notice a dead scheduler or a silent task within 30 s
            # (tasks heartbeat every few seconds; the killed-worker test waits this long).
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            # A test deployment's DAG files never change once written: each is parsed when it
            # is new, not again every 15 s (re-parsing the five files made the dag-processor
            # the deployment's busiest component: 23 CPU-s in its first five minutes).
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "30",
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "10",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
            # A busy machine must not turn slow imports into import errors.
            "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
            "AIRFLOW__DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "180",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
            "SPEEDMATRIX_WAREHOUSE": self.warehouse,
            "SPEEDMATRIX_DEPLOYMENT_MARKER": self.marker,
        }
        s.update(self.extra_env)
        return s

    @property
    def warehouse_is_local(self) -> bool:
        return "://" not in self.warehouse

    def warehouse_env(self) -> dict[str, str]:
        """What a reader of the deployment's warehouse needs from the deployment's env file
        (SPEEDMATRIX_WAREHOUSE and the object store's AWS_* settings): a test reads the runs
        back with what the workers landed them with."""
        return {
            k: v
            for k, v in self.shared_env.items()
            if k == "SPEEDMATRIX_WAREHOUSE" or k.startswith("AWS_")
        }

    def _base_env(self) -> dict[str, str]:
        """The launching environment: the test's, minus its own Airflow settings and object
        store settings (AWS_*): the components get those from the env file only, so a setting
        the env file lacks shows up as a failure instead of being inherited from the test."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "AWS_"))}
        env.pop("SPEEDMATRIX_WAREHOUSE", None)
        env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}"
        env["PYTHONUNBUFFERED"] = "1"
        return env

    @staticmethod
    def _write_env_file(path: Path, values: dict[str, str]) -> None:
        lines = ["# generated by tests/deployment/deploy_harness.py"]
        for key, value in values.items():
            if any(c in value for c in "\n'"):
                raise ValueError(f"env value for {key} cannot be written safely")
            lines.append(f"{key}='{value}'")
        path.write_text("\n".join(lines) + "\n")

    # ------------------------------------------------------------------ start / stop
    def start(self, timeout_s: float = 600.0) -> None:
        """Bring everything up and wait until the API reports all components healthy."""
        for d in (self.airflow_home, self.logs, self.dags_folder):
            d.mkdir(parents=True, exist_ok=True)
        if self.warehouse_is_local:
            Path(self.warehouse).mkdir(parents=True, exist_ok=True)
        try:
            self._start_postgres()
            self._start_redis()
            self.shared_env = self.settings()
            self._write_env_file(self.env_file, self.shared_env)
            (self.airflow_home / "passwords.json").write_text(
                json.dumps({ADMIN_USER: self.password})
            )
            for i in range(1, self.n_workers + 1):
                name = f"worker{i}"
                f = self.root / f"{name}.env"
                self._write_env_file(
                    f,
                    {
                        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                        "SPEEDMATRIX_WORKER_NAME": name,
                    },
                )
                self.worker_env_files[name] = f
            # The Celery workers first, while the metadata DB is migrated: they never touch it
            # (tasks reach it through the api-server), and their start (the task path's
            # libraries preloaded, flows/preload.py) is the longest of all components'. The
            # others read the metadata DB from their first step, so they start after it.
            for name in self.worker_env_files:
                self.start_component(name)
            self._migrate()
            for name in ("api-server", "scheduler", "dag-processor", "triggerer"):
                self.start_component(name)
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _component_argv(self, name: str) -> tuple[list[str], str]:
        """argv and the env-file list for a component name (worker1, scheduler, …)."""
        if name in self.worker_env_files:
            argv = [
                "bash",
                str(COMPONENT_SCRIPT),
                "worker",
                "--celery-hostname",
                f"{name}@%h",
                "--concurrency",
                str(self.worker_concurrency),
                # Every worker serves the shared queue plus one of its own, so a test can pin
                # a task to a given worker (e.g. two runs of one host on two workers).
                "--queues",
                f"default,{name}",
            ]
            return argv, f"{self.env_file}:{self.worker_env_files[name]}"
        return ["bash", str(COMPONENT_SCRIPT), name], str(self.env_file)

    def start_component(self, name: str) -> Proc:
        """Start (or restart) one component in its own session; output to logs/<name>.log."""
        argv, env_files = self._component_argv(name)
        env = self._base_env()
        env["SPEEDMATRIX_AIRFLOW_ENV"] = env_files
        env["SPEEDMATRIX_DEPLOYMENT_MARKER"] = self.marker
        return self._spawn(name, argv, env)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> Proc:
        log = self.logs / f"{name}.log"
        with log.open("ab") as out:
            out.write(f"\n===== start {time.strftime('%H:%M:%S')}: {' '.join(argv)}\n".encode())
            out.flush()
            popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.root,
                start_new_session=True,  # setsid: pid == pgid, stop kills the whole tree
            )
        (self.logs / f"{name}.pid").write_text(str(popen.pid))
        proc = Proc(name, argv, log, popen, env)
        self.procs[name] = proc
        return proc

    def stop_component(self, name: str, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop one component: SIGTERM (graceful, then SIGKILL) or SIGKILL at once."""
        proc = self.procs[name]
        if sig == signal.SIGKILL:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)
        else:
            stop_group(proc)

    def stop(self) -> list[str]:
        """Stop everything (Airflow first, the databases last); return leftover processes."""
        airflow = [n for n in self.procs if n != "redis"]
        # All Airflow components at once (each gets its grace period in parallel, not in turn).
        for name in airflow:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs[name].pgid, signal.SIGTERM)
        for name in airflow:
            stop_group(self.procs[name])
        if "redis" in self.procs:
            stop_group(self.procs["redis"])
        self._stop_postgres()
        left = self.leftovers()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return [f"{pid}: {_cmdline(pid)}" for pid in left]

    def leftovers(self) -> list[int]:
        """Pids of live processes that carry this deployment's marker in their environment."""
        needle = f"SPEEDMATRIX_DEPLOYMENT_MARKER={self.marker}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
                state = (entry / "stat").read_text()
            except OSError:
                continue
            if needle in environ.split(b"\0") and state[state.rfind(")") + 2] != "Z":
                found.append(int(entry.name))
        return found

    # ------------------------------------------------------------------ databases
    def _as_pg_user(self, argv: list[str]) -> list[str]:
        """PostgreSQL refuses to run as root: run it as an unprivileged user when we are root."""
        if os.geteuid() != 0:
            return argv
        return ["runuser", "-u", self.pg_user or "postgres", "--", *argv]

    def _pick_pg_user(self) -> str | None:
        if os.geteuid() != 0:
            return None
        for candidate in ("postgres", "speedmatrix-pg"):
            try:
                pwd.getpwnam(candidate)
                return candidate
            except KeyError:
                continue
        subprocess.run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "speedmatrix-pg",
            ],
            check=True,
        )
        return "speedmatrix-pg"

    def _start_postgres(self) -> None:
        pg_bin = find_postgres_bin()
        self.pg_user = self._pick_pg_user()
        # Outside `root`: pytest's temp dirs are private to root, PostgreSQL's user must enter.
        self.pg_dir = Path(tempfile.mkdtemp(prefix="sm-deploy-pg-"))
        if self.pg_user:
            info = pwd.getpwnam(self.pg_user)
            os.chown(self.pg_dir, info.pw_uid, info.pw_gid)
        data = self.pg_dir / "data"
        out = subprocess.run(
            self._as_pg_user(
                [
                    str(pg_bin / "initdb"),
                    "-D",
                    str(data),
                    "-U",
                    "airflow",
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ]
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if out.returncode != 0:
            raise DeploymentError(f"initdb failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        opts = (
            f"-p {self.pg_port} -k {self.pg_dir} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        out = subprocess.run(
            self._as_pg_user(
                [
                    str(pg_bin / "pg_ctl"),
                    "-D",
                    str(data),
                    "-o",
                    opts,
                    "-l",
                    str(self.pg_dir / "postgres.log"),
                    "-w",
                    "-t",
                    "60",
                    "start",
                ]
            ),
            capture_output=True,
            text=True,
            timeout=90,
        )
        if out.returncode != 0:
            raise DeploymentError(
                f"pg_ctl start failed:\n{out.stdout}\n{out.stderr}\n"
                f"{_tail(self.pg_dir / 'postgres.log', 40)}"
            )
        import psycopg2  # the driver Airflow uses too

        conn = psycopg2.connect(
            host="127.0.0.1", port=self.pg_port, user="airflow", dbname="postgres"
        )
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CREATE DATABASE airflow")
        conn.close()

    def _stop_postgres(self) -> None:
        if not self.pg_dir or not (self.pg_dir / "data").exists():
            return
        pg_bin = find_postgres_bin()
        subprocess.run(
            self._as_pg_user(
                [
                    str(pg_bin / "pg_ctl"),
                    "-D",
                    str(self.pg_dir / "data"),
                    "-m",
                    "fast",
                    "-w",
                    "stop",
                ]
            ),
            capture_output=True,
            timeout=60,
        )
        shutil.copy(self.pg_dir / "postgres.log", self.logs / "postgres.log")
        shutil.rmtree(self.pg_dir, ignore_errors=True)

    def _start_redis(self) -> None:
        redis = shutil.which("redis-server")
        if not redis:
            raise DeploymentError("redis-server not found; run `make test-deps`")
        (self.root / "redis").mkdir(exist_ok=True)
        env = self._base_env()
        env["SPEEDMATRIX_DEPLOYMENT_MARKER"] = self.marker
        self._spawn(
            "redis",
            [
                redis,
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.root / "redis"),
            ],
            env,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.redis_port), timeout=1) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.2)
        raise DeploymentError(f"redis did not answer:\n{self.log_tails(['redis'])}")

    def _migrate(self) -> None:
        env = self._base_env()
        env["SPEEDMATRIX_AIRFLOW_ENV"] = str(self.env_file)
        log = self.logs / "migrate.log"
        with log.open("wb") as out:
            rc = subprocess.run(
                ["bash", str(COMPONENT_SCRIPT), "migrate"],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                timeout=600,
            ).returncode
        if rc != 0:
            raise DeploymentError(f"airflow db migrate failed (rc {rc}):\n{_tail(log, 60)}")

    # ------------------------------------------------------------------ health
    def wait_healthy(self, timeout_s: float = 240.0) -> None:
        """API up, scheduler / triggerer / dag-processor heartbeating, every worker answering."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            dead = [p.name for p in self.procs.values() if not p.alive()]
            if dead:
                raise DeploymentError(f"components exited: {dead}\n{self.log_tails()}")
            try:
                health = self._session.get(
                    f"{self.api_url}/api/v2/monitor/health", timeout=5
                ).json()
                statuses = {k: (v or {}).get("status") for k, v in health.items()}
                last = json.dumps(statuses)
                if all(s == "healthy" for s in statuses.values()) and len(statuses) >= 4:
                    workers = self.celery_workers()
                    last += f" workers={workers}"
                    if len(workers) >= self.n_workers:
                        return
            except (requests.RequestException, ValueError) as exc:
                last = str(exc)
            time.sleep(1)
        raise DeploymentError(
            f"deployment not healthy after {timeout_s}s: {last}\n{self.log_tails()}"
        )

    def celery_workers(self) -> list[str]:
        """Names of the Celery workers answering a broadcast ping right now."""
        from celery import Celery

        app = Celery(broker=self.broker_url)
        try:
            replies = app.control.ping(timeout=2.0) or []
        finally:
            app.close()
        return sorted(name for reply in replies for name in reply)

    def log_tails(self, names: list[str] | None = None, lines: int = 40) -> str:
        """The last lines of every component's log (what a failing test prints)."""
        chunks = []
        for log in sorted(self.logs.glob("*.log")):
            if names and log.stem not in names:
                continue
            chunks.append(f"----- {log.name} (last {lines} lines)\n{_tail(log, lines)}")
        if self.pg_dir and (self.pg_dir / "postgres.log").exists():
            chunks.append(f"----- postgres.log\n{_tail(self.pg_dir / 'postgres.log', 15)}")
        return "\n".join(chunks)

    # ------------------------------------------------------------------ REST API
    def _auth(self) -> dict[str, str]:
        if self._token is None:
            r = self._session.post(
                f"{self.api_url}/auth/token",
                json={"username": ADMIN_USER, "password": self.password},
                timeout=90,
            )
            r.raise_for_status()
            self._token = r.json()["access_token"]
        return {"Authorization": f"Bearer {self._token}"}

    def api(self, method: str, path: str, retries: int = 4, **kwargs: Any) -> Any:
        """One call to /api/v2 (JWT from the simple auth manager); JSON answer or an error.

        A busy machine can make the (single-worker) api-server miss a read timeout: calls are
        retried, which is safe for every call the tests make (GETs, PATCHes of a flag,
        DELETEs, and triggers with explicit run ids, see `trigger`).
        """
        for attempt in range(retries + 1):
            try:
                r = self._session.request(
                    method,
                    f"{self.api_url}/api/v2{path}",
                    headers=self._auth(),
                    timeout=90,
                    **kwargs,
                )
                break
            except (requests.ConnectionError, requests.Timeout):
                if attempt == retries:
                    raise
                time.sleep(5)
        if r.status_code >= 400:
            raise DeploymentError(f"{method} {path} -> {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None

    def wait_dag(self, dag_id: str, timeout_s: float = 300.0, unpause: bool = True) -> dict:
        """Wait until the dag-processor has serialised `dag_id`; unpause it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(DeploymentError):
                dag = self.api("GET", f"/dags/{dag_id}")
                if unpause and dag.get("is_paused"):
                    dag = self.api("PATCH", f"/dags/{dag_id}", json={"is_paused": False})
                return dag
            time.sleep(1)
        errors = ""
        with contextlib.suppress(DeploymentError):
            errors = json.dumps(self.api("GET", "/importErrors"))[:3000]
        raise DeploymentError(
            f"DAG {dag_id} not parsed after {timeout_s}s; import errors: {errors}\n"
            f"{self.log_tails(['dag-processor'])}"
        )

    def trigger(self, dag_id: str, conf: dict | None = None, run_id: str | None = None) -> str:
        """Trigger a run through the REST API (as a user or an upstream system would)."""
        run_id = run_id or f"manual__test-{secrets.token_hex(6)}"
        body: dict[str, Any] = {"logical_date": None, "conf": conf or {}, "dag_run_id": run_id}
        try:
            self.api("POST", f"/dags/{dag_id}/dagRuns", json=body)
        except DeploymentError as exc:
            # 409: a retried POST whose first attempt had created the run after all.
            if "-> 409" not in str(exc):
                raise
        return run_id

    def runs(self, dag_id: str) -> list[dict]:
        """All runs of a DAG (oldest first)."""
        return self.api("GET", f"/dags/{dag_id}/dagRuns", params={"limit": 100, "order_by": "id"})[
            "dag_runs"
        ]

    def run(self, dag_id: str, run_id: str) -> dict:
        return self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        return self.api(
            "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100}
        )["task_instances"]

    def wait_runs(
        self, dag_id: str, run_ids: list[str], timeout_s: float = 300.0
    ) -> dict[str, str]:
        """Wait until every run is finished; return run_id -> state (fails with log tails)."""
        terminal = {"success", "failed"}
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = {rid: self.run(dag_id, rid)["state"] for rid in run_ids}
            if all(s in terminal for s in states.values()):
                return states
            time.sleep(1)
        detail = {rid: self._ti_summary(dag_id, rid) for rid in run_ids}
        raise DeploymentError(
            f"runs of {dag_id} not finished after {timeout_s}s: {states}\n{detail}\n{self.log_tails()}"
        )

    def _ti_summary(self, dag_id: str, run_id: str) -> list[tuple]:
        with contextlib.suppress(DeploymentError):
            return [
                (t["task_id"], t.get("map_index"), t["state"], t.get("hostname"))
                for t in self.task_instances(dag_id, run_id)
            ]
        return []

    def wait_for(
        self, what: str, predicate: Any, timeout_s: float = 120.0, every_s: float = 1.0
    ) -> Any:
        """Poll `predicate()` until it returns something truthy; fail with the log tails."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(every_s)
        raise DeploymentError(
            f"timed out after {timeout_s}s waiting for {what}\n{self.log_tails()}"
        )


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def _fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


@contextlib.contextmanager
def deployment(root: Path, dags_folder: Path, **kwargs: Any) -> Iterator[Deployment]:
    """Start a Deployment, yield it, always stop it and fail if any process survived."""
    dep = Deployment(root, dags_folder, **kwargs)
    dep.start()
    try:
        yield dep
    finally:
        left = dep.stop()
        if left:
            raise DeploymentError(f"processes left after stop: {left}")
