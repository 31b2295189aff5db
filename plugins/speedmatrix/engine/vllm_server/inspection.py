"""What a ready server is: version and commit, KV capacity, block size, max-model-len, hardware.

One job: inspection, for the run's record. KV capacity is read two ways (``/metrics``'
``vllm:cache_config_info`` and the start-up log line) and both are reported, so they can be
cross-checked; the hardware facts come from nvidia-smi on GPU hosts, /proc else.
"""

from __future__ import annotations

import re
import shlex

from speedmatrix.engine.hosts import Host
from speedmatrix.engine.vllm_server.contract import ServerHandle
from speedmatrix.engine.vllm_server.ready import read_log, run_probe

_KV_LOG = re.compile(r"KV cache size: ([\d,]+) tokens")


_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(.*)\}\s", re.M)


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


_METRICS_PY = r"""
import os, sys, urllib.request
req = urllib.request.Request(sys.argv[1] + "/metrics")
key = os.environ.get("SPEEDMATRIX_PROBE_KEY")
if key:
    req.add_header("Authorization", "Bearer " + key)
print(urllib.request.urlopen(req, timeout=30).read().decode("utf-8", "replace"))
"""


_HW_CPU = (
    "echo cpu_model=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'); "
    "echo cpu_count=$(nproc); "
    "echo mem_total_kb=$(grep -m1 MemTotal /proc/meminfo | awk '{print $2}')"
)


_HW_GPU = "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"


def parse_cache_config(metrics_text: str) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` (empty when the metric is absent)."""
    m = _CACHE_INFO.search(metrics_text)
    return dict(_LABEL.findall(m.group(1))) if m else {}


def kv_tokens_from_log(log_text: str) -> int | None:
    """The last ``… KV cache size: N tokens`` start-up line's N."""
    found = _KV_LOG.findall(log_text)
    return int(found[-1].replace(",", "")) if found else None


def inspect_server(handle: ServerHandle, *, host: Host | None = None) -> dict:
    """Version and commit, KV capacity, block size, max-model-len, and the hardware facts.

    KV capacity comes from ``vllm:cache_config_info`` (``kv_cache_size_tokens``, else
    ``num_gpu_blocks * block_size``), else from the start-up log line. Both are reported
    (``kv_cache_tokens_metrics`` / ``kv_cache_tokens_log``) so they can be cross-checked.
    """
    host = host or handle.get_host()
    facts: dict = {}
    probe = run_probe(host, handle)
    facts["version"] = probe.get("version")
    facts["sim_profile"] = probe.get("sim_profile")  # a simulated engine, not vLLM
    res = host.run(
        f"set -a; . {shlex.quote(handle.run_dir + '/secrets.env')} 2>/dev/null; set +a; "
        f"{shlex.quote(handle.python)} -c {shlex.quote(_METRICS_PY)} {shlex.quote(handle.base_url)}",
        timeout_s=90,
        idempotent=True,
        stream=False,
    )
    cache = parse_cache_config(res.stdout) if res.rc == 0 else {}
    kv_metrics = None
    if cache.get("kv_cache_size_tokens", "").isdigit():
        kv_metrics = int(cache["kv_cache_size_tokens"])
    elif cache.get("num_gpu_blocks", "").isdigit() and cache.get("block_size", "").isdigit():
        kv_metrics = int(cache["num_gpu_blocks"]) * int(cache["block_size"])
    log_text = read_log(host, handle)
    kv_log = kv_tokens_from_log(log_text)
    facts["kv_cache_tokens_metrics"] = kv_metrics
    facts["kv_cache_tokens_log"] = kv_log
    facts["kv_cache_tokens"] = kv_metrics if kv_metrics is not None else kv_log
    facts["block_size"] = (
        int(cache["block_size"]) if cache.get("block_size", "").isdigit() else None
    )
    facts["num_gpu_blocks"] = (
        int(cache["num_gpu_blocks"]) if cache.get("num_gpu_blocks", "").isdigit() else None
    )
    # max-model-len: /v1/models reports it per model.
    mm = host.run(
        f"set -a; . {shlex.quote(handle.run_dir + '/secrets.env')} 2>/dev/null; set +a; "
        f"{shlex.quote(handle.python)} -c {shlex.quote(_MODELS_PY)} {shlex.quote(handle.base_url)} {shlex.quote(handle.served_name)}",
        timeout_s=90,
        idempotent=True,
        stream=False,
    )
    mml = mm.last_line
    facts["max_model_len"] = int(mml) if mml.isdigit() else None
    # The commit: vLLM's own metadata when the build recorded one.
    commit = host.run(
        f"{shlex.quote(handle.python)} -c 'from vllm._version import __commit_id__ as c; print(c or \"\")'",
        timeout_s=120,
        idempotent=True,
        stream=False,
    )
    facts["commit"] = commit.stdout.strip() or None if commit.rc == 0 else None
    facts["hardware"] = hardware_facts(host)
    handle.facts.update(facts)
    return facts


_MODELS_PY = r"""
import json, os, sys, urllib.request
req = urllib.request.Request(sys.argv[1] + "/v1/models")
key = os.environ.get("SPEEDMATRIX_PROBE_KEY")
if key:
    req.add_header("Authorization", "Bearer " + key)
data = json.loads(urllib.request.urlopen(req, timeout=30).read())
for m in data.get("data", []):
    if m.get("id") == sys.argv[2] and m.get("max_model_len"):
        print(m["max_model_len"])
"""


def hardware_facts(host: Host) -> dict:
    """GPU name / memory / driver from nvidia-smi on GPU hosts; CPU model and memory else."""
    gpu = host.run(
        f"command -v nvidia-smi >/dev/null && {_HW_GPU}",
        timeout_s=60,
        idempotent=True,
        stream=False,
    )
    facts: dict = {}
    if gpu.rc == 0 and gpu.stdout.strip():
        gpus = []
        for line in gpu.stdout.strip().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 3:
                mib = re.fullmatch(r"(\d+)\s*MiB", parts[1])
                gpus.append(
                    {
                        "name": parts[0],
                        "memory_total": parts[1],  # as nvidia-smi says it, e.g. "97887 MiB"
                        "memory_total_mib": int(mib.group(1)) if mib else None,
                        "driver": parts[2],
                    }
                )
        facts["gpus"] = gpus
        facts["gpu_count"] = len(gpus)
    cpu = host.run(_HW_CPU, timeout_s=60, idempotent=True, stream=False)
    for line in cpu.stdout.splitlines():
        k, _, v = line.partition("=")
        facts[k] = int(v) if v.isdigit() else v
    if "mem_total_kb" in facts:
        facts["mem_total_gb"] = round(facts["mem_total_kb"] / 1024 / 1024, 1)
    return facts
