"""Bearer tokens bound to hosts, read-only and admin roles, settings loading, and TLS, over real HTTP."""

from __future__ import annotations

import httpx
import pytest
from servers import self_signed_cert

from gpuledger.agent.push import HttpPusher, PushError
from gpuledger.collector.auth import Authenticator
from gpuledger.collector.config import ConfigError, load_settings
from gpuledger.collector.server import CollectorServer, tls_context
from gpuledger.collector.store import Store
from gpuledger.schema.records import GpuSample, JobRecord

NOW = 1_700_000_000.0
N1, N2 = "tok-node01-aaaaaaaaaaaa", "tok-node02-bbbbbbbbbbbb"
ADMIN, READ = "tok-admin-cccccccccccc", "tok-read-dddddddddddd"


def batch(seq: int, host: str = "n1", sample_hosts: tuple[str, ...] = ("n1", "n1")) -> dict:
    return {"agent_id": f"agent-{host}", "seq": seq, "host": host, "samples": [
        GpuSample(ts=NOW - 100 + i, host=h, gpu_uuid="GPU-a", gpu_index=0, job_ids=("7",)).to_dict()
        for i, h in enumerate(sample_hosts)]}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def srv(tmp_path):
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW)
    auth = Authenticator({"n1": N1, "n2": N2}, admin_tokens=[ADMIN], read_tokens=[READ])
    s = CollectorServer(store, clock=lambda: NOW, auth=auth, priority_feed=tmp_path / "feed.json").start()
    with httpx.Client(base_url=s.url, timeout=10) as c:
        yield s, c
    s.stop()
    store.close()


def test_identify_is_exact_and_role_bound():
    a = Authenticator({"n1": N1}, admin_tokens=[ADMIN], read_tokens=[READ])
    assert a.identify(f"Bearer {N1}").name == "n1" and a.identify(f"bearer  {ADMIN} ").role == "admin"
    assert a.identify(f"Bearer {READ}").role == "read"
    for bad in (None, "", N1, f"Basic {N1}", f"Bearer {N1}x", f"Bearer {N1[:-1]}", "Bearer "):
        assert a.identify(bad) is None
    assert not Authenticator().enabled and a.enabled


def test_samples_need_the_token_of_their_own_host(srv):
    s, c = srv
    r = c.post("/api/v1/samples", json=batch(1))
    assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
    assert c.post("/api/v1/samples", json=batch(1), headers=bearer("tok-wrong-eeeeeeeeeeee")).status_code == 401
    r = c.post("/api/v1/samples", json=batch(1), headers=bearer(N2))  # n2's token, n1's batch
    assert r.status_code == 403 and "'n1'" in r.json()["error"] and "'n2'" in r.json()["error"]
    # n1's batch host, but one sample claims n2: refused whole, naming the sample
    r = c.post("/api/v1/samples", json=batch(2, sample_hosts=("n1", "n2")), headers=bearer(N1))
    assert r.status_code == 403 and "seq=2" in r.json()["error"] and "sample[1].host" in r.json()["error"]
    for token in (ADMIN, READ):  # only node tokens write samples
        assert c.post("/api/v1/samples", json=batch(3), headers=bearer(token)).status_code == 403
    assert c.get("/api/v1/totals", headers=bearer(READ)).json()["samples"] == 0
    r = c.post("/api/v1/samples", json=batch(1), headers=bearer(N1))
    assert r.status_code == 200 and r.json()["accepted"] == 2
    metrics = c.get("/metrics").text  # public
    assert 'gpuledger_collector_batches_rejected_total{reason="forbidden",status="403"} 4.0' in metrics
    assert 'gpuledger_collector_batches_rejected_total{reason="unauthorized",status="401"} 2.0' in metrics
    assert 'gpuledger_collector_samples_rejected_total{reason="forbidden"} 4.0' in metrics


def test_read_and_admin_roles_on_query_endpoints(srv):
    s, c = srv
    job = [JobRecord("1", cluster="c").to_dict()]
    for path in ("/api/v1/usage", "/api/v1/jobs", "/api/v1/totals", "/api/v1/priority"):
        assert c.get(path).status_code == 401, path
        assert c.get(path, headers=bearer(N1)).status_code == 403, path  # a node token reads nothing
        for token in (READ, ADMIN):
            assert c.get(path, headers=bearer(token)).status_code in (200, 404), path  # 404: no feed yet
    assert c.post("/api/v1/jobs", json=job, headers=bearer(READ)).status_code == 403
    assert c.post("/api/v1/jobs", json=job, headers=bearer(N1)).status_code == 403
    assert c.post("/api/v1/jobs", json=job).status_code == 401
    assert c.post("/api/v1/jobs", json=job, headers=bearer(ADMIN)).json() == {"received": 1, "changed": 1}
    assert [j["job_id"] for j in c.get("/api/v1/jobs", headers=bearer(READ)).json()] == ["1"]
    for path in ("/healthz", "/metrics", "/api/v1/openapi.json"):
        assert c.get(path).status_code == 200, path


def test_pusher_sends_its_token(srv):
    s, c = srv
    p = HttpPusher(s.url + "/api/v1/samples", agent_id="x", host="n1", token=N1, seq_start=9)
    samples = [GpuSample.from_dict(d) for d in batch(0)["samples"]]
    assert p.write(samples) == 9
    bad = HttpPusher(s.url + "/api/v1/samples", agent_id="x", host="n1", token=N2)
    with pytest.raises(PushError) as e:
        bad.write(samples)
    assert e.value.status == 403
    p.close()
    bad.close()


def test_settings_from_file_tokens_file_env_and_flags(tmp_path):
    (tmp_path / "tokens.toml").write_text(f'admin_tokens = ["{ADMIN}"]\n[tokens]\nn2 = "{N2}"\n')
    (tmp_path / "gpuledger.toml").write_text(
        f'cluster = "x"\n[accounting]\npolicy = "blend"\n[collector]\nport = 9000\nwindow_s = 60\n'
        f'tokens_file = "tokens.toml"\n[collector.tokens]\nn1 = "{N1}"\n')
    st = load_settings(tmp_path, env={"GPULEDGER_COLLECTOR_PORT": "9100"}, overrides={"window_s": None, "host": "::1"})
    assert (st.port, st.window_s, st.host) == (9100, 60.0, "::1")
    assert st.tokens == {"n1": N1, "n2": N2} and st.admin_tokens == [ADMIN] and st.auth_enabled
    assert not load_settings(tmp_path / "nothing-here").auth_enabled  # no file, no tokens: auth off


@pytest.mark.parametrize("table,needle", [
    ('port = "many"', "collector.port"),
    ('bogus = 1', "collector.bogus"),
    ('[collector.tokens]\nn1 = "short"', "at least 16"),
    (f'admin_tokens = ["{N1}"]\n[collector.tokens]\nn1 = "{N1}"', "same token"),
    ('tls_cert = "a.pem"', "tls_key"),
    # a deadline or an interval must be a time: an infinite one is none (a dripping client would keep its slot)
    *((f"{key} = inf", f"collector.{key}: Input should be a finite number")
      for key in ("request_timeout_s", "ledger_timeout_s", "idle_timeout_s", "compact_interval_s")),
])
def test_bad_settings_name_the_setting(tmp_path, table, needle):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[collector]\n" + table + "\n")
    with pytest.raises(ConfigError) as e:
        load_settings(tmp_path, cfg, env={})
    assert needle in str(e.value) and str(cfg) in str(e.value)
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path, tmp_path / "missing.toml", env={})


def _self_signed(tmp_path):
    return self_signed_cert(tmp_path)


def test_tls_with_a_self_signed_certificate(tmp_path):
    import ssl

    cert, key = _self_signed(tmp_path)
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, tls=tls_context(cert, key),
                        auth=Authenticator({"n1": N1})).start()
    try:
        assert s.url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=s.url, verify=ctx, timeout=10) as c:
            r = c.post("/api/v1/samples", json=batch(1), headers=bearer(N1))
            assert r.status_code == 200 and r.json()["accepted"] == 2
        with pytest.raises(httpx.ConnectError):  # the system CAs do not vouch for it
            httpx.get(s.url + "/healthz", timeout=5)
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port gets no answer
            httpx.get(s.url.replace("https", "http") + "/healthz", timeout=5)
        p = HttpPusher(s.url + "/api/v1/samples", agent_id="x", host="n1", token=N1, verify=str(cert), seq_start=2)
        p.write([GpuSample.from_dict(d) for d in batch(0)["samples"]])
        p.close()
        with httpx.Client(base_url=s.url, verify=ctx) as c:  # still serving after the failed handshakes
            assert c.get("/healthz").json() == {"status": "ok"}
    finally:
        s.stop()
        store.close()


def test_serve_refuses_a_bad_config_with_exit_2(tmp_path):
    from typer.testing import CliRunner

    from gpuledger.collector.cli import app

    (tmp_path / "gpuledger.toml").write_text('[collector]\ntls_cert = "c.pem"\n')
    r = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "tls_key" in r.output
    r = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path), "--tls-cert", "nope.pem", "--tls-key", "k.pem"])
    assert r.exit_code == 2 and "error" in r.output


@pytest.mark.parametrize("where,table", [
    ("config", '[collector.tokens]\nn1 = "{token}"'),
    ("config", 'admin_tokens = ["{token}"]'),
    ("tokens_file", 'read_tokens = ["{token}"]'),
    ("tokens_file", '[tokens]\nn1 = "{token}"'),
])
@pytest.mark.parametrize("token", ["jeton-s\u00e9curit\u00e9-0123456789", "tab-in-the-token\t0123456789",
                                   "nbsp-in-the-token\u00a00123456789"])
def test_a_token_that_is_not_printable_ascii_is_refused_at_start_without_showing_it(tmp_path, where, table, token):
    # a header is read as latin-1 and a token hashed as UTF-8: such a token could never authenticate
    from typer.testing import CliRunner

    from gpuledger.collector.cli import app

    entry = table.format(token=token.replace("\t", "\\t"))
    config = tmp_path / "gpuledger.toml"
    if where == "config":
        config.write_text(f"[collector]\n{entry}\n")
    else:
        (tmp_path / "tokens.toml").write_text(entry + "\n")
        config.write_text('[collector]\ntokens_file = "tokens.toml"\n')
    with pytest.raises(ConfigError) as e:
        load_settings(tmp_path, env={})
    assert "must be printable ASCII" in str(e.value) and "token" in str(e.value) and token not in str(e.value)
    r = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "must be printable ASCII" in r.output and token not in r.output, r.output
    config.write_text(f'[collector]\n[collector.tokens]\nn1 = "{N1}"\n')  # an ASCII token is taken
    assert load_settings(tmp_path, env={}).tokens == {"n1": N1}


def test_every_scalar_setting_comes_from_the_environment_and_a_misspelt_one_is_refused(tmp_path):
    from gpuledger.collector.config import ConfigError, load_settings

    s = load_settings(tmp_path, env={"GPULEDGER_COLLECTOR_MAX_SAMPLES": "1", "GPULEDGER_COLLECTOR_COMPACTION": "thread",
                                     "GPULEDGER_COLLECTOR_RAW_RETENTION_S": "864000"})
    assert (s.max_samples, s.compaction, s.raw_retention_s) == (1, "thread", 864000.0)
    with pytest.raises(ConfigError, match="GPULEDGER_COLLECTOR_MAX_SAMPLE: no such collector setting"):
        load_settings(tmp_path, env={"GPULEDGER_COLLECTOR_MAX_SAMPLE": "1"})


def test_a_bad_value_names_where_it_came_from(tmp_path):
    from gpuledger.collector.config import ConfigError, load_settings

    config = tmp_path / "gpuledger.toml"
    with pytest.raises(ConfigError) as e:  # no file at all: the error is the environment's
        load_settings(tmp_path, env={"GPULEDGER_COLLECTOR_PORT": "abc"})
    assert str(e.value) == "environment GPULEDGER_COLLECTOR_PORT: collector.port: Input should be a valid integer, " \
                           "unable to parse string as an integer"
    config.write_text("[collector]\nport = 8470\nwindow_s = -1\n")
    with pytest.raises(ConfigError) as e:
        load_settings(tmp_path, env={}, overrides={"max_samples": 0})
    assert str(e.value).startswith(f"{config}: collector.window_s: ") and "command line (max_samples): " \
        "collector.max_samples: " in str(e.value), str(e.value)


# -- node tokens bound to a cluster: "gpu01" of one cluster may not write as another cluster's gpu01 ------------

WEST = "west"


@pytest.fixture
def bound_srv(tmp_path):
    """n1's token bound to cluster west (a table), n2's to its host only (a string), as in one gpuledger.toml."""
    (tmp_path / "gpuledger.toml").write_text(
        f'[collector]\nread_tokens = ["{READ}"]\n[collector.tokens]\n'
        f'n1 = {{ token = "{N1}", cluster = "{WEST}" }}\nn2 = "{N2}"\n')
    st = load_settings(tmp_path, env={})
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW)
    auth = Authenticator(st.tokens, st.admin_tokens, st.read_tokens)  # as collector.worker builds it
    s = CollectorServer(store, clock=lambda: NOW, auth=auth, priority_feed=tmp_path / "feed.json").start()
    with httpx.Client(base_url=s.url, timeout=10) as c:
        yield c
    s.stop()
    store.close()


# Every decoder path: the typed decode of JSON rows, JSON columns and msgpack (binary) columns; JSON rows the
# per-sample path decides (an agent's job record sends a batch there today: the typed decode's hosts are a tuple).
FORMS = ["json rows", "json series", "msgpack series", "json rows + job record", "json rows + job record, per-sample"]


def post_batch(c: httpx.Client, form: str, monkeypatch: pytest.MonkeyPatch, seq: int, host: str = "n1",
               **cluster: str) -> httpx.Response:
    """A batch of ``host``'s GPU running job 7 (with the agent's record of job 7 where ``form`` says so), naming
    ``cluster`` (or none)."""
    import msgpack

    from gpuledger.collector import validate
    from gpuledger.schema.wire import to_series

    doc = batch(seq, host, (host, host)) | cluster
    if "job record" in form:
        doc["jobs"] = [JobRecord("7", user="ann", hosts=(host,)).to_dict()]
    if form.endswith("per-sample"):
        monkeypatch.setattr(validate, "_FAST", None)  # the switch tests/collector/test_validate.py uses
    if "series" in form:
        samples = [GpuSample.from_dict(d) for d in doc.pop("samples")]
        doc["series"] = to_series(samples, host, binary=form.startswith("msgpack"))
    if form.startswith("msgpack"):
        return c.post("/api/v1/samples", content=msgpack.packb(doc), headers={
            **bearer(N1 if host == "n1" else N2), "Content-Type": "application/msgpack"})
    return c.post("/api/v1/samples", json=doc, headers=bearer(N1 if host == "n1" else N2))


def stored(c: httpx.Client) -> tuple[list, list, int]:
    """(cluster, job) of the usage rows and of the job records, and the samples stored, as the API answers."""
    usage = c.get("/api/v1/usage", headers=bearer(READ)).json()
    jobs = c.get("/api/v1/jobs", headers=bearer(READ)).json()
    return (sorted((u["cluster"], u["job_id"]) for u in usage), sorted((j["cluster"], j["job_id"]) for j in jobs),
            c.get("/api/v1/totals", headers=bearer(READ)).json()["samples"])


@pytest.mark.parametrize("form", FORMS)
def test_a_cluster_bound_token_naming_another_cluster_is_refused_and_stores_nothing(bound_srv, form, monkeypatch):
    r = post_batch(bound_srv, form, monkeypatch, 1, cluster="east")
    assert r.status_code == 403, r.text
    assert "field 'cluster' is 'east' but the token is bound to cluster 'west'" in r.json()["error"]
    assert stored(bound_srv) == ([], [], 0)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("none", [{}, {"cluster": ""}], ids=["absent", "empty"])
def test_a_cluster_bound_token_naming_no_cluster_or_its_own_is_stored_under_its_cluster(bound_srv, form, none,
                                                                                        monkeypatch):
    r = post_batch(bound_srv, form, monkeypatch, 1, **none)
    assert r.status_code == 200 and r.json()["accepted"] == 2, r.text
    jobs = [(WEST, "7")] if "job record" in form else []
    assert stored(bound_srv) == ([(WEST, "7")], jobs, 2)  # its GPU's usage and its job record
    r = post_batch(bound_srv, form, monkeypatch, 2, cluster=WEST)
    assert r.status_code == 200, r.text
    assert stored(bound_srv)[:2] == ([(WEST, "7")], jobs)


@pytest.mark.parametrize("form", FORMS)
def test_a_token_bound_to_its_host_only_may_still_name_any_cluster(bound_srv, form, monkeypatch):
    r = post_batch(bound_srv, form, monkeypatch, 1, host="n2", cluster="east")
    assert r.status_code == 200, r.text
    assert stored(bound_srv) == ([("east", "7")], [("east", "7")] if "job record" in form else [], 2)


@pytest.mark.parametrize("where", ["config", "tokens_file"])
@pytest.mark.parametrize("entry,needle", [
    (f'{{ token = "{N1}", cluster = "we\\u0007st" }}', "the cluster of 'n1''s token must be non-empty, a string of "
                                                       "at most 256 characters without control characters"),
    (f'{{ token = "{N1}", cluster = "{"w" * 257}" }}', "the cluster of 'n1''s token must be non-empty"),
    (f'{{ token = "{N1}", cluster = "" }}', "the cluster of 'n1''s token must be non-empty"),
    (f'{{ token = "{N1}" }}', "must be a string or a table { token = \"...\", cluster = \"...\" }, got a table "
                              "with keys ['token']"),
    (f'{{ token = "{N1}", cluster = "{WEST}", host = "n2" }}', "got a table with keys ['cluster', 'host', 'token']"),
    ('{ token = "short", cluster = "west" }', "token of 'n1' must be at least 16 characters"),
])
def test_a_bad_cluster_bound_token_is_refused_at_start_in_one_line_with_exit_2(tmp_path, where, entry, needle):
    from typer.testing import CliRunner

    from gpuledger.collector.cli import app

    config = tmp_path / "gpuledger.toml"
    if where == "config":
        config.write_text(f"[collector]\n[collector.tokens]\nn1 = {entry}\n")
    else:
        (tmp_path / "tokens.toml").write_text(f"[tokens]\nn1 = {entry}\n")
        config.write_text('[collector]\ntokens_file = "tokens.toml"\n')
    r = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and needle in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert N1 not in r.output  # an error never shows a token
    config.write_text(f'[collector]\n[collector.tokens]\nn1 = {{ token = "{N1}", cluster = "{WEST}" }}\n')
    assert load_settings(tmp_path, env={}).tokens["n1"].cluster == WEST
