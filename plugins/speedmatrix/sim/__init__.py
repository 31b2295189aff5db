"""The simulated vLLM engine (`speedmatrix sim`).

A continuous-batching engine model stepping in simulated time (``engine``), the performance
parameters it runs on (``profile``), vLLM's HTTP surface over it (``server``, aiohttp; its
request rules and error bodies in ``api``, its loop-lag figures in ``lag``, ``/metrics`` in
``metrics``), running it on a thread or as the process (``runner``), the tokenizer and the
faults it injects (``tokenizer``, ``faults``), a pure sim-time load generator that predicts
what a measurement would see (``predict``), and the fit of a profile to a published Speed
test matrix report (``calibrate``).

Nothing here is imported by ``import speedmatrix.sim``: the serve path stays lean (no pandas,
numpy or Airflow), so `speedmatrix sim serve` starts quickly.
"""
