"""The HTTP judge (rlhf/evaluation/judges.py) against servers on 127.0.0.1 that misbehave: a redirect to
another server (which must never receive the key), a reply sent one byte at a time (one deadline
per request), a reply too large, non-finite log-probs, answers that are not exactly a verdict, and
replies of the wrong shape: each one sentence, never a wrong probability or a traceback."""

import base64
import http.server
import json
import threading
import time
import types

import pytest

from rlhf.evaluation import judges


def serve(handle):
    """A server on 127.0.0.1 whose POST is handle(handler) -> (base URL, requests seen: [(path, Authorization)], stop)."""
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append((self.path, self.headers.get("Authorization")))
            handle(self)

        do_GET = do_POST

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop():
        server.shutdown()
        server.server_close()

    return f"http://127.0.0.1:{server.server_address[1]}/v1", seen, stop


def reply_with(payload):
    def handle(h):
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
    return handle


def ask(url, timeout=5.0, retries=0, monkeypatch=None):
    args = types.SimpleNamespace(judge_base_url=url, judge_api_key_env="JUDGE_TEST_KEY", judge_timeout=timeout,
                                 judge_max_retries=retries)
    return judges.http_first_better("judge", args, "{prompt} <<{a}>> <<{b}>>", ["p"], ["a"], ["b"])


def _no_proxy_variables(monkeypatch):
    for name in ("no_proxy", "NO_PROXY", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def key(monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sekret")


def test_a_verdict_and_log_probs_are_read():
    url, _, stop = serve(reply_with({"choices": [{"message": {"content": " B\n"}}]}))
    try:
        assert ask(url).tolist() == [0.0]
    finally:
        stop()
    logprobs = {"content": [{"top_logprobs": [{"token": "A", "logprob": -0.1}, {"token": " B", "logprob": -2.4}]}]}
    url, _, stop = serve(reply_with({"choices": [{"message": {"content": "A"}, "logprobs": logprobs}]}))
    try:
        assert ask(url)[0] == pytest.approx(1 / (1 + pow(2.718281828459045, -2.3)))
    finally:
        stop()


@pytest.mark.parametrize("status", [302, 307])
def test_a_redirect_to_another_server_is_not_followed_and_the_key_stays_home(status):
    other, other_seen, stop_other = serve(reply_with({"choices": [{"message": {"content": "A"}}]}))

    def redirect(h):
        h.send_response(status)
        h.send_header("Location", other + "/chat/completions")
        h.send_header("Content-Length", "0")
        h.end_headers()

    url, seen, stop = serve(redirect)
    try:
        with pytest.raises(judges.JudgeUnreachable, match=r"redirected the request to http://127\.0\.0\.1:\d+/v1/chat/"
                                                           r"completions, which the judge does not follow"):
            ask(url, retries=2)
        assert other_seen == [] and len(seen) == 1  # refused at once, not tried again
    finally:
        stop()
        stop_other()


def test_a_reply_sent_one_byte_at_a_time_is_cut_off_at_the_deadline():
    body = json.dumps({"choices": [{"message": {"content": "A"}}]}).encode()

    def drip(h):
        h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        for byte in body:
            try:
                h.wfile.write(bytes([byte]))
                h.wfile.flush()
            except OSError:
                return
            time.sleep(0.3)  # every read returns within the timeout; the whole reply takes ~13 s

    url, _, stop = serve(drip)
    try:
        start = time.time()
        with pytest.raises(judges.JudgeUnreachable, match=r"gave no answer in 1 try \(no complete reply within 0.5 s\)"):
            ask(url, timeout=0.5)
        assert time.time() - start < 5  # one deadline for the request, not one per read (13 s); room for a loaded machine
    finally:
        stop()


def test_a_reply_larger_than_the_cap_is_refused():
    url, _, stop = serve(reply_with(b" " * (judges.MAX_REPLY_BYTES + 10) + b"{}"))
    try:
        with pytest.raises(judges.JudgeUnreachable, match=r"the reply is larger than 1048576 bytes"):
            ask(url)
    finally:
        stop()


def logprob_reply(a, b):
    return (b'{"choices": [{"message": {"content": "B"}, "logprobs": {"content": [{"top_logprobs": '
            b'[{"token": "A", "logprob": %s}, {"token": "B", "logprob": %s}]}]}}]}' % (a, b))


@pytest.mark.parametrize("reply, message", [
    (logprob_reply(b"NaN", b"-1.0"), r"the reply gives the verdict 'A' the log-prob nan, which is no probability"),
    (logprob_reply(b"-1.0", b"Infinity"), r"the reply gives the verdict 'B' the log-prob inf"),
    ({"choices": [{"message": {"content": "After"}}]}, r"the judge answered 'After', which is not a verdict \(exactly A or B\)"),
    ({"choices": [{"message": {"content": "Assistant B is better"}}]}, r"answered 'Assistant B is better', which is not"),
    ({"choices": [{"message": {"content": "a"}}]}, r"answered 'a', which is not a verdict"),
    ({"choices": [{"message": {"content": None}}]}, r"answered None, which is not a verdict"),
    ({"choices": [{"message": "A"}]}, r"answered None, which is not a verdict"),
    ({"choices": ["A"]}, r"the reply \{\"choices\": \[\"A\"\]\} holds no choices\[0\] object"),
    ({"choices": []}, r"holds no choices\[0\] object"),
    ([1, 2], r"the reply \[1, 2\] holds no choices\[0\] object"),
    ({"choices": [{"message": {"content": "A"}, "logprobs": {"content": [{"top_logprobs": [{"token": 5}]}]}}]},
     r"the reply's top_logprobs entry \{\"token\": 5\} is not a token and a number"),
])
def test_an_answer_that_is_not_a_verdict_is_one_sentence_naming_it(reply, message):
    url, seen, stop = serve(reply_with(reply))
    try:
        with pytest.raises(judges.JudgeBadAnswer, match=message):
            ask(url, retries=2)
        assert len(seen) == 1  # the same question gets the same answer: not asked again
    finally:
        stop()


def test_a_reply_that_is_not_json_is_tried_again_then_one_sentence():
    url, seen, stop = serve(reply_with(b"<html>busy</html>"))
    try:
        with pytest.raises(judges.JudgeUnreachable, match=r"/v1/chat/completions gave no answer in 2 tries \(Expecting value"):
            ask(url, retries=1)
        assert len(seen) == 2
    finally:
        stop()


def test_the_http_proxy_of_the_environment_is_used(monkeypatch):
    """HTTP_PROXY is honoured (as urllib honoured it): the request goes to the proxy, with the
    judge's absolute URL in the request line."""
    proxy, seen, stop = serve(reply_with({"choices": [{"message": {"content": "B"}}]}))
    _no_proxy_variables(monkeypatch)
    monkeypatch.setenv("http_proxy", proxy.rsplit("/", 1)[0])
    try:
        assert ask("http://judge.example/v1").tolist() == [0.0]
        assert seen == [("http://judge.example/v1/chat/completions", "Bearer sekret")]
    finally:
        stop()


def test_a_proxy_with_a_login_gets_it(monkeypatch):
    """http://user:password@proxy: the proxy gets basic Proxy-Authorization, as urllib sends it."""
    logins = []
    answer = reply_with({"choices": [{"message": {"content": "B"}}]})
    proxy, seen, stop = serve(lambda h: logins.append(h.headers.get("Proxy-Authorization")) or answer(h))
    _no_proxy_variables(monkeypatch)
    monkeypatch.setenv("http_proxy", proxy.rsplit("/", 1)[0].replace("http://", "http://ann:p%40ss@"))
    try:
        assert ask("http://judge.example/v1").tolist() == [0.0]
        assert logins == ["Basic " + base64.b64encode(b"ann:p@ss").decode()]
    finally:
        stop()


def test_a_proxy_login_reaches_the_connect_tunnel(monkeypatch):
    """https through a proxy: the CONNECT request carries the proxy's login (and the key never
    reaches the proxy); a refused tunnel is an OSError, as a broken connection is."""
    seen = []

    class Proxy(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_CONNECT(self):
            seen.append((self.path, self.headers.get("Proxy-Authorization"), self.headers.get("Authorization")))
            self.send_response(407)
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _no_proxy_variables(monkeypatch)
    monkeypatch.setenv("https_proxy", f"http://ann:p%40ss@127.0.0.1:{server.server_address[1]}")
    try:
        with pytest.raises(OSError, match="407"):
            judges.post_json("https://judge.example/v1/chat/completions", b"{}", {"Authorization": "Bearer sekret"}, 5)
        assert seen == [("judge.example:443", "Basic " + base64.b64encode(b"ann:p@ss").decode(), None)]
    finally:
        server.shutdown()


def test_a_base_url_with_a_query_string_keeps_it_after_the_path():
    """Azure-style base URLs carry ?api-version=: /chat/completions goes into the path, the query
    stays last (and reaches the server), with or without a trailing slash."""
    url, seen, stop = serve(reply_with({"choices": [{"message": {"content": "A"}}]}))
    try:
        assert ask(url + "?api-version=2024-06-01").tolist() == [1.0]
        assert ask(url + "/?api-version=2024-06-01").tolist() == [1.0]
        assert [path for path, _ in seen] == ["/v1/chat/completions?api-version=2024-06-01"] * 2
    finally:
        stop()


def test_a_proxy_without_a_scheme_or_a_password_is_read_as_urllib_reads_it(monkeypatch):
    """HTTP_PROXY=host:port is http://host:port; user@host has the login "user:" (no password)."""
    logins = []
    answer = reply_with({"choices": [{"message": {"content": "B"}}]})
    proxy, seen, stop = serve(lambda h: logins.append(h.headers.get("Proxy-Authorization")) or answer(h))
    _no_proxy_variables(monkeypatch)
    try:
        monkeypatch.setenv("http_proxy", proxy.rsplit("/", 1)[0].replace("http://", ""))
        assert ask("http://judge.example/v1").tolist() == [0.0]
        monkeypatch.setenv("http_proxy", proxy.rsplit("/", 1)[0].replace("http://", "http://ann@"))
        assert ask("http://judge.example/v1").tolist() == [0.0]
        assert [path for path, _ in seen] == ["http://judge.example/v1/chat/completions"] * 2
        assert logins == [None, "Basic " + base64.b64encode(b"ann:").decode()]
    finally:
        stop()


def test_a_host_in_no_proxy_is_asked_directly_and_another_is_not(monkeypatch):
    """no_proxy names the hosts asked without the proxy: the judge at 127.0.0.1 is reached directly
    (the proxy's port is closed), and a judge at another host still goes through the proxy."""
    url, seen, stop = serve(reply_with({"choices": [{"message": {"content": "A"}}]}))
    proxy, proxy_seen, stop_proxy = serve(reply_with({"choices": [{"message": {"content": "B"}}]}))
    _no_proxy_variables(monkeypatch)
    monkeypatch.setenv("http_proxy", proxy.rsplit("/", 1)[0])
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    try:
        assert ask(url).tolist() == [1.0]
        assert ask("http://judge.example/v1").tolist() == [0.0]
        assert [path for path, _ in seen] == ["/v1/chat/completions"]
        assert [path for path, _ in proxy_seen] == ["http://judge.example/v1/chat/completions"]
    finally:
        stop()
        stop_proxy()


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_proxy_without_a_port_is_asked_on_port_80(monkeypatch, scheme):
    """http://proxy (no port), as urllib: the proxy's connection goes to port 80, for a plain
    request and for a CONNECT tunnel alike; the tunnel goes to the judge's own port."""
    import http.client

    opened = []

    class Connection:
        def __init__(self, host, port=None, timeout=None):
            opened.append((host, port))

        def set_tunnel(self, host, port=None, headers=None):
            opened.append(("tunnel", host, port))

        def connect(self):
            raise ConnectionRefusedError("refused")

        def close(self):
            pass

    monkeypatch.setattr(http.client, "HTTPConnection", Connection)
    monkeypatch.setattr(http.client, "HTTPSConnection", Connection)
    _no_proxy_variables(monkeypatch)
    monkeypatch.setenv(f"{scheme}_proxy", "http://proxy.example")
    with pytest.raises(OSError, match="^ConnectionRefusedError: refused$"):
        judges.post_json(f"{scheme}://judge.example:8443/v1/chat/completions", b"{}", {}, 5)
    assert opened == [("proxy.example", 80)] + ([("tunnel", "judge.example", 8443)] if scheme == "https" else [])


@pytest.mark.parametrize("status", [300, 399])
def test_every_3xx_is_a_redirect_and_one_without_location_says_so(status):
    """300 <= status < 400 is refused as a redirect; without a Location header the sentence has "?"."""
    def redirect(h):
        h.send_response(status)
        h.send_header("Content-Length", "0")
        h.end_headers()

    url, seen, stop = serve(redirect)
    try:
        with pytest.raises(judges.JudgeUnreachable) as e:
            ask(url, retries=2)
        assert str(e.value) == (f"{url}/chat/completions redirected the request to ?, which the judge does not follow "
                                "(the API key would go there): pass the final URL as --judge_base_url")
        assert len(seen) == 1
    finally:
        stop()


def _words(first, n=150):
    """A text of one-letter words after `first`: where basics.brief cuts it moves with each
    character of its limit, so a sentence cut at another length is not the same sentence."""
    return first + " " + " ".join("a" * n)


def test_long_texts_are_cut_at_their_stated_lengths():
    """A redirect's Location is cut at 120 characters, a reply of the wrong shape at 200, an
    answer that is not a verdict at 120 (of its repr)."""
    from rlhf import basics

    def differs(text, limit):  # the test's text tells limit from limit + 1
        assert basics.brief(text, limit) != basics.brief(text, limit + 1)
        return basics.brief(text, limit)

    location = "http://other.example/" + _words("xy")

    def redirect(h):
        h.send_response(302)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()

    url, _, stop = serve(redirect)
    try:
        with pytest.raises(judges.JudgeUnreachable) as e:
            ask(url)
        assert str(e.value).startswith(f"{url}/chat/completions redirected the request to {differs(location, 120)}, which")
    finally:
        stop()
    shape = {"xy": _words("a")}
    with pytest.raises(judges.JudgeBadAnswer) as e:
        judges.answer_prob(shape)
    assert str(e.value) == f"the reply {differs(json.dumps(shape), 200)} holds no choices[0] object"
    text = _words("bb")
    with pytest.raises(judges.JudgeBadAnswer) as e:
        judges.answer_prob({"choices": [{"message": {"content": text}}]})
    assert str(e.value) == f"the judge answered {differs(repr(text), 120)}, which is not a verdict (exactly A or B)"


@pytest.mark.parametrize("logprobs", [[1], {"content": ["A"]}, {"content": [{"top_logprobs": "A"}]}, {"content": []}])
def test_log_probs_of_another_shape_fall_back_to_the_answer(logprobs):
    """logprobs, its content or its top_logprobs of another shape than OpenAI's: the answer's letter decides."""
    reply = {"choices": [{"message": {"content": " B"}, "logprobs": logprobs}]}
    assert judges.answer_prob(reply) == 0.0


def test_a_reply_of_exactly_the_cap_is_read_and_one_byte_more_is_not():
    """post_json's max_bytes is the largest reply it reads: that many bytes parse, one more is refused."""
    body = json.dumps({"choices": [{"message": {"content": "A"}}]}).encode()
    url, _, stop = serve(reply_with(body))
    try:
        assert judges.post_json(url + "/chat/completions", b"{}", {}, 5, max_bytes=len(body)) == json.loads(body)
        with pytest.raises(ValueError, match=f"^the reply is larger than {len(body) - 1} bytes$"):
            judges.post_json(url + "/chat/completions", b"{}", {}, 5, max_bytes=len(body) - 1)
    finally:
        stop()


def test_a_conversation_is_shown_to_the_judge_as_role_lines():
    """fill_template: a text prompt stripped; a conversation as one 'role: content' line a message."""
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sum up: x"}]
    assert judges.fill_template("[{prompt}] {a} | {b}", conversation, " A ", "B\n") == "[system: Be brief.\nuser: Sum up: x] A | B"
    assert judges.fill_template("[{prompt}]", "  plain  ", "a", "b") == "[plain]"
