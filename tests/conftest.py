"""Test-suite root. Without __init__.py files, pytest puts this folder on sys.path (rootdir imports), so any
test can use the shared harness in tests/servers.py: real InfluxDB, VictoriaMetrics and Prometheus servers."""


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _own_config_dir(tmp_path_factory, monkeypatch):
    """Audit signing keys default to the user's config dir: every test gets its own, never the real one."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
    monkeypatch.delenv("GPULEDGER_AUDIT_KEY", raising=False)


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory):
    """One real PostgreSQL cluster for the session (tests.servers.PostgresServer); tests take databases of it."""
    from servers import PostgresServer

    with PostgresServer(tmp_path_factory.mktemp("postgres")) as server:
        yield server


@pytest.fixture
def pg_url(postgres_server):
    """The URL of a fresh, empty PostgreSQL database for this test."""
    return postgres_server.new_database()
