"""Build `loadgen.pyz`: the load generator as one file to copy to a GPU host.

The host runs it with the Python of its vLLM environment (`python loadgen.pyz decode …`),
which already has aiohttp (and uvloop); nothing is installed there. The archive holds only
`speedmatrix.records`, `speedmatrix.errors` (the input-error type), `speedmatrix.renames` (an
old option's name still read: `--duration`; standard library only each) and this package, under a minimal `speedmatrix/__init__.py`, so it
cannot drag in Airflow, pandas or anything else of the project.
"""

from __future__ import annotations

import shutil
import tempfile
import zipapp
from pathlib import Path

from speedmatrix import errors, records, renames

_PACKAGE = Path(__file__).resolve().parent
_MAIN = "from speedmatrix.loadgen.cli import main\n\nraise SystemExit(main())\n"
_INIT = '"""speedmatrix (load generator only, shipped as a zipapp)."""\n'


def build(path: str | Path, interpreter: str | None = "/usr/bin/env python3") -> Path:
    """Write the zipapp to `path` and return it; runs as `python loadgen.pyz decode …`."""
    target = Path(path)
    with tempfile.TemporaryDirectory(prefix="loadgen-pyz-") as tmp:
        root = Path(tmp) / "src"
        pkg = root / "speedmatrix"
        (pkg / "loadgen").mkdir(parents=True)
        (pkg / "__init__.py").write_text(_INIT)
        shutil.copy2(records.__file__, pkg / "records.py")
        shutil.copy2(errors.__file__, pkg / "errors.py")
        shutil.copy2(renames.__file__, pkg / "renames.py")
        for item in _PACKAGE.iterdir():
            if item.suffix in (".py", ".txt") and item.is_file():
                shutil.copy2(item, pkg / "loadgen" / item.name)
        (root / "__main__.py").write_text(_MAIN)
        target.parent.mkdir(parents=True, exist_ok=True)
        zipapp.create_archive(root, target, interpreter=interpreter, compressed=True)
    return target


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1] if len(sys.argv) > 1 else "loadgen.pyz"))
