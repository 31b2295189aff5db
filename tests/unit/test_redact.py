"""Secret redaction: one rule (speedmatrix.redact) for the quality suite, the report parser
and the recipe checks. The cases of the three sets that used to exist, and where they disagreed."""

from __future__ import annotations

import re
import time

import pytest

from speedmatrix.redact import (
    REDACTED,
    SECRET_FLAGS,
    SECRET_PATTERNS,
    is_secret_name,
    looks_like_secret,
    redact,
)

SECRET = "sk-test-Zx81qq"


def _leaks(text: str) -> bool:
    return any(re.search(p, text) for p in SECRET_PATTERNS)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        # the quality suite's set
        (f"x --api-key {SECRET} y", "x --api-key <redacted> y"),
        ("x --api-key=zz y", "x --api-key=<redacted> y"),
        ("A_TOKEN=q VLLM_API_KEY=<redacted>", "A_TOKEN=<redacted> VLLM_API_KEY=<redacted>"),
        ("db_password=hunter2 x", "db_password=<redacted> x"),
        ("MY_SECRET=s", "MY_SECRET=<redacted>"),
        ("Authorization: Bearer abc.def", "Authorization: Bearer <redacted>"),
        # the report parser's set: quoted values, the env names a launch line carries
        ('serve m --api-key "two words" --port 1', "serve m --api-key <redacted> --port 1"),
        ("serve m --api-key 'k k' --port 1", "serve m --api-key <redacted> --port 1"),
        ("env VLLM_API_KEY=k HF_TOKEN=hf_x OPENAI_API_KEY=o vllm", None),
        ("vllm serve m --api-key <redacted>", "vllm serve m --api-key <redacted>"),
        # the recipe checks' set: more flags and names, credentials by their prefix
        ("vllm serve m --hf-token abc", "vllm serve m --hf-token <redacted>"),
        ("vllm serve m --token=abc", "vllm serve m --token=<redacted>"),
        ("HF_CREDENTIALS=x APIKEY=y", "HF_CREDENTIALS=<redacted> APIKEY=<redacted>"),
        ("--note hf_abcdefgh12 ghp_abcdefgh12", f"--note {REDACTED} {REDACTED}"),
        ("AKIAABCDEFGHIJKL in a log", f"{REDACTED} in a log"),
    ],
)
def test_redact_hides_every_kind_of_secret(text, want):
    out = redact(text)
    if want is not None:
        assert out == want
    assert not _leaks(out), out
    assert redact(out) == out  # idempotent: a redacted line stays as it is


def test_env_assignments_are_all_redacted():
    out = redact("env VLLM_API_KEY=k HF_TOKEN=hf_x OPENAI_API_KEY=o vllm")
    assert out == "env VLLM_API_KEY=<redacted> HF_TOKEN=<redacted> OPENAI_API_KEY=<redacted> vllm"


@pytest.mark.parametrize(
    "text",
    [
        "vllm serve m --max-num-batched-tokens 16384 --tokenizer-mode deepseek_v41",
        "env TOKENIZERS_PARALLELISM=false VLLM_ENGINE_READY_TIMEOUT_S=3600 vllm serve",
        "--attention-backend TRITON_MLA --kv-cache-dtype fp8 --task-type x",
        '--speculative-config \'{"method":"dflash","num_speculative_tokens":8}\'',
        "the disk-offload-enabled flag",
    ],
)
def test_ordinary_launch_words_are_left_alone(text):
    assert redact(text) == text
    assert not _leaks(text)


def test_known_secret_values_are_replaced_wherever_they_appear():
    assert redact(f"--note {SECRET}x", [SECRET, ""]) == f"--note {REDACTED}x"
    assert redact(None) is None


def test_secret_names_and_values():
    for name in ("HF_TOKEN", "VLLM_API_KEY", "APIKEY", "DB_PASSWD", "HF_TOKEN_PATH", "x_secret"):
        assert is_secret_name(name), name
    for name in ("TOKENIZERS_PARALLELISM", "VLLM_USE_V2_MODEL_RUNNER", "CUDA_VISIBLE_DEVICES"):
        assert not is_secret_name(name), name
    for value in ("hf_abcdefgh", "sk-abcdefgh", "ghp_abcdefgh", "AKIAABCDEFGHIJKL"):
        assert looks_like_secret(value), value
    for value in ("hf_short", "$HF_TOKEN", "{api_key}", "moonshotai/Kimi-K2.7-Code"):
        assert not looks_like_secret(value), value
    assert "--api-key" in SECRET_FLAGS and "--hf-token" in SECRET_FLAGS


@pytest.mark.parametrize(
    "hostile",
    [
        "KEY_" * 250_000,  # 1 MB: a backtracking name pattern is quadratic here
        "KEY_" * 250_000 + "X=v",
        "a" * 1_000_000,
        "--api-key" + " " * 1_000_000,
        "Bearer" + "\t" * 1_000_000,
        "TOKEN" * 200_000 + "=",
    ],
)
@pytest.mark.timing
def test_redaction_is_linear_in_its_input(hostile):
    """A launch line is page or recipe input: 1 MB of it is redacted and checked in well under a
    second of this process's CPU (a quadratic pattern took 137 s on a 72 KB line, so the bound
    is two orders of magnitude from either side). CPU time, not the wall clock: a neighbour
    on the machine slows the wall clock, not the work this process does."""
    start = time.process_time()
    out = redact(hostile)
    assert time.process_time() - start < 1.0  # linear: ~0.1-0.3 s per MB here
    start = time.process_time()
    _leaks(out)
    is_secret_name(hostile)
    assert time.process_time() - start < 1.0


def test_a_long_secret_name_is_still_redacted():
    name = "KEY_" * 10_000 + "X"
    assert redact(f"{name}=v rest") == f"{name}=<redacted> rest"
    assert is_secret_name(name)
    assert not is_secret_name("X_" * 10_000 + "TOKENIZERS")
