"""json_http over real sockets: a JsonHttpServer on 127.0.0.1 and the HttpClient talking to it."""

from __future__ import annotations

import json
import math
import socket

import pytest

from weightsync.transport.json_http import BodyError, HttpClient, HttpError, JsonHandler, JsonHttpServer, error_text

MAX_BODY = 1024


class _Echo(JsonHandler):
    def do_POST(self) -> None:
        try:
            body = self.read_body()
        except BodyError as e:
            self.send_json(e.status, {"error": str(e)})
            return
        if self.path == "/echo":
            self.send_json(200, json.loads(body))
        elif self.path == "/big":
            self.send_json(200, {"blob": "x" * 10_000})
        elif self.path == "/fail":
            self.send_json(503, {"detail": {"message": "warming up"}})
        elif self.path == "/auth":
            self.send_json(200, {"authorization": self.headers.get("Authorization")})
        elif self.path == "/nan":
            self.send_json(200, {"grad_norm": math.inf, "loss": math.nan})
        else:
            self.send_bytes(200, b"Success: plain text", "text/plain")


@pytest.fixture(scope="module")
def server():
    httpd = JsonHttpServer(("127.0.0.1", 0), _Echo, max_body_bytes=MAX_BODY, body_hint="send fewer tokens")
    thread = httpd.serve_in_thread("test-json-http")
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=30)


def test_a_json_body_goes_and_comes_back(server):
    assert HttpClient(server.url).post_json("/echo", {"a": [1, 2.5, "x"]}) == {"a": [1, 2.5, "x"]}


def test_a_reply_over_the_cap_is_an_error_not_a_truncation(server):
    with pytest.raises(HttpError, match="reply over 1000 bytes") as raised:
        HttpClient(server.url, max_reply_bytes=1000).post_json("/big", {})
    assert raised.value.status == 200


def test_an_error_reply_names_the_status_and_the_servers_own_message(server):
    with pytest.raises(HttpError, match=r"POST .*/fail answered 503: warming up") as raised:
        HttpClient(server.url).post_json("/fail", {})
    assert raised.value.transient and json.loads(raised.value.body) == {"detail": {"message": "warming up"}}


def test_a_reply_that_is_not_json_is_an_error_where_json_was_asked(server):
    with pytest.raises(HttpError, match="not JSON: Success: plain text"):
        HttpClient(server.url).post_json("/text", {})
    assert HttpClient(server.url).request("POST", "/text", {}).text == "Success: plain text"


def test_an_oversized_body_is_refused_with_413_and_the_servers_hint(server):
    with pytest.raises(HttpError, match="over this server's limit of 1024 bytes; send fewer tokens") as raised:
        HttpClient(server.url).post_json("/echo", {"blob": "y" * 5000})
    assert raised.value.status == 413 and not raised.value.transient


def test_a_body_without_a_content_length_is_refused_with_411(server):
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        assert conn.recv(100).startswith(b"HTTP/1.1 411")


def test_non_finite_numbers_travel_as_pythons_json_writes_them(server):
    doc = HttpClient(server.url).post_json("/nan", {})
    assert doc["grad_norm"] == math.inf and math.isnan(doc["loss"])


def test_no_answer_is_a_transient_error_without_a_status():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(HttpError, match="got no answer") as raised:
        HttpClient(f"http://127.0.0.1:{port}", timeout_s=30).get_json("/")
    assert raised.value.status is None and raised.value.transient


def test_the_api_key_goes_as_a_bearer_token(server):
    assert HttpClient(server.url, api_key="sekret").post_json("/auth", {}) == {"authorization": "Bearer sekret"}
    assert HttpClient(server.url).post_json("/auth", {}) == {"authorization": None}


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"error": "model not found"}', "model not found"),
        ('{"detail": "bad request"}', "bad request"),
        ('{"error": {"message": "nested"}}', "nested"),
        ("plain words", "plain words"),
    ],
)
def test_error_text_reads_what_vllm_sglang_and_fastapi_write(body, message):
    assert error_text(body) == message
