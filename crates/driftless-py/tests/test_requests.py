"""Requests per step of a Follower, counted on the wire: a loopback proxy in front of
SeaweedFS sees every S3 request the Follower makes (the publisher writes to SeaweedFS
directly). The target (issue 12): a follower one step behind makes at most 3 + segments
requests, whatever the retention, and an up-to-date call one."""

import http.client
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

import driftless
from conftest import BF16, _seaweed, bits
from test_stream import bit_chain

HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


class CountingProxy:
    """Forwards every request to `upstream` unchanged (the Host header too: SigV4 signs it)
    and records (method, path, query) of each."""

    def __init__(self, upstream):
        up = urllib.parse.urlsplit(upstream)
        seen = self.seen = []
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def forward(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                path, _, query = self.path.partition("?")
                with lock:
                    seen.append((self.command, urllib.parse.unquote(path), query))
                c = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                c.request(self.command, self.path, body=body, headers=headers)
                r = c.getresponse()
                data = r.read()
                self.send_response(r.status, r.reason)
                bodyless = self.command == "HEAD" or r.status in (204, 304)
                for k, v in r.getheaders():
                    # A HEAD's Content-Length is the object's size: kept as is.
                    if k.lower() not in HOP and (bodyless or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not bodyless:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not bodyless:
                    self.wfile.write(data)
                c.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self):
        out, self.seen[:] = list(self.seen), []
        return out

    def close(self):
        self.server.shutdown()


def test_a_follower_one_step_behind_makes_three_requests_plus_segments(monkeypatch, keys):
    url, kw = _seaweed(monkeypatch)
    private, public = keys
    proxy = CountingProxy(kw["endpoint"])
    try:
        steps = bit_chain(41, (256, 256), 13)
        f = driftless.Follower(url, trusted_keys=[public], **{**kw, "endpoint": proxy.endpoint})
        arrays = {"x.w": np.zeros((256, 256), BF16)}
        per_step = []
        with driftless.Publisher(url, signing_key=private, anchor_every=1000, **kw) as pub:
            for s, x in enumerate(steps):
                pub.publish(s, {"x.w": x.view(BF16)})
                pub.flush()
                proxy.take()
                o = f.apply_to(arrays)
                seen = proxy.take()
                assert o["step"] == s, o
                assert np.array_equal(bits(arrays["x.w"]), x)
                if s < 2:
                    continue  # the first load lists; the first hint is read
                segments = [r for r in seen if f"/deltas/{s:012d}/" in r[1] and "manifest" not in r[1]]
                assert o["route"] == "fast", o
                listings = [r for r in seen if "list-type" in r[2]]
                if s % 10 == 0:
                    # Every 10th plan from a step (here step s) lists anyway: markers are the
                    # source of truth.
                    assert listings, seen
                    continue
                assert not listings and not any(r[1].endswith("/stream.json") for r in seen), seen
                assert segments and len(seen) <= 3 + len(segments), seen
                per_step.append(len(seen))
            # Up to date: one conditional GET of latest.json.
            o = f.apply_to(arrays)
            up = proxy.take()
            assert o["route"] == "up_to_date" and len(up) == 1 and up[0][1].endswith("/latest.json"), up
        # Constant over the run, whatever the number of deltas retained (11 by the end).
        assert len(set(per_step)) == 1, per_step
        print(f"requests per step, one step behind: {per_step[0]} (1 segment each); up to date: 1")
    finally:
        proxy.close()


def test_poll_with_another_streams_hint_reads_stream_json_once(monkeypatch, keys):
    """A validly signed latest.json of another stream sits in the bucket (copied in, or left by
    an old run): poll() answers from the listing, and reads stream.json once for that hint and
    once per listing, not at every call (its conditional GET of latest.json says "not
    modified")."""
    import boto3
    from botocore.config import Config

    url, kw = _seaweed(monkeypatch)
    other = url + "-other"
    private, public = keys
    newest = {}
    for u, seed, n in ((url, 43, 3), (other, 44, 6)):
        with driftless.Publisher(u, signing_key=private, anchor_every=100, **kw) as pub:
            for s, x in enumerate(bit_chain(seed, (64, 64), n)):
                pub.publish(s, {"x.w": x.view(BF16)})
                newest[u] = s
    assert newest[other] > newest[url]
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3", endpoint_url=kw["endpoint"], region_name="us-east-1",
                      config=Config(s3={"addressing_style": "path"}))
    s3.copy_object(Bucket=bucket, Key=f"{prefix}/latest.json", CopySource={"Bucket": bucket, "Key": f"{prefix}-other/latest.json"})
    proxy = CountingProxy(kw["endpoint"])
    try:
        f = driftless.Follower(url, trusted_keys=[public], **{**kw, "endpoint": proxy.endpoint})
        assert [f.poll() for _ in range(12)] == [newest[url]] * 12, "the foreign hint's newest step is not ours"
        seen = proxy.take()
        # stream.json: once for the hint, and once more with the listing of the 10th call
        # (without a valid hint of this stream, each listing checks which stream is here).
        descriptor = [r for r in seen if r[1].endswith("/stream.json")]
        assert len(descriptor) == 2, seen
        # Every call: one conditional GET of latest.json; the listing (no valid hint of this
        # stream) only when latest.json changes, and at every 10th call.
        assert len([r for r in seen if r[1].endswith("/latest.json")]) == 12, seen
        assert len([r for r in seen if "list-type" in r[2]]) == 2 * 2, seen
    finally:
        proxy.close()


def test_an_up_to_date_follower_does_not_list_while_latest_json_is_bad(monkeypatch, keys):
    """A Follower on the newest step, with latest.json made invalid (garbled), deleted, or
    replaced by an older signed hint (a replay): while it stays as it is, apply_to and poll()
    list the markers at most every 10th call, as the agent does (found by review: the Follower
    listed at every call, and read latest.json whole each time). A new step is still found."""
    from conftest import Raw

    url, kw = _seaweed(monkeypatch)
    private, public = keys
    raw = Raw(url, kw)
    proxy = CountingProxy(kw["endpoint"])
    try:
        steps = bit_chain(45, (64, 64), 5)
        with driftless.Publisher(url, signing_key=private, anchor_every=100, **kw) as pub:
            for s in range(3):
                pub.publish(s, {"x.w": steps[s].view(BF16)})
            pub.flush()
            old = raw.read("latest.json")
            pub.publish(3, {"x.w": steps[3].view(BF16)})
            pub.flush()
        good = raw.read("latest.json")
        f = driftless.Follower(url, trusted_keys=[public], **{**kw, "endpoint": proxy.endpoint})
        arrays = {"x.w": np.zeros((64, 64), BF16)}
        assert f.apply_to(arrays)["step"] == 3
        assert f.poll() == 3
        for name, bad in (("garbled", b"{not a hint"), ("replayed", old), ("deleted", None)):
            if bad is None:
                raw.delete("latest.json")
            else:
                raw.write("latest.json", bad)
            proxy.take()
            for _ in range(20):
                o = f.apply_to(arrays)
                assert (o["step"], o["route"]) == (3, "up_to_date"), (name, o)
                assert f.poll() == 3, name
            seen = proxy.take()
            # A listing is two LIST requests (anchors, then deltas above the newest anchor).
            listings = len([r for r in seen if "list-type" in r[2]]) / 2
            # 20 calls of each: the first plan and the first poll after the change list, and
            # every 10th of each. The old code: 40 listings.
            assert listings <= 6, (name, listings, len(seen))
            whole = [r for r in seen if r[1].endswith("/latest.json")]
            assert len(whole) <= 40, (name, len(whole))
            raw.write("latest.json", good)
        # A new step with latest.json still bad is found by a listing within 10 calls.
        raw.write("latest.json", b"{not a hint")
        with driftless.Publisher(url, signing_key=private, anchor_every=100, **kw) as pub:
            pub.publish(4, {"x.w": steps[4].view(BF16)})
            pub.flush()
        raw.write("latest.json", b"{still not a hint")
        got = [f.apply_to(arrays)["step"] for _ in range(10)]
        assert got[-1] == 4, got
        assert np.array_equal(bits(arrays["x.w"]), steps[4])
        assert 4 in [f.poll() for _ in range(10)]
    finally:
        proxy.close()
