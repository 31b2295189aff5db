"""The launch command: the API key's `--flag={api_key}` form and serve.env references to the
host's environment (issue #16 items 5 and 6)."""

from __future__ import annotations

import subprocess

from speedmatrix.recipes import load_recipe_id

CPU = "cpu/tiny/llama-tiny"


def with_serve(**update):
    r = load_recipe_id(CPU)
    return r.model_copy(update={"serve": r.serve.model_copy(update=update)})


def argv_of(line: str, env: dict[str, str] | None = None) -> list[str]:
    """What bash makes of a rendered line: each argument on its own NUL-terminated field."""
    out = subprocess.run(
        ["bash", "-c", f"set -- {line}; printf '%s\\0' \"$@\""],
        capture_output=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
    ).stdout
    return out.decode().split("\0")[:-1]


ARGS = ("--served-model-name", "{served_name}", "--port", "{port}", "--api-key={api_key}")


def test_api_key_equals_form_is_one_argument_and_swallows_nothing():
    r = with_serve(args=ARGS)
    assert r.has_api_key and list(r.problems()) == []
    # without the key (it goes through VLLM_API_KEY): --port 8000 stays
    assert r.launch_argv()[-4:] == ["--served-model-name", "tiny-llama", "--port", "8000"]
    assert r.launch_argv(api_key="k 1")[-3:] == ["--port", "8000", "--api-key=k 1"]
    shown = r.render_launch_command(api_key="redact")
    assert shown.endswith("--served-model-name tiny-llama --port 8000 --api-key=<redacted>")
    assert r.render_launch_command(api_key="omit").endswith("--port 8000")
    # a launcher's expression (the simulator's way): the host's shell splices the key in
    line = r.render_launch_command(api_key='"$SPEEDMATRIX_API_KEY"')
    assert argv_of(line, {"SPEEDMATRIX_API_KEY": "s3 'cr$t"})[-3:] == [
        "--port",
        "8000",
        "--api-key=s3 'cr$t",
    ]


def test_api_key_pair_form_unchanged():
    r = with_serve(args=("--port", "{port}", "--api-key", "{api_key}"))
    assert r.launch_argv()[-2:] == ["--port", "8000"]
    assert r.launch_argv(api_key="k")[-2:] == ["--api-key", "k"]
    assert r.render_launch_command().endswith("--port 8000 --api-key <redacted>")


def test_env_reference_is_expanded_by_the_host_shell_and_never_rendered():
    r = with_serve(env={"HF_TOKEN": "$SM_HOST_TOKEN", "B": "${SM_OTHER}", "LIT": "a$b c"})
    assert list(r.problems()) == []
    line = r.render_launch_command(api_key="omit")
    assert "hf_" not in line and "SM_HOST_TOKEN" in line
    argv = argv_of(line, {"SM_HOST_TOKEN": "hf_value 'x", "SM_OTHER": "o"})
    assert argv[:4] == ["env", "HF_TOKEN=hf_value 'x", "B=o", "LIT=a$b c"]
    # unset on the host: the launch stops with a reason instead of passing an empty token
    res = subprocess.run(["bash", "-c", f"set -- {line}"], capture_output=True, text=True)
    assert res.returncode != 0 and "SM_HOST_TOKEN: not set on the host" in res.stderr


def test_only_whole_value_references_and_the_validator_says_so():
    r = with_serve(env={"HF_TOKEN": "$HF_TOKEN-x"})
    assert any("whole value" in why for _f, why in r.problems())
    r = with_serve(env={"HF_TOKEN": "hf_abcdefghijkl"})
    assert any("$NAME" in why for _f, why in r.problems())
    r = with_serve(env={"BAD NAME": "1"})
    assert any("not an environment variable name" in why for _f, why in r.problems())
