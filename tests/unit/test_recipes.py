"""Recipe loading, validation errors, rendering and quoting."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_inprocess import run_cli

from speedmatrix import recipes
from speedmatrix.plan import KvCapacity, MatrixSpec, plan_matrix
from speedmatrix.recipes import RecipeError, load_recipe
from speedmatrix.refs import classify_ref, ref_slug

PUBLISHED = {
    "nvidia-rtxpro6k/moonshotai/kimi-k2.7-code-nvfp4": 'env VLLM_USE_V2_MODEL_RUNNER=1 "$HOME/env_rtxpro6k-nvidia-vllm-pr-9fedd24fa864/bin/vllm" serve nvidia/Kimi-K2.7-Code-NVFP4 --served-model-name Kimi-K2.7-Code-NVFP4 --trust-remote-code --tensor-parallel-size 8 --reasoning-parser kimi_k2 --enable-auto-tool-choice --tool-call-parser kimi_k2 --max-model-len 262144 --gpu-memory-utilization 0.90 --host 0.0.0.0 --port 8000 --api-key <redacted> --attention-backend TRITON_MLA --moe-backend flashinfer_cutlass',
    "nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash": """env FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 VLLM_ENGINE_READY_TIMEOUT_S=3600 "$HOME/env_h200-glm53-vllm-v0290/bin/vllm" serve moonshotai/Kimi-K2.7-Code --served-model-name nvidia/Kimi-K2.7-Code-DFlash --trust-remote-code --tensor-parallel-size 8 --reasoning-parser kimi_k2 --enable-auto-tool-choice --tool-call-parser kimi_k2 --max-model-len 262144 --gpu-memory-utilization 0.81 --host 0.0.0.0 --port 8000 --api-key <redacted> --enforce-eager --max-num-batched-tokens 16384 --speculative-config '{"method":"dflash","model":"nvidia/Kimi-K2.7-Code-DFlash","num_speculative_tokens":8}'""",
    "nvidia-rtxpro6k/deepseek-ai/deepseek-v4.1-flash-1017": """env VLLM_ENGINE_READY_TIMEOUT_S=3600 VLLM_B12X_MOE_FP4_FORCE_A16=1 "$HOME/env_rtxpro6k-deepseek-v41-1017-vllm-pr-60762/bin/vllm" serve deepseek-ai/DeepSeek-V4.1-Flash-1017 --served-model-name deepseek --tensor-parallel-size 4 --reasoning-parser deepseek_v41 --enable-auto-tool-choice --tool-call-parser deepseek_v41 --max-model-len 524288 --gpu-memory-utilization 0.950000 --host 0.0.0.0 --port 8000 --api-key <redacted> --tokenizer-mode deepseek_v41 --mm-encoder-tp-mode data --kv-cache-dtype fp8 --engram-config '{"cpu_offload":true}' --attention-backend FLASHINFER_MLA_SPARSE_DSV41 --linear-backend flashinfer_cutlass --moe-backend b12x --speculative-config '{"method":"dspark","num_speculative_tokens":7}' --enable-prefix-caching""",
}

CPU = "cpu/tiny/llama-tiny"


def run_process(*args: str) -> subprocess.CompletedProcess[str]:
    """`speedmatrix *args` as a process: the `recipes` command's one test through its entry
    point; the others call it in this process (tests/cli_inprocess.py)."""
    return subprocess.run(
        [sys.executable, "-m", "speedmatrix", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("recipe_id", sorted(PUBLISHED))
def test_published_launch_commands_match_character_for_character(recipe_id: str) -> None:
    assert load_recipe(recipe_id).render_launch_command() == PUBLISHED[recipe_id]


def test_render_cli_prints_only_the_command() -> None:
    rid = "nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash"
    out = run_cli("recipes", "render", rid)
    assert out.returncode == 0, out.stderr
    assert out.stdout == PUBLISHED[rid] + "\n"


def test_shipped_recipes_validate() -> None:
    good, problems = recipes.validate_paths([recipes.recipes_dir()])
    assert problems == []
    ids = {r.id for r in good}
    assert set(PUBLISHED) | {CPU} <= ids
    assert any(i.startswith("sim/") for i in ids)


def test_published_matrices() -> None:
    k = load_recipe("nvidia-rtxpro6k/moonshotai/kimi-k2.7-code-nvfp4").matrix
    assert k.contexts == tuple(x * 1024 for x in (8, 16, 32, 64, 128, 251))
    assert k.prefill_contexts[-2:] == (251 * 1024, 262144)
    assert k.concurrencies == (1, 2, 4, 8, 16, 32, 64, 128)
    d = load_recipe("nvidia-rtxpro6k/deepseek-ai/deepseek-v4.1-flash-1017")
    # the largest decode context that fits: max-model-len - max output - 1024
    assert d.matrix.contexts[-1] == d.model.max_model_len - d.matrix.max_output_tokens - 1024
    assert d.matrix.window_s == 30 and d.matrix.max_output_tokens == 4096


def test_env_dir_naming_and_other_refs() -> None:
    h200 = load_recipe("nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash")
    assert h200.env_dir() == "$HOME/env_h200-glm53-vllm-v0290"
    # a fixed env name belongs to the default ref: another ref must not reuse that env
    assert h200.env_dir("v0.30.0") == "$HOME/env_h200-kimi-k27-int4-vllm-v0300"
    ds = load_recipe("nvidia-rtxpro6k/deepseek-ai/deepseek-v4.1-flash-1017")
    assert ds.env_name("pr/61000") == "env_rtxpro6k-deepseek-v41-1017-vllm-pr-61000"
    assert ds.env_name("a" * 40) == "env_rtxpro6k-deepseek-v41-1017-vllm-" + "a" * 12
    assert "--api-key" not in ds.launch_argv()
    assert (
        ds.launch_argv(api_key="s3cret")[ds.launch_argv(api_key="s3cret").index("--api-key") + 1]
        == "s3cret"
    )


@pytest.mark.parametrize(
    ("ref", "kind", "slug"),
    [
        ("v0.29.0", "release", "v0290"),
        ("v0.33.0rc1", "release", "v0330rc1"),
        ("9fedd24fa864", "commit", "9fedd24fa864"),
        ("0123456789abcdef0123456789abcdef01234567", "commit", "0123456789ab"),
        ("pr/60762", "pr", "pr-60762"),
        ("main", "main", "main"),
    ],
)
def test_refs(ref: str, kind: str, slug: str) -> None:
    assert classify_ref(ref)[0] == kind
    assert ref_slug(ref) == slug


@pytest.mark.parametrize("bad", ["", "latest", "pr/", "pr/x", "v1", "XYZ123", "main; rm -rf ~"])
def test_bad_refs_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        classify_ref(bad)


def _write(tmp_path: Path, data: dict, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def _cpu_data() -> dict:
    return yaml.safe_load((recipes.recipes_dir() / f"{CPU}.yaml").read_text())


def test_every_problem_reported_at_once(tmp_path: Path) -> None:
    data = _cpu_data()
    data["hardware"]["gpu_count"] = "eight"  # wrong type
    data["engine"]["colour"] = "blue"  # unknown key
    data["matrix"]["prompt_mode"] = "random"  # not in the enum
    del data["model"]["served_name"]  # missing
    path = _write(tmp_path, data)
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    problems = exc.value.problems
    assert len(problems) == 4, problems
    joined = "\n".join(problems)
    assert f"{path}: hardware.gpu_count:" in joined
    assert f"{path}: engine.colour: unknown key" in joined
    assert f"{path}: matrix.prompt_mode:" in joined
    assert f"{path}: model.served_name: Field required" in joined


def test_semantic_problems(tmp_path: Path) -> None:
    data = _cpu_data()
    # 3000 + 64 > 2048, and sent as 1984 it would no longer be 3K (2000 would go out as 1984,
    # still 2K: the plan fits it, see test_plan)
    data["matrix"]["contexts"] = [256, 3000]
    data["matrix"]["concurrencies"] = [1, 1, 0]
    data["serve"]["args"] += ["--hf-token", "hf_abcdefghijklmnop"]
    data["serve"]["env"]["HF_TOKEN"] = "hf_abcdefghijklmnop"
    path = _write(tmp_path, data)
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    joined = "\n".join(exc.value.problems)
    assert (
        "matrix.contexts[1]: context 3000 + max output 64 = 3064 exceeds max_model_len 2048"
        in joined
    )
    assert "matrix.concurrencies[2]: 0 is not a positive number of requests" in joined
    assert "matrix.concurrencies: repeated values" in joined
    assert "--hf-token written in clear" in joined
    assert "serve.env.HF_TOKEN: a secret written in clear" in joined


def test_empty_matrix_and_clear_api_key(tmp_path: Path) -> None:
    data = _cpu_data()
    data["matrix"]["contexts"] = []
    data["matrix"]["prefill_contexts"] = []
    i = data["serve"]["args"].index("{api_key}")
    data["serve"]["args"][i] = "my-secret-key"
    with pytest.raises(RecipeError) as exc:
        load_recipe(_write(tmp_path, data))
    joined = "\n".join(exc.value.problems)
    assert "matrix: empty matrix" in joined
    assert "--api-key written in clear" in joined
    assert "my-secret-key" not in joined  # the error itself never echoes the secret


def test_validate_cli_lists_problems_and_exits_non_zero(tmp_path: Path) -> None:
    data = _cpu_data()
    data["matrix"]["window_s"] = -1
    data["bogus"] = 1
    bad = _write(tmp_path, data, "bad.yaml")
    (tmp_path / "broken.yaml").write_text("hardware: [unclosed\n")
    out = run_cli("recipes", "validate", str(tmp_path))
    assert out.returncode == 1
    assert f"{bad}: matrix.window_s:" in out.stderr
    assert f"{bad}: bogus: unknown key" in out.stderr
    assert "broken.yaml: (yaml):" in out.stderr
    assert out.stdout == ""


def test_unknown_recipe_is_a_one_line_error() -> None:
    out = run_cli("recipes", "render", "no/such/recipe")
    assert out.returncode == 2
    assert "no/such/recipe: no such recipe" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_shell_metacharacters_stay_one_argument(tmp_path: Path) -> None:
    data = _cpu_data()
    nasty = "x; rm -rf ~ $(touch pwned) `id` \"q\" 'q' \\"
    data["model"]["served_name"] = nasty
    data["serve"]["env"]["ODD"] = "a b;c"
    data["engine"]["env_name"] = "env_{hw}-$(x)-{ref}"
    r = load_recipe(_write(tmp_path, data))
    line = r.render_launch_command(api_key="omit")
    # the shell sees exactly the argv we meant: nasty is one argument, nothing is executed
    words = shlex.split(line)
    assert nasty in words
    assert "ODD=a b;c" in words
    out = subprocess.run(
        ["bash", "-c", 'printf "%s\\n" ' + line.removeprefix("env ")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"HOME": "/home/u", "PATH": "/usr/bin:/bin"},
        check=True,
    )
    args = out.stdout.splitlines()
    assert nasty in args
    assert "/home/u/env_cpu-$(x)-v0320/bin/python" in args  # $HOME expanded, nothing else
    assert not (tmp_path / "pwned").exists()


def test_recipe_id_and_path_both_accepted() -> None:
    by_id = load_recipe(CPU)
    by_path = load_recipe(recipes.recipes_dir() / f"{CPU}.yaml")
    assert by_id == by_path
    assert by_id.id == CPU


def test_ref_placeholder_is_the_engine_ref_being_served(tmp_path: Path) -> None:
    """A simulator recipe picks its profile per commit with {ref} (how a bisection test plants
    a regression at one commit); without a run's ref it is the recipe's own engine.ref."""
    data = yaml.safe_load(
        (recipes.recipes_dir() / "sim/kimi-k2.7-nvfp4-rtxpro6k-x8.yaml").read_text()
    )
    data["serve"]["command"][-1] = "/profiles/{ref}.yaml"
    r = load_recipe(_write(tmp_path, data))
    commit = "ab" * 20
    argv = r.launch_argv(commit, python="py", include="inc")
    assert argv[argv.index("--profile") + 1] == f"/profiles/{commit}.yaml"
    assert f"/profiles/{data['engine']['ref']}.yaml" in r.render_launch_command()
    assert "/profiles/pr/61000.yaml" in r.render_launch_command("pr/61000")


def _sim_recipes() -> list[recipes.Recipe]:
    return [load_recipe(i) for i in recipes.list_recipe_ids() if i.startswith("sim/")]


def test_every_sim_recipe_profile_loads_and_matches_the_recipe() -> None:
    from speedmatrix.sim.profile import load_profile

    sims = _sim_recipes()
    assert len(sims) >= 3
    for r in sims:
        assert r.engine.install.kind == "sim" and r.sim_profile, r.id
        p = load_profile(recipes.REPO_ROOT / r.sim_profile)
        # the served command points at the same profile the recipe names
        assert any(t.endswith(r.sim_profile.removeprefix("include/")) for t in r.serve.command)
        assert p.served_model_name == r.model.served_name, r.id
        assert p.model == r.model.id and p.version == r.engine.version, r.id
        # the real server's max_model_len, not one that hides vLLM's refusal of a prompt of
        # max_model_len tokens; the plan makes every cell fit it (prompt + max_tokens <= it)
        assert p.max_model_len == r.model.max_model_len, r.id
        m = r.matrix
        spec = MatrixSpec.build(
            prefill_contexts=m.prefill_contexts,
            contexts=m.contexts,
            concurrencies=m.concurrencies,
            max_output_tokens=m.max_output_tokens,
            window_s=m.window_s,
        )
        plan = plan_matrix(spec, KvCapacity(10**6, 16), max_model_len=p.max_model_len)
        cells = [*plan.prefill, *plan.decode]
        assert len(plan.prefill) == len(m.prefill_contexts), r.id
        assert all(c["context_tokens"] + c["max_output_tokens"] <= p.max_model_len for c in cells)


def test_one_sim_recipe_per_published_recipe() -> None:
    published = [
        load_recipe(i)
        for i in recipes.list_recipe_ids()
        if not i.startswith(("sim/", "cpu/")) and load_recipe(i).engine.install.kind != "sim"
    ]
    assert {r.id for r in published} == set(PUBLISHED)
    sims = _sim_recipes()
    for pub in published:
        twins = [
            s
            for s in sims
            if s.model.id == pub.model.id
            and s.engine.version == pub.engine.version
            and s.matrix == pub.matrix
        ]
        assert len(twins) == 1, f"{pub.id}: {len(twins)} sim recipes with its model/version/matrix"
        s = twins[0]
        assert s.engine.ref == pub.engine.ref
        assert (s.model.served_name, s.model.quantization, s.model.max_model_len) == (
            pub.model.served_name,
            pub.model.quantization,
            pub.model.max_model_len,
        )
        hw, sim_hw = pub.hardware.model_dump(), s.hardware.model_dump()
        assert sim_hw.pop("slug") == "sim-" + hw.pop("slug")
        assert sim_hw == hw, s.id
        assert s.schedule.host == "local"


def test_uncalibrated_profiles_say_so() -> None:
    from speedmatrix.sim.profile import PROFILE_DIR, load_profile

    calibrated = []
    for path in sorted(PROFILE_DIR.glob("*.yaml")):
        p = load_profile(path)
        text = path.read_text()
        if p.calibrated:
            assert p.source, path  # calibrated means fitted to a named report
            calibrated.append(path.name)
            continue
        assert "calibrated: false" in text, path
        assert "NOT CALIBRATED" in text.splitlines()[0].upper(), path
        assert "NOT calibrated" in p.description or "NOT CALIBRATED" in p.description, path
    assert calibrated == ["kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"]
    # the sim recipes of configurations without a published report are not scheduled
    for r in _sim_recipes():
        if not load_profile(recipes.REPO_ROOT / r.sim_profile).calibrated:
            assert not r.schedule.nightly and not r.schedule.per_commit, r.id


def test_the_workload_is_declared_article_by_default(tmp_path: Path) -> None:
    """matrix.workload: article (default: the published pages' workload) or continuation; the
    cpu recipe serves the chat template the article is rendered with, from include/."""
    cpu = load_recipe(CPU)
    assert cpu.matrix.workload == "article"
    command = cpu.render_launch_command(include="/srv/include")
    assert "--chat-template /srv/include/chat-templates/tiny-llama.jinja" in command
    assert (recipes.REPO_ROOT / "include" / "chat-templates" / "tiny-llama.jinja").is_file()
    # provisioning ships it with include/, so {include} resolves on the host
    import io
    import tarfile

    from speedmatrix.engine.provision.shipping import include_tarball

    with tarfile.open(fileobj=io.BytesIO(include_tarball())) as tar:
        assert "chat-templates/tiny-llama.jinja" in tar.getnames()
    data = _cpu_data()
    del data["matrix"]["workload"]
    assert load_recipe(_write(tmp_path, data)).matrix.workload == "article"
    data["matrix"]["workload"] = "continuation"
    assert load_recipe(_write(tmp_path, data, "c.yaml")).matrix.workload == "continuation"
    data["matrix"]["workload"] = "poetry"
    with pytest.raises(RecipeError, match=r"matrix\.workload"):
        load_recipe(_write(tmp_path, data, "p.yaml"))


def test_infinite_or_absurd_numbers_in_a_recipe_are_problems(tmp_path: Path) -> None:
    """Issue #33 item 2, the recipe's side: numbers are finite and in range (records'
    MAX_QUANTITY, the bound a page's numbers have), each problem naming its field."""
    data = _cpu_data()
    data["hardware"]["vram_gb"] = float("inf")
    data["hardware"]["gpu_count"] = 10**400
    data["model"]["max_model_len"] = 10**30
    path = _write(tmp_path, data)
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    joined = "\n".join(exc.value.problems)
    for field in ("hardware.vram_gb", "hardware.gpu_count", "model.max_model_len"):
        assert f"{path}: {field}:" in joined, joined


def test_a_deeply_nested_recipe_is_one_problem_not_a_traceback(tmp_path: Path) -> None:
    """Issue #33 item 14: a 100,000-deep nested list gave a RecursionError traceback."""
    path = tmp_path / "deep.yaml"
    path.write_text("matrix:\n  contexts: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    assert exc.value.problems == [f"{path}: (yaml): nested too deeply to be a recipe"]
    out = run_process("recipes", "validate", str(path))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "nested too deeply" in out.stdout + out.stderr
