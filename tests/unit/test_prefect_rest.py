"""flows.services.prefect_rest: the raw-HTTP Prefect call retries what Prefect's own client retries (a real local
HTTP server answers 503 first, as Prefect's does when SQLite is busy) and names the call when it fails."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from flows.services import prefect_rest


@pytest.fixture
def server():
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            calls.append(self.path)
            if self.path == "/missing":
                status, body = 404, {"detail": "Not found"}
            elif self.path == "/busy" and calls.count("/busy") == 1:
                status, body = 503, {"detail": "database is locked"}
            else:
                status, body = 200, {"id": "abc"}
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", calls
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_503_is_retried_and_the_answer_returned(server):
    url, calls = server
    with httpx.Client(base_url=url, timeout=10) as client:
        assert prefect_rest(client, "GET", "/busy") == {"id": "abc"}
    assert calls == ["/busy", "/busy"]


def test_a_client_error_names_the_call_and_is_not_retried(server):
    url, calls = server
    with httpx.Client(base_url=url, timeout=10) as client, pytest.raises(RuntimeError, match="GET /missing: 404"):
        prefect_rest(client, "GET", "/missing")
    assert calls == ["/missing"]
