"""What a server process imports to start: botocore (with aiobotocore, ~250 ms of CPU) only for
an S3 store, pyjwt (~60 ms with the parts of cryptography it loads; the bucket listing's cursor
cipher needs only AES-GCM) only when JWT is configured. Every ds3 process pays its imports at
start: `ds3 dev`'s children, each reader worker, a replaced worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("botocore", "aiobotocore", "jwt")

BUILD = """
import json, sys
from pathlib import Path
from ingester.app import create_app as ingester_app
from reader.app import create_app as reader_app
from shared.config import AuthConfig, IngesterConfig, ReaderConfig
root = Path(sys.argv[1])
store = (root / "objects").as_uri()
auth = AuthConfig(tokens=json.dumps([{"token": "t" * 32, "sub": "a", "read": ["*"], "write": ["*"]}]),
                  internal_token="i" * 32{jwt})
ingester_app(IngesterConfig(data_dir=root / "data", store=store, auth=auth))
reader_app(ReaderConfig(ingester="http://127.0.0.1:1", store=store, auth=auth))
print(json.dumps(sorted(m for m in {heavy} if m in sys.modules)))
"""


def _imported(tmp_path: Path, jwt: str = "") -> list[str]:
    (tmp_path / "objects").mkdir()
    code = BUILD.replace("{jwt}", jwt).replace("{heavy}", repr(HEAVY))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_servers_on_a_local_store_with_static_tokens_import_neither_botocore_nor_pyjwt(tmp_path: Path) -> None:
    assert _imported(tmp_path) == []


def test_jwt_configured_imports_pyjwt(tmp_path: Path) -> None:
    """(the check above would pass if nothing could ever import them)"""
    got = _imported(tmp_path, ', jwt_secret="s" * 32')
    assert "jwt" in got and "botocore" not in got


def test_the_cli_alone_imports_no_aiohttp() -> None:
    """`ds3 --help`, `ds3 cluster ...` and `ds3 pipeline ...` serve nothing: 0.27 s, not 0.7."""
    code = "import sys, ds3.cli; print(sorted(m for m in sys.modules if m.split('.')[0] in ('aiohttp', 'botocore')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
