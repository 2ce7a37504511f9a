"""``Client`` against an in-memory coordinator."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from vpool.sdk import ApiError, AuthError, Client, ConnectionError, NotFoundError, VsdkError


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "app.py").write_text("print('hi')\n")
    (tmp_path / "in.txt").write_text("input\n")
    (tmp_path / "stdin.txt").write_bytes(b"feed me\n")
    return tmp_path / "app.py"


def test_submit_uploads_bundle_and_stdin(coord: Any, app: Path) -> None:
    with coord.client() as c:
        info = c.submit(
            app,
            4,
            inputs=[app.parent / "in.txt"],
            stdin=app.parent / "stdin.txt",
            args=["--n", "3"],
        )
    assert info.id == 1 and info.ranks == 4 and info.name == "app.py"
    sub = coord.jobs[1].submit
    assert sub.entry == "app.py" and sub.args == ["--n", "3"] and sub.ranks == 4
    assert coord.blobs[sub.stdin] == b"feed me\n"
    with zipfile.ZipFile(io.BytesIO(coord.blobs[sub.bundle])) as zf:
        assert sorted(zf.namelist()) == ["app.py", "in.txt"]


def test_known_blobs_are_not_uploaded_again(coord: Any, app: Path) -> None:
    with coord.client() as c:
        c.submit(app, 1)
        c.submit(app, 1, name="again")
    puts = [p for m, p in coord.requests if m == "PUT"]
    heads = [p for m, p in coord.requests if m == "HEAD"]
    assert len(puts) == 1 and len(heads) == 2
    assert coord.jobs[2].info.name == "again"


def test_upload_blob_names_by_sha256(coord: Any) -> None:
    with coord.client() as c:
        info = c.upload_blob(b"abc")
    assert info.sha256 == hashlib.sha256(b"abc").hexdigest() and info.size == 3


def test_follow_output_and_wait(coord: Any, app: Path) -> None:
    coord.script(chunks=[(0, "stdout", b"a\n"), (1, "stdout", b"b\n"), (0, "stderr", b"c\n")])
    with coord.client() as c:
        job = c.submit(app, 2)
        recs = list(c.follow_output(job.id))
        assert [(r.rank, r.stream, r.data) for r in recs] == [
            (0, "stdout", b"a\n"),
            (1, "stdout", b"b\n"),
            (0, "stderr", b"c\n"),
        ]
        assert [r.data for r in c.follow_output(job.id, rank=1)] == [b"b\n"]
        seen = []
        assert c.wait(job.id, on_change=seen.append).state == "succeeded"
        assert seen and seen[-1].job.state == "succeeded"
        assert [j.id for j in c.jobs()] == [1]
        assert c.status(job.id).ranks[1].rank == 1


def test_results_are_extracted_safely(coord: Any, app: Path, tmp_path: Path) -> None:
    zip_of = sys.modules["sdk_fakecoord"].zip_of
    coord.results_zip = zip_of({"rank-0/out.txt": b"0", "rank-1/out.txt": b"1"})
    with coord.client() as c:
        job = c.submit(app, 2)
        files = c.results(job.id, tmp_path / "res")
        assert sorted(f.relative_to(tmp_path / "res").as_posix() for f in files) == [
            "rank-0/out.txt",
            "rank-1/out.txt",
        ]
        coord.results_zip = zip_of({"../evil.txt": b"x"})
        with pytest.raises(VsdkError, match="unsafe path"):
            c.results(job.id, tmp_path / "res2")
    assert not (tmp_path / "evil.txt").exists()


def test_api_errors_carry_code_and_status(coord: Any) -> None:
    with coord.client() as c, pytest.raises(NotFoundError) as info:
        c.status(42)
    assert info.value.status == 404 and info.value.code == "no_such_job"
    assert "job 42 does not exist" in str(info.value)
    with coord.client(token="wrong") as c, pytest.raises(AuthError) as auth:
        c.jobs()
    assert auth.value.exit_code == 5


def test_non_json_error_body() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(502, text="Bad Gateway"))
    with Client("http://x", "t", transport=transport) as c, pytest.raises(ApiError) as info:
        c.whoami()
    assert info.value.code == "http_502" and "Bad Gateway" in info.value.message


def test_unexpected_answer_is_an_api_error() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(200, json={"nope": 1}))
    with Client("http://x", "t", transport=transport) as c:
        with pytest.raises(ApiError, match="unexpected"):
            c.whoami()


def test_transport_failures_are_connection_errors() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    with Client("http://x", "t", transport=httpx.MockTransport(refuse)) as c:
        with pytest.raises(ConnectionError, match="Connection refused") as info:
            c.pool_info()
    assert info.value.exit_code == 5


@pytest.mark.medium
def test_unreachable_real_port() -> None:
    with Client("http://127.0.0.1:9", "t", timeout=5) as c, pytest.raises(ConnectionError):
        c.pool_info()


def test_missing_ca_file(tmp_path: Path) -> None:
    with pytest.raises(VsdkError, match="CA file"):
        Client("https://x", "t", ca=tmp_path / "nope.pem")


@pytest.mark.large
def test_importing_vpool_sdk_stays_light() -> None:
    """Rank processes import vpool.mpi, hence vpool.sdk: it must pull in nothing heavy."""
    code = (
        "import sys, vpool.sdk\n"
        "heavy = [m for m in ('httpx', 'click', 'vpool.mpi', 'vpool.sdk.client') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert vpool.sdk.Client.__name__ == 'Client'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
