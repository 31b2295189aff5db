"""The load generator zipapp and the include/ parts shipped next to the env.

One job: what provisioning ships besides the engine, and keeping it current. The zipapp and
the include/ tarball are built here and digested by content (file names and bytes, never
timestamps); ``<state>/shipped.json`` records the digests as last shipped, and a reused env
whose digests differ gets them again, each by rename under the env's lock: upgrading
speedmatrix never leaves an old load generator on the host. Not part of the install hash: a
new load generator is no reason to reinstall vLLM.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import secrets
import shlex
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from speedmatrix.engine.hosts import Host, HostError
from speedmatrix.engine.provision.contract import SHIPPED, ProvisionError
from speedmatrix.engine.provision.remote import read_json
from speedmatrix.recipes import REPO_ROOT

log = logging.getLogger("speedmatrix.provision")


@dataclass(frozen=True)
class Shipment:
    """What provisioning puts next to the env, with a digest of each part's content."""

    loadgen: bytes  # the load generator zipapp
    include: bytes  # the include/ parts a host needs, tar.gz
    digests: dict[str, str]  # {"loadgen": …, "include": …}: names and bytes, no timestamps


def build_shipment() -> Shipment:
    """Build the zipapp and the include/ tarball and digest their content.

    The digests hash each file's name and bytes (and, for include/, whether it is executable)
    and nothing else: the zip and tar bytes carry timestamps, so two builds of the same sources
    differ in bytes but not in digest.
    """
    try:
        loadgen = _loadgen_zipapp()
    except Exception as exc:
        raise ProvisionError(
            f"cannot build the load generator zipapp: {type(exc).__name__}: {exc}"
        ) from exc
    include = include_tarball()
    digests = {"loadgen": _digest(_zip_entries(loadgen)), "include": _digest(_tar_entries(include))}
    return Shipment(loadgen, include, digests)


def _loadgen_zipapp() -> bytes:
    from speedmatrix.loadgen.zipapp import build

    with tempfile.TemporaryDirectory(prefix="speedmatrix-loadgen-") as tmp:
        return build(os.path.join(tmp, "loadgen.pyz")).read_bytes()


def _digest(entries: Iterable[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for name, data in sorted(entries):
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def _zip_entries(data: bytes) -> list[tuple[str, bytes]]:
    """A zipapp's files, and its shebang line (what runs it)."""
    shebang = data[: data.find(b"\n") + 1] if data.startswith(b"#!") else b""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        files = [(i.filename, zf.read(i)) for i in zf.infolist() if not i.is_dir()]
    return [("#!", shebang), *files]


def _tar_entries(data: bytes) -> list[tuple[str, bytes]]:
    """A tarball's regular files, each named with its executable bits."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for m in tar.getmembers():
            fh = tar.extractfile(m) if m.isfile() else None
            if fh is not None:
                out.append((f"{m.name}:{m.mode & 0o111:o}", fh.read()))
    return out


def include_tarball() -> bytes:
    """The project's include/ parts a host needs (model-setup scripts, sim profiles, the chat
    templates recipes serve with), gzipped (without Python caches: they come and go locally and
    would change the digest)."""

    def no_cache(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = info.name.split("/")
        return None if "__pycache__" in parts or info.name.endswith(".pyc") else info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for sub in ("model-setup", "sim-profiles", "chat-templates"):
            p = REPO_ROOT / "include" / sub
            if p.is_dir():
                tar.add(p, arcname=sub, filter=no_cache)
    return buf.getvalue()


def _put_bytes(host: Host, data: bytes, remote: str) -> None:
    with tempfile.NamedTemporaryFile(suffix=os.path.basename(remote), delete=False) as fh:
        fh.write(data)
        local = fh.name
    try:
        host.put(local, remote)
    finally:
        os.unlink(local)


def stage_shipment(host: Host, ship: Shipment, staging: str, parts: Collection[str]) -> None:
    """Copy the ``parts`` of ``ship`` and the new ``shipped.json`` into ``staging`` on the host
    (a directory no other provisioning uses); :func:`place_shipped_lines` puts them in place.
    A failure is a :class:`ProvisionError`: a host without the zipapp cannot measure anything
    (every cell of a run would fail later, one by one), so provisioning fails now instead."""
    try:
        if "loadgen" in parts:
            _put_bytes(host, ship.loadgen, f"{staging}/loadgen.pyz")
        if "include" in parts:
            _put_bytes(host, ship.include, f"{staging}/include.tar.gz")
        record = json.dumps({"format": 1, **ship.digests}, sort_keys=True) + "\n"
        host.put_text(record, f"{staging}/{SHIPPED}", mode=0o644)
    except Exception as exc:
        raise ProvisionError(
            f"cannot ship the load generator zipapp and include/ to {staging} on {host.name}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def place_shipped_lines(parts: Collection[str]) -> list[str]:
    """Shell lines (run under the env's lock) that put the staged parts in ``$ATTEMPT`` in
    place, each by rename so a reader never sees half a file or half a folder: the zipapp over
    the old one; include/ unpacked beside the old one, then swapped in; ``shipped.json`` last,
    so it never records what did not land."""
    lines = []
    if "loadgen" in parts:
        lines.append('mv -f "$ATTEMPT/loadgen.pyz" "$STATE/loadgen.pyz"')
    if "include" in parts:
        lines += [
            'rm -rf "$INCLUDE.new" "$INCLUDE.old" && mkdir -p "$INCLUDE.new"',
            'tar -xzf "$ATTEMPT/include.tar.gz" -C "$INCLUDE.new"',
            'if [ -e "$INCLUDE" ]; then mv "$INCLUDE" "$INCLUDE.old"; fi',
            'mv "$INCLUDE.new" "$INCLUDE"',
            'rm -rf "$INCLUDE.old"',
        ]
    lines.append(f'mv -f "$ATTEMPT/{SHIPPED}" "$STATE/{SHIPPED}"')
    return lines


def refresh_shipped(host: Host, state_dir: str, ship: Shipment) -> list[str]:
    """Ship again what differs from what the host got last, by the digests in
    ``<state>/shipped.json`` (a missing zipapp or include/ counts as different); return the
    parts re-shipped (``[]`` when all is current). Runs on reuse: an upgraded speedmatrix must
    not measure with the load generator of the old one."""
    st, include = shlex.quote(state_dir), shlex.quote(state_dir + "/include")
    have = read_json(
        host, f"[ -s {st}/loadgen.pyz ] && [ -d {include} ] && cat {st}/{SHIPPED} 2>/dev/null"
    )
    stale = [part for part, digest in ship.digests.items() if (have or {}).get(part) != digest]
    if not stale:
        log.info("%s: the shipped load generator and include/ are current", host.name)
        return []
    staging = f"{state_dir}/attempts/ship-{int(time.time())}-{secrets.token_hex(4)}"
    script = "set -euo pipefail\n" + "\n".join(place_shipped_lines(stale)) + "\n"
    env = {"STATE": state_dir, "INCLUDE": f"{state_dir}/include", "ATTEMPT": staging}
    try:
        stage_shipment(host, ship, staging, stale)
        host.run(
            f"flock -w 600 {shlex.quote(state_dir + '/lock')} bash -c {shlex.quote(script)}",
            timeout_s=900,
            env=env,
            check=True,
        )
    except HostError as exc:
        raise ProvisionError(
            f"re-shipping {', '.join(stale)} to {state_dir} failed: {exc}"
        ) from exc
    finally:
        with contextlib.suppress(HostError):
            host.run(f"rm -rf {shlex.quote(staging)}", timeout_s=60, idempotent=True, stream=False)
    log.info(
        "%s: re-shipped %s to %s: not what this speedmatrix ships (shipped.json %s)",
        host.name,
        " and ".join(stale),
        state_dir,
        "or a shipped file missing" if have is None else "differs",
    )
    return stale
