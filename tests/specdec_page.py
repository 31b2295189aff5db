"""A synthetic published page of a speculating server, with known ground truth.

No published speculative-decoding page ships with the project, so the tests make one: the
synthetic spec-decode profile with acceptance per request (falling with context, scattering
between prompts) predicts a matrix, and the report's own Markdown renderer writes it as a page.
`sim calibrate` only ever sees the page.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from speedmatrix.report.parse import parse_report
from speedmatrix.report.render import render_markdown
from speedmatrix.sim.predict import predict_matrix
from speedmatrix.sim.profile import Profile

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC = ROOT / "include" / "sim-profiles" / "synthetic-specdec-not-calibrated.yaml"
REFERENCE = ROOT / "include" / "reference" / "speed-matrix-kimi-k2.7-nvfp4-rtxpro6k-x8.txt"
CONTEXTS = [1024, 2048, 4096, 8192]
CONCURRENCIES = [1, 2, 4, 8]
WINDOW_S = 10.0


def truth_profile() -> Profile:
    """The synthetic spec profile with acceptance per request: falls with context, scatters."""
    data = yaml.safe_load(SYNTHETIC.read_text())
    data["max_model_len"] = 32768  # our own copy: the shipped file's edges are not ours to move
    data["kv"]["num_gpu_blocks"] = 6000  # 8K x 8 over capacity, the rest runnable
    # prompt rates under 10K tok/s: the summary's "12.3K" format is issue 15 section 2's
    data["prefill"]["points"] = [[1024, 0.2], [8192, 1.8], [16384, 4.0]]
    data["decode"]["base_s"] = 0.02
    data["spec_decode"]["acceptance_length"] = {
        "mean": [{"context": 1024, "length": 4.6}, {"context": 16384, "length": 3.6}],
        "spread": 0.9,
    }
    return Profile.from_dict(data)


def spec_page() -> str:
    """The page (k = 7 in its launch command, 10 s windows, max output 4,096)."""
    run = dict(parse_report(REFERENCE.read_text()).run)
    run.update(
        served_model="sim-specdec",
        model="sim/specdec-synthetic",
        measure_s=WINDOW_S,
        launch_command="vllm serve sim/specdec-synthetic --served-model-name sim-specdec "
        "--max-model-len 32768 --speculative-config "
        '\'{"method": "draft_model", "num_speculative_tokens": 7}\'',
    )
    cells = predict_matrix(
        truth_profile(),
        prefill_contexts=[*CONTEXTS, 16384],
        contexts=CONTEXTS,
        concurrencies=CONCURRENCIES,
        window_s=WINDOW_S,
        max_output=4096,
    )
    return render_markdown(run, cells)
