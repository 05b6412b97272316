"""fetch_bytes: data URLs, base64, local roots, and real HTTP on 127.0.0.1 (SSRF refusals,
redirects, size caps, the overall deadline, proxies from the environment)."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import pytest

from mmserve import _mm

from .conftest import ConnectProxy, MediaHttpServer

LOCAL = ["127.0.0.1"]


def error_code(excinfo: pytest.ExceptionInfo[_mm.MediaError]) -> str:
    return excinfo.value.args[0]


def test_data_urls_and_bare_base64() -> None:
    payload = bytes(range(256)) * 3
    b64 = base64.b64encode(payload).decode()
    urlsafe = base64.urlsafe_b64encode(payload).decode().rstrip("=")
    assert _mm.fetch_bytes(f"data:image/png;base64,{b64}") == payload
    assert _mm.fetch_bytes(f"data:application/octet-stream;base64,{urlsafe}") == payload
    assert _mm.fetch_bytes("data:text/plain,a%2Cb%00") == b"a,b\x00"
    assert _mm.fetch_bytes(b64[:60] + "\n" + b64[60:]) == payload
    assert _mm.fetch_bytes(urlsafe) == payload
    with pytest.raises(_mm.MediaError) as e:
        _mm.fetch_bytes("data:image/png;base64,@@@@")
    assert error_code(e) == "fetch.bad_data_url"
    with pytest.raises(_mm.MediaError) as e:
        _mm.fetch_bytes(b64, max_bytes=100)
    assert error_code(e) == "fetch.too_large"


def test_local_files_only_under_allowed_roots(tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.bin").write_bytes(b"inside")
    (tmp_path / "secret.bin").write_bytes(b"outside")
    (root / "link.bin").symlink_to(tmp_path / "secret.bin")
    inside = str(root / "a.bin")

    with pytest.raises(_mm.MediaError) as e:
        _mm.fetch_bytes(inside)
    assert error_code(e) == "fetch.local_path_not_allowed"

    roots = [str(root)]
    assert _mm.fetch_bytes(inside, allowed_local_roots=roots) == b"inside"
    assert _mm.fetch_bytes(f"file://{inside}", allowed_local_roots=roots) == b"inside"
    for escape in [str(root / ".." / "secret.bin"), str(root / "link.bin"), "/etc/hostname"]:
        with pytest.raises(_mm.MediaError) as e:
            _mm.fetch_bytes(escape, allowed_local_roots=roots)
        assert error_code(e) == "fetch.local_path_not_allowed", escape
    with pytest.raises(_mm.MediaError) as e:
        _mm.fetch_bytes(inside, allowed_local_roots=roots, max_bytes=3)
    assert error_code(e) == "fetch.too_large"


def test_loopback_is_refused_unless_listed(
    http_server: MediaHttpServer, no_proxy_env: pytest.MonkeyPatch
) -> None:
    url = http_server.add_bytes("/img", b"pixels")
    other_names = [http_server.url("/img", host="localhost"), http_server.url("/img", "[::1]")]
    for source in [url, *other_names]:
        with pytest.raises(_mm.MediaError) as e:
            _mm.fetch_bytes(source)
        assert error_code(e) == "fetch.forbidden_address", source
        assert "allowed media domains" in e.value.args[1]
    assert http_server.hits == []
    assert _mm.fetch_bytes(url, allowed_domains=LOCAL) == b"pixels"
    localhost = http_server.url("/img", host="localhost")
    assert _mm.fetch_bytes(localhost, allowed_domains=["localhost"]) == b"pixels"


def test_redirects_are_rechecked_and_limited(
    http_server: MediaHttpServer, no_proxy_env: pytest.MonkeyPatch
) -> None:
    http_server.add_bytes("/final", b"done")
    http_server.add_redirect("/relative", "final", status=301)
    http_server.add_redirect("/absolute", http_server.url("/relative"), status=307)
    assert _mm.fetch_bytes(http_server.url("/absolute"), allowed_domains=LOCAL) == b"done"

    # An allowed host may not bounce the fetch to a host that is not allowed.
    http_server.add_redirect("/escape", http_server.url("/final", host="localhost"))
    with pytest.raises(_mm.MediaError) as e:
        _mm.fetch_bytes(http_server.url("/escape"), allowed_domains=LOCAL)
    assert error_code(e) == "fetch.forbidden_address"

    http_server.add_redirect("/loop", "/loop")
    with pytest.raises(_mm.MediaError) as e:
        _mm.fetch_bytes(http_server.url("/loop"), allowed_domains=LOCAL)
    assert error_code(e) == "fetch.too_many_redirects"
    assert http_server.hits.count("/loop") == 11


def test_http_status_and_size_caps(
    http_server: MediaHttpServer, no_proxy_env: pytest.MonkeyPatch
) -> None:
    with pytest.raises(_mm.MediaError) as e:
        _mm.fetch_bytes(http_server.url("/missing"), allowed_domains=LOCAL)
    assert error_code(e) == "fetch.http_status"
    assert "404" in e.value.args[1]

    body = os.urandom(5000)
    exact = http_server.add_bytes("/exact", body)
    no_length = http_server.add_bytes("/no-length", body, content_length=None)
    huge_claim = http_server.add_bytes("/huge-claim", body, content_length=10**12)
    assert _mm.fetch_bytes(exact, allowed_domains=LOCAL, max_bytes=5000) == body
    assert _mm.fetch_bytes(no_length, allowed_domains=LOCAL) == body
    for url in [exact, no_length, huge_claim]:
        with pytest.raises(_mm.MediaError) as e:
            _mm.fetch_bytes(url, allowed_domains=LOCAL, max_bytes=4999)
        assert error_code(e) == "fetch.too_large", url
        assert "4999" in e.value.args[1]


def test_deadline_holds_against_a_slow_loris(
    http_server: MediaHttpServer, no_proxy_env: pytest.MonkeyPatch
) -> None:
    url = http_server.add_slow("/drip", interval_s=0.05)
    started = time.monotonic()
    with pytest.raises(_mm.MediaError) as e:
        _mm.fetch_bytes(url, allowed_domains=LOCAL, timeout_s=1.0)
    elapsed = time.monotonic() - started
    assert error_code(e) == "fetch.timeout"
    # Every single read succeeds quickly, so only an overall deadline stops it.
    assert elapsed < 5.0


def test_request_timeout_env_sets_the_default(
    http_server: MediaHttpServer, no_proxy_env: pytest.MonkeyPatch
) -> None:
    no_proxy_env.setenv("REQUEST_TIMEOUT", "0.5")
    url = http_server.add_slow("/drip", interval_s=0.05)
    with pytest.raises(_mm.MediaError) as e:
        _mm.fetch_bytes(url, allowed_domains=LOCAL)
    assert error_code(e) == "fetch.timeout"
    assert "0.500 s" in e.value.args[1]


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "http_proxy", "ALL_PROXY"])
def test_requests_go_through_the_proxy(
    http_server: MediaHttpServer,
    connect_proxy: ConnectProxy,
    no_proxy_env: pytest.MonkeyPatch,
    variable: str,
) -> None:
    url = http_server.add_bytes("/via-proxy", b"proxied")
    no_proxy_env.setenv(variable, connect_proxy.url)
    assert _mm.fetch_bytes(url, allowed_domains=LOCAL) == b"proxied"
    assert connect_proxy.targets == [f"127.0.0.1:{http_server.port}"]


@pytest.mark.parametrize(
    "no_proxy", ["127.0.0.1", "127.0.0.0/8", "*", "example.com,127.0.0.1:{port}"]
)
def test_no_proxy_bypasses_the_proxy(
    http_server: MediaHttpServer,
    connect_proxy: ConnectProxy,
    no_proxy_env: pytest.MonkeyPatch,
    no_proxy: str,
) -> None:
    url = http_server.add_bytes("/direct", b"direct")
    no_proxy_env.setenv("HTTP_PROXY", connect_proxy.url)
    no_proxy_env.setenv("NO_PROXY", no_proxy.format(port=http_server.port))
    assert _mm.fetch_bytes(url, allowed_domains=LOCAL) == b"direct"
    assert connect_proxy.targets == []


def test_no_proxy_port_entry_must_match_the_port(
    http_server: MediaHttpServer, connect_proxy: ConnectProxy, no_proxy_env: pytest.MonkeyPatch
) -> None:
    url = http_server.add_bytes("/other-port", b"proxied")
    no_proxy_env.setenv("HTTP_PROXY", connect_proxy.url)
    no_proxy_env.setenv("NO_PROXY", f"127.0.0.1:{http_server.port + 1}")
    assert _mm.fetch_bytes(url, allowed_domains=LOCAL) == b"proxied"
    assert len(connect_proxy.targets) == 1


def test_forbidden_address_is_refused_before_reaching_the_proxy(
    http_server: MediaHttpServer, connect_proxy: ConnectProxy, no_proxy_env: pytest.MonkeyPatch
) -> None:
    no_proxy_env.setenv("HTTP_PROXY", connect_proxy.url)
    with pytest.raises(_mm.MediaError) as e:
        _mm.fetch_bytes(http_server.add_bytes("/x", b"x"))
    assert error_code(e) == "fetch.forbidden_address"
    assert connect_proxy.targets == []


def test_unsupported_schemes_and_bad_input() -> None:
    for source, code in [
        ("ftp://example.com/a.png", "fetch.unsupported_scheme"),
        ("not base64!", "fetch.bad_base64"),
        ("http://", "fetch.bad_url"),
        ("http://user:pw@example.com/a.png", "fetch.bad_url"),
    ]:
        with pytest.raises(_mm.MediaError) as e:
            _mm.fetch_bytes(source)
        assert error_code(e) == code, source
    with pytest.raises(ValueError):
        _mm.fetch_bytes("data:,x", timeout_s=0)
