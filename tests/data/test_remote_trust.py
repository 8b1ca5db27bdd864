"""Remote shards across the trust boundary: a command is run only from the user's own command line with
--allow-pipe, never from config.json, a config file or index.json; http(s) goes through visiontune's one HTTP
client, one GET a file, with strict shard names and bounded indexes; brace patterns are counted before any
name is made; an unusable shard cache is one line."""

from __future__ import annotations

import base64
import email.message
import http.server
import json
import os
import shutil
import sys
import threading
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import FAST
from fuzzing import fuzz_settings
from visiontune.cli.commands import main
from visiontune.data import braces, remote, shards
from visiontune.data.sample import make_sample_data
from visiontune.errors import UserError

pytest.importorskip("webdataset")  # `visiontune shard` writes with its ShardWriter


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """6 images in shards of one or two images, with visiontune's index.json."""
    tmp = tmp_path_factory.mktemp("remote")
    make_sample_data(tmp / "data", per_class=3, test_count=0, seed=2)
    assert main(["shard", str(tmp / "data"), "--out", str(tmp / "shards"), "--shard-size", "20KB"]) == 0
    return tmp / "shards"


def _pattern(folder: Path) -> str:
    return f"shards-{{000000..{len(list(folder.glob('*.tar'))) - 1:06d}}}.tar"


@pytest.fixture(autouse=True)
def shard_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VISIONTUNE_SHARD_CACHE", str(tmp_path / "shard-cache"))
    return tmp_path / "shard-cache"


@contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler], host: str = "127.0.0.1"):
    """``handler``'s server on a free port of 127.0.0.1, in a thread: its base URL (named by ``host``)."""

    class Quiet(handler):
        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            # A client that stops reading (visiontune at a size limit) resets the connection mid-answer: what
            # the tests ask for, not the server's error. Whether it comes before the answer is all sent is a
            # race; socketserver would print its traceback to the test's stderr.
            if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
                super().handle_error(request, client_address)

    server = Server(("127.0.0.1", 0), Quiet)
    # Its shutdown waits for the loop's next look at the flag: a fuzz test starts and stops one per example.
    threading.Thread(target=server.serve_forever, args=(0.005,), daemon=True).start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def served(folder: Path):
    """``folder`` over HTTP: the base URL, and every path asked for, in order."""
    asked: list[str] = []

    class Files(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(folder), **kwargs)

        def do_GET(self):
            asked.append(self.path)  # before the answer: the client has it once it has its reply
            super().do_GET()

    with serving(Files) as base:
        yield base, asked


def _one_line(capsys, fetching: bool = False) -> str:
    """The one line on stderr; unless ``fetching`` (a shard download that then fails), nothing was fetched."""
    said = capsys.readouterr()
    lines = said.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in said.err, said.err
    assert fetching or "downloading" not in said.out
    return lines[0]


@pytest.mark.slow
def test_a_run_folder_whose_config_json_names_a_command_never_runs_it(trained_run, tmp_path, capsys):
    """The PoC: evaluate --run RUN, RUN/config.json's data a pipe: command. One line, exit 2, nothing run,
    with --allow-pipe too (it lets only the command line's own --data run)."""
    run = Path(shutil.copytree(trained_run, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints")))
    pwned = tmp_path / "PWNED"
    record = json.loads((run / "config.json").read_text())
    record["data"]["root"] = record["data"]["source"] = f"pipe:touch {pwned}; cat shards-000000.tar"
    (run / "config.json").write_text(json.dumps(record))
    for extra in ([], ["--allow-pipe"]):
        assert main(["evaluate", "--run", str(run), "--no-progress", *extra]) == 2
        line = _one_line(capsys)
        assert f"{run / 'config.json'} gives a command as the data" in line and "--allow-pipe" in line
        assert not pwned.exists() and not (run / "eval.json").exists()


def test_a_command_in_a_config_file_is_never_run(tmp_path, capsys):
    pwned = tmp_path / "PWNED"
    toml = tmp_path / "run.toml"
    toml.write_text(f'data = "pipe:touch {pwned}; cat shards-000000.tar"\n')
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps({"config": {"data": f"pipe:touch {pwned}; cat shards-000000.tar"}}))
    for config in (toml, config_json):
        out = tmp_path / f"run-{config.suffix[1:]}"
        assert main(["train", "--config", str(config), "--allow-pipe", "--output-dir", str(out), *FAST]) == 2
        assert f"{config} gives a command as the data" in _one_line(capsys)
        assert not pwned.exists() and not out.exists()


def test_a_pipe_command_on_the_command_line_without_allow_pipe_is_one_line_and_runs_nothing(
    sharded, shard_cache, tmp_path, capsys
):
    ran = tmp_path / "ran"
    for data in (f"pipe:touch {ran}; cat {sharded}/{_pattern(sharded)}", f"pipe:touch {ran}; cat x.tar"):
        for command in (["check", data], ["train", "--data", data, *FAST]):
            assert main(command) == 2
            line = _one_line(capsys)
            assert "a pipe: command is run only when given on this command line together with --allow-pipe" in line
    assert not ran.exists() and not shard_cache.exists()


@pytest.mark.slow  # (the pipe: command's shells)
def test_a_pipe_command_on_the_command_line_runs_with_allow_pipe(sharded, shard_cache, tmp_path, capsys):
    ran = tmp_path / "ran"
    command = f"pipe:touch {ran}; cat {sharded}/{_pattern(sharded)}"
    assert main(["check", command, "--allow-pipe", "--report", str(tmp_path / "bad.csv")]) == 0
    assert ran.exists() and "6 images in 2 classes" in capsys.readouterr().out
    (copies,) = shard_cache.iterdir()
    local = sorted(p.name for p in sharded.iterdir())
    assert sorted(p.name for p in copies.iterdir()) == local  # each shard and index.json, whole
    assert all((copies / n).read_bytes() == (sharded / n).read_bytes() for n in local)
    # A later command without the flag runs nothing, even with the copies in the cache.
    ran.unlink()
    assert main(["check", command]) == 2 and "--allow-pipe" in _one_line(capsys) and not ran.exists()


def test_a_folder_url_fetches_the_index_and_each_listed_shard_once_and_reads_as_the_local_shards(sharded):
    local = shards.read(str(sharded))
    with served(sharded) as (base, asked):
        fetched = shards.read(f"{base}/")
        assert sorted(asked) == sorted(f"/{p.name}" for p in sharded.iterdir())  # one GET a file
        asked.clear()
        again = shards.read(f"{base}/")
        assert asked == []  # from the cache
    for got in (fetched, again):
        assert (got.classes, got.labels.tolist()) == (local.classes, local.labels.tolist())
        assert [got.reader[i] for i in range(len(got))] == [local.reader[i] for i in range(len(local))]


@pytest.mark.parametrize(
    "name",
    [
        "x[1-100000000].tar",  # curl's URL globbing: 14,663 GETs in 40 s before
        "x{1..100000000}.tar",
        "x*.tar",
        "../x.tar",
        "sub/x.tar",
        "http://elsewhere/x.tar",
        "pipe:touch PWNED; cat x.tar",
        "%2e%2e%2fx.tar",
        "-x.tar",
        7,
    ],
)
def test_an_index_listing_anything_but_a_plain_shard_name_is_one_line_after_one_request(tmp_path, name, capsys):
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "index.json").write_text(json.dumps({"shardlist": [{"url": name, "nsamples": 1}]}))
    with served(tmp_path / "set") as (base, asked):
        assert main(["check", f"{base}/"]) == 2
        assert asked == ["/index.json"]
    assert f"{base}/index.json lists {name!r}" in _one_line(capsys)
    assert not (tmp_path / "PWNED").exists() and list(tmp_path.iterdir()) == [tmp_path / "set"]


def test_an_index_of_too_many_shards_or_too_many_bytes_is_one_line_after_one_request(tmp_path, monkeypatch, capsys):
    (tmp_path / "set").mkdir()
    index = {"shardlist": [{"url": f"s-{i}.tar"} for i in range(braces.MAX_NAMES + 1)]}
    (tmp_path / "set" / "index.json").write_text(json.dumps(index))
    with served(tmp_path / "set") as (base, asked):
        assert main(["check", f"{base}/"]) == 2
        assert "lists 100,001 shards, more than the 100,000" in _one_line(capsys)
        assert asked == ["/index.json"]
        monkeypatch.setattr(remote, "MAX_INDEX_BYTES", 1000)
        asked.clear()
        assert main(["check", f"{base}/"]) == 2
        assert f"{base}/index.json is larger than" in _one_line(capsys)
        assert asked == ["/index.json"]


@pytest.mark.parametrize("pattern", ["{0..9999999999}", "{0..999}{0..999}{0..999}"])
def test_brace_patterns_of_billions_of_names_are_refused_before_any_name_is_made(pattern, capsys):
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match=r"names 1[0,]+ shards, more than the 100,000 visiontune reads"):
            braces.expand(f"shards-{pattern}.tar")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # (a list of 10^6 names alone is 870 MB)
    for data in (f"/nowhere/shards-{pattern}.tar", f"http://127.0.0.1:9/set/shards-{pattern}.tar"):
        assert main(["check", data]) == 2
        assert "more than the 100,000 visiontune reads" in _one_line(capsys)


def test_brace_patterns_name_what_the_shell_names_in_its_order():
    assert braces.expand("a{1..3}b{x,y}.tar") == [f"a{i}b{c}.tar" for i in "123" for c in "xy"]
    assert braces.expand("s-{08..10}.tar") == ["s-08.tar", "s-09.tar", "s-10.tar"]
    assert braces.expand("{x{1,2},y}-{a,b}") == ["x1-a", "x1-b", "x2-a", "x2-b", "y-a", "y-b"]
    assert braces.expand("plain.tar") == ["plain.tar"] and braces.expand("open{.tar") == ["open{.tar"]


def test_a_shard_cache_that_is_a_file_is_one_line(sharded, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "passwd"
    cache.write_text("root:x:0:0::/root:/bin/sh\n")
    monkeypatch.setenv("VISIONTUNE_SHARD_CACHE", str(cache))
    with served(sharded) as (base, _):
        assert main(["check", f"{base}/{_pattern(sharded)}"]) == 2
    assert f"cannot keep shards in {cache} (Not a directory); set VISIONTUNE_SHARD_CACHE" in _one_line(capsys)
    assert cache.read_text() == "root:x:0:0::/root:/bin/sh\n"


@pytest.mark.parametrize("attack", ["world-writable", "another-users"])
def test_a_shard_cache_another_user_may_write_in_is_refused_before_any_request(
    sharded, tmp_path, monkeypatch, capsys, attack
):
    cache = tmp_path / "shards"
    cache.mkdir()
    if attack == "world-writable":
        cache.chmod(0o777)
    else:
        os.chown(cache, 12345, 12345)
    monkeypatch.setenv("VISIONTUNE_SHARD_CACHE", str(cache))
    with served(sharded) as (base, seen):
        assert main(["check", f"{base}/{_pattern(sharded)}"]) == 2
        assert seen == []  # refused before the index was asked for
    line = _one_line(capsys)
    assert str(cache) in line and "VISIONTUNE_SHARD_CACHE" in line
    assert ("every user" in line) if attack == "world-writable" else ("another user" in line)
    assert list(cache.iterdir()) == []


def test_command_run_schemes_and_gsutil_wildcards_are_not_opened(capsys):
    assert main(["check", "scp://host/set/shards-000000.tar"]) == 2
    assert "read scp:// through a command you trust: --data 'pipe:COMMAND' --allow-pipe" in _one_line(capsys)
    assert main(["check", "gs://bucket/set/shards-*.tar"]) == 2
    assert "gsutil would read * ? [ ] as wildcards" in _one_line(capsys)


def test_hf_urls_are_fetched_from_the_hub_with_the_users_token(monkeypatch):
    """The Hub's download URL (revision included) and huggingface_hub's headers, the token among them; that
    the token never follows a redirect to another host is the test below, on real redirects."""
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    url, headers = remote._hub("hf://datasets/org/set@v1.0/shards/shards-000000.tar")
    assert url.endswith("/datasets/org/set/resolve/v1.0/shards/shards-000000.tar")
    assert {k.lower(): v for k, v in headers.items()}["authorization"] == "Bearer hf_secret"
    with pytest.raises(UserError, match="hf://datasets/ORG/NAME"):
        remote._hub("hf://one-part.tar")


class Redirects(http.server.BaseHTTPRequestHandler):
    """``/hop/N/NAME`` redirects to ``/hop/N+1/NAME``, anything else to a file:// URL."""

    asked: list[str] = []

    def do_GET(self):
        self.asked.append(self.path)
        _, kind, n, name = self.path.split("/")
        self.send_response(302)
        self.send_header("Location", f"/hop/{int(n) + 1}/{name}" if kind == "hop" else "file:///etc/passwd")
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_redirects_are_followed_five_times_at_most_and_only_to_http(shard_cache, capsys):
    with serving(Redirects) as base:
        assert main(["check", f"{base}/hop/0/x.tar"]) == 2
        line = _one_line(capsys, fetching=True)
        assert f"cannot download {base}/hop/0/x.tar (the server answered HTTP 302: more than 5 redirects" in line
        for name in ("index.json", "x.tar"):  # each: the GET and 5 redirects
            assert [p for p in Redirects.asked if p.endswith(name)] == [f"/hop/{i}/{name}" for i in range(6)]
        assert main(["check", f"{base}/file/0/x.tar"]) == 2
        assert "or one to a URL that is not http(s)" in _one_line(capsys, fetching=True)
    assert list(shard_cache.rglob("*")) == []  # nothing fetched, no folder left for the URL


def test_the_hub_token_goes_to_the_hub_host_and_never_along_a_redirect_to_another(sharded, monkeypatch):
    """hf:// through the one HTTP client: the token on the Hub's host (a same-host redirect included), not on
    the file store's host it redirects to; the shard arrives whole."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    seen: dict[str, str | None] = {}
    shard = next(iter(sorted(sharded.glob("*.tar"))))

    class Store(http.server.BaseHTTPRequestHandler):  # the file store: answers a signed URL
        def do_GET(self):
            seen[f"store{self.path}"] = self.headers.get("Authorization")
            body = shard.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serving(Store, host="localhost") as store:

        class Hub(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                seen[f"hub{self.path}"] = self.headers.get("Authorization")
                where = f"{store}/signed/{shard.name}" if self.path.startswith("/moved/") else f"/moved{self.path}"
                self.send_response(404 if "index.json" in self.path else 302)
                self.send_header("Location", where)
                self.send_header("Content-Length", "0")
                self.end_headers()

        with serving(Hub) as hub:
            monkeypatch.setattr(huggingface_hub, "hf_hub_url", lambda repo, name, **kw: f"{hub}/{repo}/{name}")
            monkeypatch.setenv("HF_TOKEN", "hf_secret")
            local = remote.fetch(f"hf://datasets/org/set/{shard.name}")
    assert Path(local).read_bytes() == shard.read_bytes()
    assert seen == {
        "hub/org/set/index.json": "Bearer hf_secret",
        f"hub/org/set/{shard.name}": "Bearer hf_secret",
        f"hub/moved/org/set/{shard.name}": "Bearer hf_secret",  # the same host: still the Hub
        f"store/signed/{shard.name}": None,
    }


@contextmanager
def faulty(body: bytes, faults: list):
    """A server answering a path with ``body`` (index.json, and a path with ``nowhere`` in it: 404), its first
    GETs with ``faults`` in turn (a status, or "drop": half the body, then the connection closed): the base URL,
    and the GETs of anything but an index."""
    asked: list[str] = []

    class Faulty(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if not self.path.endswith("index.json"):
                asked.append(self.path)
            if self.path.endswith("index.json") or "nowhere" in self.path:
                self.send_error(404)
                return
            fault = faults.pop(0) if faults else None
            if isinstance(fault, int):
                self.send_error(fault)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2] if fault == "drop" else body)
            self.close_connection = fault == "drop"

    with serving(Faulty) as base:
        yield base, asked


def test_a_5xx_429_or_a_dropped_connection_is_retried_and_the_shard_comes_whole(sharded, monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    shard = sorted(sharded.glob("*.tar"))[0]
    with faulty(shard.read_bytes(), [503, "drop", 429]) as (base, asked):
        local = remote.fetch(f"{base}/{shard.name}")
    assert Path(local).read_bytes() == shard.read_bytes()
    assert asked == [f"/{shard.name}"] * 4


def test_a_server_failing_on_every_retry_is_one_line_naming_the_url(sharded, shard_cache, monkeypatch, capsys):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    shard = sorted(sharded.glob("*.tar"))[0]
    with faulty(shard.read_bytes(), [503] * 10) as (base, asked):
        assert main(["check", f"{base}/{shard.name}"]) == 2
        line = _one_line(capsys, fetching=True)
        assert f"cannot download {base}/{shard.name} (the server answered HTTP 503 Service Unavailable)" in line
        assert len(asked) == remote.RETRIES
        asked.clear()
        assert main(["check", f"{base}/nowhere/{shard.name}"]) == 2  # a 404: not asked again
        assert "(the server answered HTTP 404 Not Found)" in _one_line(capsys, fetching=True)
        assert asked == [f"/nowhere/{shard.name}"]
    assert list(shard_cache.rglob("*")) == []


def test_a_shard_longer_than_its_index_says_is_cut_off_and_refused(sharded, shard_cache, tmp_path, capsys):
    """A server sending 64 MiB where the index says 1,000 bytes: the copy stops soon after 1,000 bytes came."""
    sent = []

    class Endless(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.endswith("index.json"):
                body = json.dumps({"shardlist": [{"url": "big.tar", "filesize": 1000}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(64 << 20))
            self.end_headers()
            for _ in range(64 << 4):
                self.wfile.write(bytes(64 << 10))
                sent.append(64 << 10)

    with serving(Endless) as base:
        assert main(["check", f"{base}/"]) == 2
        line = _one_line(capsys, fetching=True)
    assert f"{base}/big.tar: more than 1000 bytes came where its index.json says 1000" in line
    assert sum(sent) < 16 << 20  # (what the sockets' buffers hold besides)
    assert not list(shard_cache.rglob("*.tar"))


@contextmanager
def recording(body: bytes):
    """A server answering any path with ``body`` (index.json: 404): the base URL, and each request's path (as
    asked: a proxy is asked for a whole URL) with its headers."""
    asked: list[tuple[str, email.message.Message]] = []

    class Recording(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append((self.path, self.headers))  # (its get: any case)
            if self.path.endswith("index.json"):
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serving(Recording) as base:
        yield base, asked


@pytest.fixture
def no_proxy_env(monkeypatch):
    """No proxy but the test's own: the machine's variables would send its requests elsewhere."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


def test_a_netrc_login_is_never_sent_to_a_shard_url_or_beside_the_hub_token(
    sharded, tmp_path, monkeypatch, no_proxy_env
):
    """aiohttp's ``trust_env`` (for the proxy variables) also sends the ``~/.netrc`` login of a URL's host: a
    URL from a run folder or an index would get the user's password, in clear text over http://. None goes;
    the Hub's token goes alone (aiohttp refuses a netrc login beside an Authorization header: a crash)."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login alice password s3cret\nmachine localhost login alice password s3cret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    shard = sorted(sharded.glob("*.tar"))[0]
    with recording(shard.read_bytes()) as (base, asked):
        assert Path(remote.fetch(f"{base}/{shard.name}")).read_bytes() == shard.read_bytes()
        assert [(path, headers.get("Authorization")) for path, headers in asked] == [
            ("/index.json", None),
            (f"/{shard.name}", None),
        ]
        asked.clear()
        monkeypatch.setattr(huggingface_hub, "hf_hub_url", lambda repo, name, **kw: f"{base}/hub/{repo}/{name}")
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        assert Path(remote.fetch(f"hf://datasets/org/set/{shard.name}")).read_bytes() == shard.read_bytes()
        assert [(path, headers.get("Authorization")) for path, headers in asked] == [
            ("/hub/org/set/index.json", "Bearer hf_secret"),
            (f"/hub/org/set/{shard.name}", "Bearer hf_secret"),
        ]


def test_shard_urls_go_through_the_environments_proxy_with_its_login_unless_no_proxy_names_the_host(
    sharded, monkeypatch, no_proxy_env
):
    shard = sorted(sharded.glob("*.tar"))[0]
    with recording(shard.read_bytes()) as (proxy, asked):
        port = proxy.rsplit(":", 1)[1]
        monkeypatch.setenv("http_proxy", f"http://carol:pa55@127.0.0.1:{port}")
        local = remote.fetch(f"http://shards.invalid/set/{shard.name}")  # (a name only the proxy answers)
        assert Path(local).read_bytes() == shard.read_bytes()
        assert [path for path, _ in asked] == [
            "http://shards.invalid/set/index.json",
            f"http://shards.invalid/set/{shard.name}",
        ]
        login = "Basic " + base64.b64encode(b"carol:pa55").decode()
        assert [headers.get("Proxy-Authorization") for _, headers in asked] == [login, login]
        with recording(shard.read_bytes()) as (direct, direct_asked):
            monkeypatch.setenv("no_proxy", "127.0.0.1")
            remote.fetch(f"{direct}/{shard.name}")
        assert len(asked) == 2 and [path for path, _ in direct_asked] == ["/index.json", f"/{shard.name}"]


# A shard's name is its copy's file in the cache folder: from an index or a brace pattern (a URL from a run's
# config.json or a config file too), one that cannot be one file there is one line, before any shard is asked
# for. Before: OSError (name too long) or ValueError (a NUL) out of the copy's open, a traceback.
def test_an_index_listing_a_name_too_long_for_a_file_is_one_line_after_one_request(tmp_path, shard_cache, capsys):
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "index.json").write_text(json.dumps({"shardlist": [{"url": "a" * 300 + ".tar"}]}))
    with served(tmp_path / "set") as (base, asked):
        assert main(["check", f"{base}/"]) == 2
        assert asked == ["/index.json"]
    line = _one_line(capsys)
    assert f"{base}/index.json lists 'aaa" in line and f"at most {remote.MAX_SHARD_NAME} characters" in line
    assert list(shard_cache.rglob("*.tar")) == []


@pytest.mark.parametrize("name", ["a\x00b.tar", "b" * 300 + ".tar", "{x,\x07}.tar", "\udcff.tar"])
def test_a_pattern_naming_a_shard_that_cannot_be_a_file_is_one_line_before_any_request(name, shard_cache, capsys):
    with served(shard_cache.parent) as (base, asked):
        with pytest.raises(UserError) as e:
            remote.fetch(f"{base}/set/{name}")
        assert asked == []
    said = str(e.value)
    assert "cannot be a file of the shard cache" in said and "\n" not in said and not shard_cache.exists()


def test_a_cached_index_larger_than_a_download_may_be_is_one_line(sharded, shard_cache, monkeypatch, capsys):
    with served(sharded) as (base, _):
        folder = remote.fetch(f"{base}/")  # the shards and index.json, cached
        capsys.readouterr()
        monkeypatch.setattr(remote, "MAX_INDEX_BYTES", 100)
        assert main(["check", f"{base}/"]) == 2
    assert f"{folder}/index.json is damaged (larger than 100 bytes); delete it" in _one_line(capsys)


class Listing(http.server.BaseHTTPRequestHandler):
    """Answers any ``.../index.json`` with ``body`` and anything else with 404; keeps every path asked for."""

    body = b""
    asked: list[str] = []

    def do_GET(self):
        self.asked.append(self.path)
        body = type(self).body if self.path.endswith("/index.json") else b""
        self.send_response(200 if self.path.endswith("/index.json") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


PLAIN = st.sampled_from(["a.tar", "s-000.tar", "b" * 196 + ".tar", "a" * 300 + ".tar"])  # short and long
SHARD_ENTRY = st.one_of(
    PLAIN,
    PLAIN,  # (twice: a listing of plain names alone, within reach)
    st.sampled_from(["../x.tar", "x/y.tar", ".tar", "a\x00.tar", "é.tar", "*.tar", "%2e.tar", "\udcff.tar"]),
    st.text(max_size=12),
    st.integers() | st.none(),
)
INDEXES = st.one_of(
    st.binary(max_size=200),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda c: st.lists(c) | st.dictionaries(st.text(max_size=6), c),
    ).map(lambda v: json.dumps(v).encode()),
    st.lists(
        SHARD_ENTRY | st.fixed_dictionaries({"url": SHARD_ENTRY}, optional={"filesize": st.integers() | st.text()}),
        min_size=1,
        max_size=3,
    ).map(lambda shards: json.dumps({"shardlist": shards}).encode()),
)


@fuzz_settings(100)
@given(INDEXES)
def test_fuzz_any_bytes_as_a_folder_urls_index_give_plain_shards_in_the_cache_or_one_line(tmp_path_factory, raw):
    """Whatever a server answers for index.json: the shards it lists, each asked for once by its plain name beside
    the index and kept in the URL's cache folder, or one line -- never another exception, never a request or a
    file outside them."""
    cache = tmp_path_factory.mktemp("cache")
    Listing.body, Listing.asked = raw, []
    with serving(Listing) as base, pytest.MonkeyPatch.context() as mp:
        mp.setenv("VISIONTUNE_SHARD_CACHE", str(cache))
        try:
            folder = remote.fetch(f"{base}/set/")
        except UserError as e:
            assert str(e) and "\n" not in str(e)
            folder = None
    for path in Listing.asked:  # the index, then each shard it lists by its plain name
        assert path == "/set/index.json" or (path.startswith("/set/") and remote._NAME.fullmatch(path[5:])), path
    for file in cache.rglob("*"):  # nothing outside the URL's own folder of the cache
        assert file.parent == cache or file.parent.parent == cache, file
    if folder is not None:  # a listing with no shards to fetch: the folder, its index kept
        assert Path(folder).parent == cache and Listing.asked == ["/set/index.json"]


@fuzz_settings(200)
@given(st.text(st.characters(codec="utf-8") | st.sampled_from(list("{},..-/%?#\\")), max_size=24))
def test_fuzz_any_text_as_a_shard_pattern_names_files_of_the_cache_folder_or_is_one_line(text):
    """A URL's brace pattern (its last ``.tar`` word) names files of the cache folder, each beside the index it
    is fetched with, or is one line."""
    data = f"http://127.0.0.1:9/set/{text}.tar"
    try:
        index_url, urls, pattern = remote.named(data)
    except UserError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert index_url.endswith(remote.INDEX)
    if urls is None:  # no word ending .tar: a folder URL, whose index names its shards
        assert pattern is None
        return
    assert pattern.endswith(".tar") and len(urls) >= 1
    folder = "/cache/0123456789abcdef"
    for name, url in urls.items():
        assert os.path.dirname(os.path.normpath(os.path.join(folder, name))) == folder, name
        assert len(name.encode()) <= remote.MAX_SHARD_NAME and name.isprintable() and url.endswith(name)
