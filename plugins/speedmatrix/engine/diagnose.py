"""Turn an engine log into a one-line diagnosis from known failure signatures.

Why: a vLLM server that fails to start leaves hundreds of log lines, and the real cause is
usually one well-known line in the middle (a ValueError from the engine core, argparse's
complaint, a CUDA OOM). The run's error field and the task log should say that cause in one
line; the log's tail still comes along for the rest.

Signatures are ordered from specific to generic: "engine initialisation failed" is vLLM's
wrapper around most start-up errors, so it only wins when nothing more precise matched.

Fatal or not: while a server starts, :func:`speedmatrix.engine.vllm_server.wait_ready` stops waiting at
once on a line that is fatal by itself (``fatal_only=True``): the engine has failed and will
not come up. Fatal in vLLM's own terms: only a line vLLM's logger wrote at ERROR or CRITICAL
level counts on sight (its format, vllm/logger.py: ``[prefix](<process> pid=<pid>) LEVEL
MM-DD HH:MM:SS [file.py:line] message``; older releases ``LEVEL MM-DD HH:MM:SS file.py:line]
message``). vLLM logs ``undefined symbol`` at WARNING when an optional compiled kernel does
not import and then serves: a start must not be stopped for words vLLM itself did not call an
error. Text outside vLLM's format (a raw traceback, argparse's complaint) is printed as the
process dies, so the dead process ends the wait, and that text is then its diagnosis. A line
vLLM logged below ERROR is never a cause of failure, on sight or after.

A hang is not fatal on sight either: "NCCL hang" is the diagnosis of a server that did not get
ready in time, given when the ready timeout hits (a slow collective that logs a timeout
warning may still finish, and a healthy start must not be stopped by it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Signature:
    code: str  # stable short name, e.g. for tests and the run record
    pattern: re.Pattern[str]
    message: str  # may use {0}, {1}… for the pattern's groups
    fatal: bool = True  # the line alone means the start failed (ends wait_ready at once)


def _sig(code: str, pattern: str, message: str, *, fatal: bool = True) -> Signature:
    return Signature(code, re.compile(pattern, re.IGNORECASE | re.MULTILINE), message, fatal)


SIGNATURES: tuple[Signature, ...] = (
    _sig(
        "unknown_argument",
        r"error: (unrecognized arguments?: .*|argument [^\n]*|unknown argument[^\n]*)$",
        "unknown argument: the engine rejected its command line ({0})",
    ),
    _sig(
        "address_in_use",
        r"(address already in use|\[Errno 98\])",
        "address already in use: another process holds the server's port",
    ),
    _sig(
        "kv_cache_too_small",
        r"(To serve at least one request with the model'?s max seq len \((\d+)\)[^\n]*?"
        r"estimated maximum model length is (\d+)|larger than the maximum number of tokens that "
        r"can be stored in KV cache[^\n]*)",
        "KV cache too small for max-model-len: {0}",
    ),
    _sig(
        "gpu_memory_below_utilization",
        r"(Free memory on device[^\n]*less than desired GPU memory utilization[^\n]*)",
        "GPU memory below the requested utilisation: {0}",
    ),
    _sig(
        "cuda_oom",
        r"(CUDA out of memory[^\n]*|torch\.OutOfMemoryError[^\n]*)",
        "CUDA out of memory: {0}",
    ),
    # Not fatal on sight (see the module docstring). Only lines that say a collective did time
    # out: torch logs "ProcessGroupNCCL initialization options: ... TIMEOUT(ms): 600000" on
    # every healthy multi-GPU start, and env dumps show NCCL_TIMEOUT=...; neither is a hang.
    _sig(
        "nccl_hang",
        r"(Watchdog caught collective operation timeout[^\n]*|NCCL[^\n]*\btimed out\b[^\n]*)",
        "NCCL hang: a collective operation timed out ({0})",
        fatal=False,
    ),
    _sig(
        "undefined_symbol",
        r"undefined symbol: (\S+)",
        "undefined symbol {0}: the engine's compiled code does not match its torch/CUDA build",
    ),
    _sig(
        "engine_init_failed",
        r"(Engine core initialization failed[^\n]*|Engine process failed to start[^\n]*)",
        "engine initialisation failed: {0}",
    ),
)


@dataclass(frozen=True)
class Diagnosis:
    code: str  # a Signature.code, or "unknown"
    message: str

    def __str__(self) -> str:
        return self.message


def _clip(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# The level of a line vLLM's logger wrote (see the module docstring): the first "LEVEL MM-DD
# HH:MM:SS [file:line]" (or "file:line]") on the line, after any prefix.
_VLLM_LEVEL = re.compile(
    r"(?:^|[\s)])(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? "
    r"\[?[^\s\]]+:\d+\] "
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # vLLM's ColoredFormatter (VLLM_LOGGING_COLOR=1)


def _vllm_level(line: str) -> str | None:
    """The level of a line in vLLM's log format; None for any other line."""
    m = _VLLM_LEVEL.search(line)
    return m.group(1) if m else None


def _lines_that_may_say_why(log_text: str, fatal_only: bool) -> str:
    """The lines a failure signature may be read from: vLLM's ERROR/CRITICAL lines on sight
    (``fatal_only``); after the fact, every line but those vLLM logged below ERROR."""
    keep = []
    for line in _ANSI.sub("", log_text).splitlines():
        level = _vllm_level(line)
        if level in ("ERROR", "CRITICAL") or (level is None and not fatal_only):
            keep.append(line)
    return "\n".join(keep)


def diagnose(log_text: str, *, fatal_only: bool = False) -> Diagnosis:
    """The first known signature found in the log, as one line; ``unknown`` when none.

    ``fatal_only=True`` looks only for lines that are fatal by themselves: what a start that is
    still under way may be stopped for (vLLM's ERROR/CRITICAL lines; a hang is diagnosed at the
    timeout, not before). Fatal signatures are never read from a line vLLM logged below ERROR.
    """
    errors = _lines_that_may_say_why(log_text, fatal_only)
    for sig in SIGNATURES:
        if fatal_only and not sig.fatal:
            continue
        # A hang is read from any line (torch and NCCL print their own formats, some at
        # warning level); only failure signatures need vLLM's error level.
        m = sig.pattern.search(errors if sig.fatal else log_text)
        if m:
            groups = [_clip(g or "") for g in m.groups()] or [_clip(m.group(0))]
            return Diagnosis(sig.code, sig.message.format(*groups))
    return Diagnosis("unknown", "the server failed without a known signature: see the log tail")
