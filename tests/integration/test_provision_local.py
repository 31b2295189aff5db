"""Provisioning failures, the env's lock, the shipped files' refresh and the simulator through
the local transport (no vLLM install: the lock and refresh tests install a stand-in `vllm` wheel
of a few kB, without the network; the timeout and PR tests use stand-in python / uv and a local
git repository as "upstream")."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from pathlib import Path

import processes
import pytest
from engine_env_cache import stub_wheel
from gitrepo import upstream_with_pr

from speedmatrix.engine.hosts import get_host
from speedmatrix.engine.provision import (
    ATTEMPT_RECORD,
    MARKER,
    RC_NO_FULL_BUILD,
    SHIPPED,
    ProvisionError,
    build_shipment,
    install_hash,
    provision,
    refresh_shipped,
)
from speedmatrix.recipes import load_recipe

pytestmark = pytest.mark.integration


def _with_install(recipe, **install):
    eng = recipe.engine.model_copy(
        update={"install": recipe.engine.install.model_copy(update=install)}
    )
    return recipe.model_copy(update={"engine": eng})


def test_failed_install_brings_back_the_log_tail_and_writes_no_marker(tmp_path):
    host = get_host("local", env={"HOME": str(tmp_path)})
    recipe = _with_install(
        load_recipe("cpu/tiny/llama-tiny"),
        pip_spec="./no-such-project-dir-speedmatrix",  # pip fails at once, without the network
    )
    with pytest.raises(ProvisionError) as exc:
        provision(recipe, host=host, poll_s=0.5, timeout_s=300)
    text = str(exc.value)
    assert "exit code" in text
    assert "last lines of" in text and "provision.log" in text
    assert "no-such-project-dir-speedmatrix" in exc.value.log_tail
    env_dir = host.resolve(recipe.env_dir())
    assert host.run(f"test -e {env_dir}/{MARKER}").rc == 1


def test_a_failing_post_install_step_fails_the_provisioning(tmp_path):
    host = get_host("local", env={"HOME": str(tmp_path)})
    recipe = _with_install(
        load_recipe("cpu/tiny/llama-tiny"),
        pip_spec="pip",  # already in the venv: a no-op install
        post_install=("echo about to fail; exit 7",),
    )
    with pytest.raises(ProvisionError, match="exit code 7") as exc:
        provision(recipe, host=host, poll_s=0.5, timeout_s=300)
    assert "about to fail" in exc.value.log_tail
    env_dir = host.resolve(recipe.env_dir())
    assert host.run(f"test -e {env_dir}/{MARKER}").rc == 1


def test_sim_provision_on_local_uses_this_python():
    recipe = load_recipe("sim/kimi-k2.7-nvfp4-rtxpro6k-x8")
    res = provision(recipe, host="local")
    assert res.env_dir is None
    assert res.python == sys.executable
    assert res.include_dir and res.include_dir.endswith("/include")


def _standin_wheel(out: Path, version: str = "0.32.0") -> Path:
    """A minimal, valid wheel of a distribution named `vllm` (what the marker step reads)."""
    return stub_wheel(out, version, "0123456789abcdef0123456789abcdef01234567", dist="vllm")


@pytest.fixture
def standin(tmp_path):
    """The CPU recipe installing a stand-in wheel, no model setup; every install appends a
    line to ``$HOME/installs.log`` (outside the env, so a rebuild does not erase the count)."""
    home = tmp_path / "home"
    home.mkdir()
    base = load_recipe("cpu/tiny/llama-tiny")
    recipe = _with_install(
        base,
        pip_spec=str(_standin_wheel(tmp_path)),
        post_install=('echo "installed by $$" >> "$HOME/installs.log"',),
    )
    recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"setup": ()})})
    host = get_host("local", env={"HOME": str(home), "PIP_NO_INDEX": "1"})
    return recipe, host, home


def _installs(home: Path) -> list[str]:
    log = home / "installs.log"
    return log.read_text().splitlines() if log.exists() else []


def test_two_concurrent_provisionings_of_one_env_install_once(standin):
    """Both calls start together: one installs, the other waits for its lock and reuses the
    env; neither fails, and nothing of the winner's env is moved away by the loser."""
    recipe, host, home = standin
    barrier = threading.Barrier(2)
    results: list = [None, None]

    def go(i: int) -> None:
        barrier.wait()
        try:
            results[i] = provision(recipe, host=host, poll_s=0.2, timeout_s=300)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(360)
    assert not any(isinstance(r, BaseException) for r in results), results
    assert sorted(r.reused for r in results) == [False, True]
    assert len(_installs(home)) == 1, _installs(home)
    env_dir = results[0].env_dir
    assert results[1].env_dir == env_dir
    marker = json.loads(Path(env_dir, MARKER).read_text())
    assert marker["install_hash"] == install_hash(recipe, "v0.32.0", None)
    assert host.run(f"{env_dir}/bin/python -c 'import vllm'").rc == 0
    assert provision(recipe, host=host).reused is True
    assert len(_installs(home)) == 1


def test_provisioning_waits_for_the_lock_before_touching_the_env(standin, log_messages):
    """A half-done env (no marker; the holder's attempt record says it is ours) whose lock
    another provisioning holds: provision() waits, leaving the env where it is, and rebuilds it
    once the lock is free."""
    recipe, host, home = standin
    env_dir = Path(host.resolve(recipe.env_dir()))
    state_dir = Path(f"{env_dir}.speedmatrix")
    env_dir.mkdir(parents=True)
    state_dir.mkdir(parents=True)
    (state_dir / ATTEMPT_RECORD).write_text("the holder's attempt\n")
    left_over = env_dir / "half-done-by-the-holder"
    left_over.write_text("x")
    result: list = []
    with open(state_dir / "lock", "w") as lock, log_messages("speedmatrix.provision") as msgs:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other provisioning, mid-install
        t = threading.Thread(
            target=lambda: result.append(provision(recipe, host=host, poll_s=0.2, timeout_s=300))
        )
        t.start()
        for _ in range(300):
            if any("is running: waiting for it" in m for m in msgs) or not t.is_alive():
                break
            time.sleep(0.1)
        assert any("is running: waiting for it" in m for m in msgs), msgs
        # Waiting: the holder's env, state and include/ are untouched, nothing installed.
        assert left_over.exists() and not (env_dir / MARKER).exists()
        assert not (state_dir / "include").exists() and _installs(home) == []
        fcntl.flock(lock, fcntl.LOCK_UN)
    t.join(300)
    assert result and result[0].reused is False
    assert not left_over.exists()  # the half-done env was moved away, then rebuilt
    assert json.loads((env_dir / MARKER).read_text())["ref"] == "v0.32.0"
    assert len(_installs(home)) == 1
    assert not Path(f"{env_dir}.speedmatrix", ATTEMPT_RECORD).exists()


def test_a_load_generator_that_cannot_be_shipped_is_an_error(tmp_path):
    """No silent "provisioned without a load generator": the host could not measure anything."""
    host = get_host("local", env={"HOME": str(tmp_path)})
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the state directory should be")
    with pytest.raises(ProvisionError, match="cannot ship the load generator zipapp"):
        refresh_shipped(host, str(blocker), build_shipment())
    assert blocker.read_text().startswith("a file")


def test_the_shipped_load_generator_runs(tmp_path):
    host = get_host("local", env={"HOME": str(tmp_path)})
    shipped = refresh_shipped(host, f"{tmp_path}/state", build_shipment())
    assert sorted(shipped) == ["include", "loadgen"]
    path = f"{tmp_path}/state/loadgen.pyz"
    res = host.run(f"{sys.executable} {path} --help", timeout_s=120, stream=False)
    assert res.rc == 0 and "decode" in res.stdout, res.tail()


def _stub_dir(tmp_path: Path, **scripts: str) -> Path:
    """A directory of stand-in commands (name -> bash body) to put first on the host's PATH."""
    bin_dir = tmp_path / "stub-bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name.replace("_", ".")
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)
    return bin_dir


def test_a_provisioning_over_its_timeout_is_killed_with_the_log_tail(tmp_path):
    """The install hangs (a stand-in python3.11 whose `-m venv` never returns): past its
    timeout the attempt's process group is killed, the error carries the log's tail, no marker
    is written and the env's lock is free again."""
    home = tmp_path / "home"
    home.mkdir()
    stubs = _stub_dir(
        tmp_path,
        python3_11='echo "stand-in python3.11: hanging"\necho $$ > "$HOME/hung.pid"\nexec sleep 600\n',
    )
    host = get_host("local", env={"HOME": str(home), "PATH": f"{stubs}:{os.environ['PATH']}"})
    recipe = load_recipe("cpu/tiny/llama-tiny")
    t0 = time.monotonic()
    with pytest.raises(ProvisionError, match="did not finish within 3 s") as exc:
        provision(recipe, host=host, poll_s=0.2, timeout_s=3)
    assert time.monotonic() - t0 < 60
    assert "stand-in python3.11: hanging" in exc.value.log_tail
    assert "last lines of" in str(exc.value)
    pid = int((home / "hung.pid").read_text())
    assert not processes.alive(pid)
    env_dir = Path(host.resolve(recipe.env_dir()))
    assert not (env_dir / MARKER).exists()
    with open(f"{env_dir}.speedmatrix/lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody holds it any more


def test_a_pr_touching_compiled_code_with_full_builds_off_fails_clearly(tmp_path):
    """A local 'upstream' whose pull ref changes csrc/; the recipe turns full builds off: the
    provisioning fails saying why, installs nothing and writes no marker."""
    up, _base, _head = upstream_with_pr(tmp_path, "csrc/attn.cu")
    home = tmp_path / "home"
    home.mkdir()
    calls = tmp_path / "uv.calls"
    stubs = _stub_dir(
        tmp_path,
        uv=f'echo "$*" >> {calls}\nif [ "$1" = venv ]; then mkdir -p "${{@: -1}}/bin"; fi\n',
    )
    host = get_host("local", env={"HOME": str(home), "PATH": f"{stubs}:{os.environ['PATH']}"})
    recipe = _with_install(
        load_recipe("nvidia-rtxpro6k/deepseek-ai/deepseek-v4.1-flash-1017"),
        full_build_when_compiled_changes=False,
    )
    with pytest.raises(ProvisionError, match="turns full builds off") as exc:
        provision(recipe, "pr/7", host, repo_url=str(up), poll_s=0.2, timeout_s=120)
    assert f"exit code {RC_NO_FULL_BUILD}" in str(exc.value)
    assert "compiled code changed and full builds are off" in exc.value.log_tail
    assert [c for c in calls.read_text().splitlines() if c.startswith("pip")] == []
    assert not Path(host.resolve(recipe.env_dir("pr/7")), MARKER).exists()


def test_reuse_reships_what_changed_and_nothing_else(standin, log_messages):
    """shipped.json holds the digests of the zipapp and include/ as shipped. Reuse with the same
    digests ships nothing; a digest that differs (an older speedmatrix shipped them) gets that
    part shipped again, by rename, without reinstalling anything."""
    recipe, host, home = standin
    first = provision(recipe, host=host, poll_s=0.2, timeout_s=300)
    assert first.reused is False
    state = Path(first.state_dir)
    pyz, include, record = state / "loadgen.pyz", state / "include", state / SHIPPED
    want = build_shipment().digests
    assert {k: json.loads(record.read_text())[k] for k in want} == want

    # same digests: nothing shipped again (a file planted in include/ survives)
    (include / "planted").write_text("x")
    before = pyz.stat().st_ino, pyz.stat().st_mtime_ns
    with log_messages("speedmatrix.provision") as msgs:
        assert provision(recipe, host=host).reused is True
    assert any("are current" in m for m in msgs), msgs
    assert (pyz.stat().st_ino, pyz.stat().st_mtime_ns) == before
    assert (include / "planted").exists()

    # an old load generator: only it is shipped again
    pyz.write_bytes(b"an old zipapp")
    record.write_text(json.dumps({**want, "loadgen": "0" * 64}))
    with log_messages("speedmatrix.provision") as msgs:
        assert provision(recipe, host=host).reused is True
    assert any("re-shipped loadgen to" in m for m in msgs), msgs
    res = host.run(f"{sys.executable} {pyz} --help", timeout_s=120, stream=False)
    assert res.rc == 0 and "decode" in res.stdout, res.tail()
    assert (include / "planted").exists()  # include/ was current
    assert json.loads(record.read_text()) == {"format": 1, **want}

    # an old include/: swapped for the current one as a whole
    setup = include / "model-setup" / "tiny_llama.py"
    setup.write_text("# an old model-setup script\n")
    record.write_text(json.dumps({**want, "include": "0" * 64}))
    with log_messages("speedmatrix.provision") as msgs:
        assert provision(recipe, host=host).reused is True
    assert any("re-shipped include to" in m for m in msgs), msgs
    assert not (include / "planted").exists()
    assert "old model-setup" not in setup.read_text()
    assert sorted(p.name for p in state.iterdir() if p.name.startswith("include")) == ["include"]

    # no record at all (a host provisioned before records were kept): both shipped
    record.unlink()
    with log_messages("speedmatrix.provision") as msgs:
        assert provision(recipe, host=host).reused is True
    assert any("re-shipped loadgen and include" in m for m in msgs), msgs
    assert json.loads(record.read_text()) == {"format": 1, **want}
    assert list((state / "attempts").iterdir()) == []  # staging cleaned up
    assert len(_installs(home)) == 1  # never reinstalled


def test_a_folder_that_is_not_ours_at_the_env_path_is_refused_and_kept(standin):
    """A user's folder sits where the recipe's env would go (an ``env_name`` naming an existing
    folder): provisioning refuses, naming it and saying what to do, and the folder and its file
    survive (before, it was moved aside and deleted in the background, even when the install
    then failed)."""
    recipe, host, home = standin
    env_dir = Path(host.resolve(recipe.env_dir()))
    env_dir.mkdir(parents=True)
    (env_dir / "thesis.tex").write_text("years of work")
    with pytest.raises(ProvisionError) as exc:
        provision(recipe, host=host, poll_s=0.2, timeout_s=300)
    text = str(exc.value)
    assert str(env_dir) in text and "not made by speedmatrix" in text, text
    assert "env_name" in text  # what to do
    assert (env_dir / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in env_dir.iterdir()) == ["thesis.tex"]
    assert [p.name for p in env_dir.parent.iterdir() if ".old-" in p.name] == []
    assert _installs(home) == []


def test_a_file_that_is_not_ours_at_the_env_path_is_refused_and_kept(standin):
    recipe, host, home = standin
    env_dir = Path(host.resolve(recipe.env_dir()))
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    env_dir.write_text("a user's file")
    with pytest.raises(ProvisionError, match="not made by speedmatrix"):
        provision(recipe, host=host, poll_s=0.2, timeout_s=300)
    assert env_dir.read_text() == "a user's file"
    assert _installs(home) == []


def test_our_own_failed_attempt_is_rebuilt(standin):
    """An install that failed half-way left a half-built env (no marker) with our attempt
    record: the next provisioning may move it away and build again."""
    recipe, host, home = standin
    broken = _with_install(recipe, post_install=("echo about to fail; exit 7",))
    with pytest.raises(ProvisionError, match="exit code 7"):
        provision(broken, host=host, poll_s=0.2, timeout_s=300)
    env_dir = Path(host.resolve(recipe.env_dir()))
    assert env_dir.is_dir() and not (env_dir / MARKER).exists()
    (env_dir / "left-by-the-failed-attempt").write_text("x")
    result = provision(recipe, host=host, poll_s=0.2, timeout_s=300)
    assert result.reused is False
    assert not (env_dir / "left-by-the-failed-attempt").exists()
    assert json.loads((env_dir / MARKER).read_text())["ref"] == "v0.32.0"
    assert len(_installs(home)) == 1
    assert not Path(f"{env_dir}.speedmatrix", ATTEMPT_RECORD).exists()
