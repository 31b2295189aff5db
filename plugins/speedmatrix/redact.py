"""Secret redaction: the one rule for what a secret looks like and how it is hidden.

Why one: patterns kept in several places (the quality suite, the report parser, the recipe
checks) drift apart, e.g. a quoted `--api-key "k"` scrubbed on ingest but passed by the quality
suite, `HF_TOKEN=…` caught by one, `--hf-token` by another. So everything asks this module:
what is redacted is exactly what the runs suite refuses to land (`SECRET_PATTERNS`), so a
launch line that passed through `redact` always validates.

Standard library only (like records.py), so any layer may import it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

REDACTED = "<redacted>"

SECRET_FLAGS = ("--api-key", "--hf-token", "--token")
"""Command-line flags whose value is a credential (vLLM's, Hugging Face's)."""

_WORDS = r"(?:KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)"
# An environment variable name with a secret word at the end of one of its parts: API_KEY,
# HF_TOKEN, HF_TOKEN_PATH, APIKEY; not TOKENIZERS_PARALLELISM. Linear on any input (a plain
# `[A-Za-z0-9_]*WORD(?:_[A-Za-z0-9_]*)?=` backtracks over every part of a long name, 1 MB of
# `KEY_` takes hours): a lookahead finds a secret word ending a part inside the name, then the
# whole name is taken at once (an atomic group gives nothing back), so each name is read twice.
_NAME = rf"(?=[A-Za-z0-9_]*?{_WORDS}(?![A-Za-z0-9]))(?>[A-Za-z0-9_]+)"
# A pattern that starts with a character class lets `re` skip to candidates instead of trying
# the look-behind at every position (whitespace-heavy lines: 0.2 -> 0.01 s per MB).
_WORD_START = r"(?=[A-Za-z0-9_])"
_NAME_RE = re.compile(_NAME, re.IGNORECASE)
# Credentials written in clear, recognisable by their prefix: Hugging Face, OpenAI, GitHub
# (classic and fine-grained), GitLab, PyPI, AWS.
_VALUE = (
    r"(?:hf_[A-Za-z0-9]{8,}|sk-[A-Za-z0-9_-]{8,}|gh[pousr]_[A-Za-z0-9]{8,}"
    r"|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_-]{16,}|pypi-[A-Za-z0-9_-]{16,}"
    r"|AKIA[0-9A-Z]{12,})"
)
_VALUE_RE = re.compile(_VALUE)
_NOT_DONE = rf"(?!{re.escape(REDACTED)})"
_ARG = r"(?:\"[^\"]*\"|'[^']*'|\S+)"  # one shell word, quoted or not

_FLAG = rf"(?<![\w-])(?:{'|'.join(re.escape(f) for f in SECRET_FLAGS)})(?:=|\s+)"
_ENV = rf"{_WORD_START}(?<![\w-]){_NAME}="
_BEARER = r"\bBearer\s+"
_FLAG_RE = re.compile(rf"({_FLAG}){_NOT_DONE}{_ARG}")
_ENV_RE = re.compile(rf"({_ENV}){_NOT_DONE}{_ARG}", re.IGNORECASE)
_BEARER_RE = re.compile(rf"({_BEARER}){_NOT_DONE}\S+", re.IGNORECASE)
_LITERAL_RE = re.compile(rf"(?<![\w-]){_VALUE}")
# A URL's userinfo (`https://user:password@host`, `s3://KEY:SECRET@bucket`, a token as the
# user): all of it, up to the last `@` of the authority. Found from the literal `://` (no
# backtracking over a long scheme-like run), so linear on any input.
_USERINFO_RE = re.compile(rf"(://){_NOT_DONE}[^\s/?#@]+(?:@[^\s/?#@]+)*@")
# A secret query parameter: presigned S3 URLs (X-Amz-Signature, X-Amz-Credential,
# X-Amz-Security-Token), a `token=`, `sig=`, `password=`, `api_key=`… Also after `&amp;` (a
# URL as HTML writes it). The value ends where the parameter does.
_PARAM_WORDS = r"(?:signature|credential|token|secret|password|passwd|api[_-]?key|key|sig)"
_PARAM = rf"(?:[?&;]|&amp;)(?:[\w.-]*[_.-])?{_PARAM_WORDS}="
_PARAM_RE = re.compile(rf"({_PARAM}){_NOT_DONE}[^&#\s\"'<>]+", re.IGNORECASE)

# Without capture groups (pandas warns on groups in str.contains); the same pieces as above.
SECRET_PATTERNS: tuple[str, ...] = (
    rf"{_FLAG}{_NOT_DONE}\S",
    rf"(?i){_ENV}{_NOT_DONE}\S",
    rf"(?i){_BEARER}{_NOT_DONE}\S",
    _LITERAL_RE.pattern,
    rf"://{_NOT_DONE}[^\s/?#@]+@",
    rf"(?i){_PARAM}{_NOT_DONE}[^&#\s\"'<>]",
)
"""What a text must not match once redacted (the runs suite's regex list for launch_command)."""


def is_secret_name(name: str) -> bool:
    """Does this environment variable name hold a secret (HF_TOKEN, VLLM_API_KEY…)?"""
    return _NAME_RE.fullmatch(name) is not None


def looks_like_secret(value: str) -> bool:
    """Does this value look like a credential written in clear (hf_…, sk-…, ghp_…, AKIA…)?"""
    return _VALUE_RE.match(value) is not None


def redact(text: str | None, secrets: Iterable[str] = ()) -> str | None:
    """`text` with known secret values and credential-looking values replaced by `<redacted>`:
    the value of a secret flag (`--api-key k`, `--api-key="k"`), of a secret variable
    (`HF_TOKEN=…`), a bearer token, a URL's userinfo (`https://user:pass@…` ->
    `https://<redacted>@…`), a secret query parameter (`X-Amz-Signature=…`, `token=…`), and any
    clear credential (`hf_…`, `github_pat_…`, `glpat-…`, `pypi-…`). None stays None."""
    if text is None:
        return None
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    text = _FLAG_RE.sub(rf"\g<1>{REDACTED}", text)
    text = _ENV_RE.sub(rf"\g<1>{REDACTED}", text)
    text = _BEARER_RE.sub(rf"\g<1>{REDACTED}", text)
    text = _USERINFO_RE.sub(rf"\g<1>{REDACTED}@", text)
    text = _PARAM_RE.sub(rf"\g<1>{REDACTED}", text)
    return _LITERAL_RE.sub(REDACTED, text)


def redact_record(record: logging.LogRecord) -> None:
    """A log record of ours, message and traceback, through :func:`redact` (in place). The
    package installs the factory that calls it (speedmatrix/__init__.py) for every record of a
    ``speedmatrix.*`` logger, whatever handler later writes it: a logged URL or exception never
    shows a credential."""
    try:
        record.msg, record.args = redact(record.getMessage()), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
    except Exception:  # a bad format string is the handler's to report, as without us
        pass
