"""Every command as an operator meets it through the `gpuledger` entry point (gpuledger.cli.run, what the script
runs): a bad flag, a missing file or directory, an unknown id, and output into a pipe. Errors are exactly one
line on stderr (`error: ...`), exit 2 for bad input and 1 for a failure, never a traceback; tables in a pipe are
whole (no `…`, full UUIDs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer

from gpuledger.cli import app, run
from gpuledger.demo import run_demo
from gpuledger.output import unexpected


def leaf_commands() -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []

    def walk(cmd, path: tuple[str, ...]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, path + (name,))
        if not subs or getattr(cmd, "invoke_without_command", False):
            out.append(path)

    walk(typer.main.get_command(app), ())
    return sorted(set(out))


COMMANDS = leaf_commands()


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli") / "data"
    run_demo(d, nodes=1, gpus_per_node=4, hours=0.1, step_s=10, seed=4)
    return d


def call(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = run([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_the_walk_finds_every_command() -> None:
    assert {("demo",), ("agent", "run"), ("collector", "serve"), ("fairshare",), ("priority", "feed"),
            ("report", "usage"), ("jobs", "import"), ("audit", "verify")} <= set(COMMANDS)
    assert len(COMMANDS) >= 22


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_bad_flag_is_one_line_exit_2(capsys, path: tuple[str, ...]) -> None:
    code, out, err = call(capsys, *path, "--no-such-flag")
    assert code == 2 and out == ""
    line = one_error_line(err)
    assert "No such option: --no-such-flag" in line and f"gpuledger {' '.join(path)}" in line


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_bad_value_is_one_line_exit_2(capsys, path: tuple[str, ...]) -> None:
    # --format yaml where a command has --format, else --data-dir without its value
    code, out, err = call(capsys, *path, "--format", "yaml") if path not in NO_FORMAT else call(
        capsys, *path, "--data-dir")
    assert code == 2 and out == ""
    one_error_line(err)


def float_options() -> list[tuple[tuple[str, ...], str, list[str]]]:
    """(command, option, the other arguments it requires) for every option any command takes a number for."""
    out = []

    def walk(cmd, path: tuple[str, ...]) -> None:
        for p in cmd.params:
            if getattr(getattr(p, "type_descriptor", None), "annotation", None) is float:
                required = [x for q in cmd.params if q.required and q is not p
                            for x in (("x",) if q.param_type_name == "argument" else (q.opts[0], "1"))]
                out.append((path, p.opts[0], required + (["--data-dir"] if any(
                    "--data-dir" in q.opts for q in cmd.params) else [])))
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, path + (name,))

    walk(typer.main.get_command(app), ())
    return out


FLOAT_OPTIONS = float_options()


def test_the_walk_finds_the_number_options() -> None:
    assert {(("jobs", "import"), "--since"), (("priority", "watch"), "--poll"), (("demo",), "--step"),
            (("agent", "run"), "--interval"), (("collector", "series"), "--start")} <= {
        (path, opt) for path, opt, _ in FLOAT_OPTIONS}


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize(("path", "opt", "required"), FLOAT_OPTIONS, ids=lambda x: " ".join(x) if x else "")
def test_no_number_option_takes_nan_or_an_infinity(capsys, tmp_path: Path, path, opt, required, value) -> None:
    # a poll of NaN seconds never fired (`priority watch` ran on, idle), `jobs import --since inf` and `demo --step
    # inf` ended in a traceback: one rule, checked before any command runs
    data_dir = [tmp_path / "d"] if required[-1:] == ["--data-dir"] else []
    code, out, err = call(capsys, *path, *required, *data_dir, opt, value)
    assert code == 2 and out == "", (code, out, err)
    # (an option with a range says so first: NaN and the infinities are outside it)
    line = one_error_line(err)
    assert f"Invalid value for '{opt}': must be a finite number, got {float(value)}" in line or (
        f"Invalid value for '{opt}': Input should be" in line), line
    assert not (tmp_path / "d").exists()


def test_jobs_import_since_is_a_window_back_from_now(capsys, tmp_path: Path) -> None:
    for since in ("0", "-5", "1e9"):
        code, _, err = call(capsys, "jobs", "import", "--slurm", "--since", since, "--data-dir", tmp_path)
        assert code == 2 and f"--since must be hours in (0, 876600], got {float(since):g}" in one_error_line(err)


# Commands without --format take a value-less --data-dir as their bad value instead.
NO_FORMAT = {("agent", "run"), ("collector", "serve"), ("collector", "series"), ("collector", "totals"),
             ("collector", "compact"), ("jobs", "import"), ("priority", "apply"), ("audit", "verify"),
             ("audit", "record"), ("audit", "retention"), ("audit", "keygen"), ("demo",),
             ("dashboards", "export"), ("priority", "watch")}


def missing_cases(tmp: Path) -> list[tuple[tuple[str, ...], int, str]]:
    nowhere = tmp / "nowhere"
    return [
        (("collector", "usage", "--data-dir", nowhere), 2, "no gpuledger store at"),
        (("collector", "totals", "--data-dir", nowhere), 2, "no gpuledger store at"),
        (("collector", "compact", "--data-dir", nowhere), 2, "no gpuledger store at"),
        (("collector", "series", "h", "u", "--start", "-60", "--data-dir", nowhere), 2, "no gpuledger store at"),
        (("collector", "serve", "--data-dir", tmp, "--config", nowhere / "c.toml", "--port", "0"), 2, "not found"),
        (("jobs", "list", "--data-dir", nowhere), 2, "no gpuledger store"),
        (("jobs", "import", "--data-dir", tmp, "--sacct-json", nowhere / "s.json"), 2,
         f"{nowhere / 's.json'}: No such file or directory"),
        (("fairshare", "--data-dir", tmp, "--associations", nowhere / "a.txt", "--usage", nowhere / "u.csv"), 2,
         "No such file or directory"),
        (("fairshare", "--data-dir", tmp, "--config", nowhere / "c.toml"), 2, "configuration file not found"),
        (("priority", "feed", "--data-dir", nowhere), 2, "no association tree"),
        (("report", "usage", "--data-dir", nowhere), 2, "no gpuledger store"),
        (("report", "jobs", "--data-dir", nowhere), 2, "no gpuledger store"),
        (("report", "idle", "--data-dir", nowhere), 2, "no gpuledger store"),
        (("report", "job", "1", "--data-dir", nowhere), 2, "no gpuledger store"),
        (("agent", "run", "--source", "simulated", "--metrics-port", "0", "--duration", "1", "--collector",
          "http://127.0.0.1:1/api/v1/samples", "--token-file", nowhere / "token"), 2, "--token-file"),
        (("demo", "--data-dir", Path(__file__)), 2, "is not a directory"),
        (("dashboards", "export", Path(__file__)), 2, f"{Path(__file__)}: exists and is not a directory"),
    ]


def test_missing_files_and_dirs_are_one_line_and_create_nothing(capsys, tmp_path: Path) -> None:
    for argv, want_code, needle in missing_cases(tmp_path):
        code, out, err = call(capsys, *argv)
        assert code == want_code, (argv, out, err)
        assert needle in one_error_line(err), (argv, err)
        assert not (tmp_path / "nowhere").exists(), argv  # nothing created on the way to the error
    assert not (tmp_path / "gpuledger.sqlite").exists()


# A site's data dir whose ledger is elsewhere ([ledger] url): no gpuledger.sqlite, but the names a demo writes.
SITE_FILES = {"audit.sqlite": b"the site's audit log", "priority-feed.json": b'{"site": "live feed"}',
              "usage-report.txt": b"signed Q3 report", "usage-report.txt.manifest.json": b'{"sig": "..."}',
              "gpuledger.toml": b'[ledger]\nurl = "postgresql://gpuledger@db.example.org/gpuledger"\n'}


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("files", [SITE_FILES, {"gpuledger.toml": b'cluster = "prod"\n'},
                                   {"audit.sqlite": b"a log"}, {"notes.txt": b"mine"}],
                         ids=["site data dir", "a config", "an audit log", "any file"])
def test_demo_refuses_a_dir_it_did_not_make_and_touches_nothing(capsys, tmp_path: Path, files) -> None:
    d = tmp_path / "prod"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    before = _tree(d)
    for _ in range(2):  # a second try finds the directory as it was, not half a demo's
        code, out, err = call(capsys, "demo", "--data-dir", d, "--nodes", "1", "--gpus", "1", "--hours", "0.05")
        assert (code, out) == (2, "")
        assert f"{d} holds files the demo did not write" in one_error_line(err)
        assert _tree(d) == before


def test_demo_takes_an_empty_dir(capsys, tmp_path: Path) -> None:
    code, out, err = call(capsys, "demo", "--data-dir", tmp_path, "--nodes", "1", "--gpus", "1", "--hours", "0.05")
    assert code == 0, err
    assert (tmp_path / ".gpuledger-demo").exists() and (tmp_path / "priority-feed.json").exists()


def test_agent_flags_are_checked_at_startup_naming_the_flag(capsys, tmp_path: Path) -> None:
    not_pem, empty, blank = tmp_path / "ca.pem", tmp_path / "empty.token", tmp_path / "blank.token"
    binary = tmp_path / "binary.token"  # not UTF-8: it ended 'unexpected UnicodeDecodeError'
    binary.write_bytes(b"\xff\xfe")
    not_pem.write_text("not a certificate\n")
    empty.write_text("")
    blank.write_text(" \n\t\n")
    base = ("agent", "run", "--source", "simulated", "--duration", "1", "--spool-dir", tmp_path / "spool",
            "--collector", "https://127.0.0.1:1")
    for extra, flag in [(("--ca-cert", not_pem), "--ca-cert"), (("--metrics-port", "18999999"), "--metrics-port"),
                        (("--metrics-port", "-1"), "--metrics-port"), (("--token-file", empty), "--token-file"),
                        (("--token-file", blank), "--token-file"),
                        (("--token-file", binary), f"--token-file: {binary}: not UTF-8 text")]:
        argv = [*base, "--metrics-port", "0", *extra]
        code, out, err = call(capsys, *argv)
        assert (code, out) == (2, ""), (extra, err)
        assert flag in one_error_line(err), (extra, err)
        assert not (tmp_path / "spool").exists(), extra  # refused before the spool is made


def test_unknown_ids_say_so_and_exit_2(capsys, demo_dir: Path) -> None:
    d = ("--data-dir", demo_dir)
    for argv, needle in [
        (("collector", "usage", "--job", "99999", *d), "job 99999: no measurements"),
        (("collector", "series", "node01", "GPU-00000000-0000-0000-0000-000000000000", "--start", "-600", *d),
         "no GPU GPU-00000000-0000-0000-0000-000000000000 on host 'node01'"),
        (("collector", "series", "node09", "GPU-x", "--start", "-600", *d), "no GPU GPU-x on host 'node09'"),
        (("report", "job", "99999", *d), "job 99999"),
        (("audit", "explain", "99999", *d), "job 99999: no audit entry names it"),
        # sizes the log never had are a wrong question: not "TAMPERED" (exit 1) of an intact log
        (("audit", "proof", "--since", "999999", *d), "--since 999999: the log has"),
        (("audit", "proof", "--since", "-3", *d), "--since -3: the log has"),
        (("audit", "proof", "--entry", "0", *d), "--entry 0: no such entry"),
    ]:
        code, out, err = call(capsys, *argv)
        assert code == 2 and out == "" and needle in one_error_line(err), (argv, err)


def test_bad_periods_and_empty_periods(capsys, demo_dir: Path) -> None:
    code, out, err = call(capsys, "report", "usage", "--data-dir", demo_dir, "--period", "26-11")
    assert code == 2 and "period '26-11'" in one_error_line(err)
    code, out, err = call(capsys, "report", "usage", "--data-dir", demo_dir, "--period", "2001-01", "--format", "json")
    assert code == 0 and json.loads(out)["total"]["jobs"] == 0
    assert err.startswith("note: no job ended in period 2001-01") and err.count("\n") == 1


def test_a_blank_sacct_job_is_refused(capsys, tmp_path: Path) -> None:
    f = tmp_path / "s.json"
    f.write_text('{"jobs":[{"job_id":1}]}')
    code, out, err = call(capsys, "jobs", "import", "--data-dir", tmp_path / "d", "--sacct-json", f)
    assert code == 2 and "expected `sacct --json` output" in one_error_line(err)
    assert not (tmp_path / "d").exists()


TABLES = [
    ("collector", "usage", "--per-gpu"), ("jobs", "list"), ("fairshare",), ("priority", "feed"),
    ("report", "usage", "--by", "node"), ("report", "jobs"), ("report", "idle"),
]


@pytest.mark.parametrize("argv", TABLES, ids=" ".join)
@pytest.mark.parametrize("fmt", ["table", "json", "csv"])
def test_tables_in_a_pipe_are_whole_and_every_format_is_honoured(capsys, demo_dir: Path, argv, fmt) -> None:
    code, out, err = call(capsys, *argv, "--data-dir", demo_dir, "--format", fmt)
    assert code == 0, err
    assert "…" not in out and out.strip()
    if fmt == "json":
        json.loads(out)
    elif fmt == "csv":
        header = out.splitlines()[0]
        assert "," in header and " " not in header.replace("GPU ", "")
    if argv[:2] == ("collector", "usage"):
        uuids = re.findall(r"GPU-[0-9a-f]{8}-[0-9a-f-]*", out)
        assert len(uuids) >= 4 and all(len(u) == 40 for u in uuids)  # whole: GPU- and 36 characters


def test_help_keeps_bracketed_text(capsys) -> None:
    code, out, _ = call(capsys, "collector", "serve", "--help")
    assert code == 0 and "[collector] table" in out and "[default: 8470]" in out and "[tokens]" in out


def test_ports_in_use_fail_in_one_line_exit_1_and_create_nothing(capsys, tmp_path: Path) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = str(busy.getsockname()[1])
        code, out, err = call(capsys, "collector", "serve", "--data-dir", tmp_path / "c", "--port", port)
        assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in one_error_line(err)
        assert not (tmp_path / "c").exists()  # no store made on the way to the failure
        code, out, err = call(capsys, "agent", "run", "--source", "simulated", "--metrics-addr", "127.0.0.1",
                              "--metrics-port", port, "--spool-dir", tmp_path / "spool", "--collector",
                              "http://127.0.0.1:1/api/v1/samples", "--duration", "1")
        assert code == 1 and f"/metrics cannot listen on 127.0.0.1:{port}" in one_error_line(err)
        assert not (tmp_path / "spool").exists()
    code, out, err = call(capsys, "demo", "--data-dir", tmp_path / "c" / "x", "--nodes", "0")
    assert code == 2 and out == "" and not (tmp_path / "c").exists()


def test_an_unexpected_error_is_one_line_and_exit_1_or_with_debug_its_traceback(capsys, monkeypatch):
    monkeypatch.delenv("GPULEDGER_DEBUG", raising=False)
    assert unexpected(ValueError("no\nsuch key")) == 1
    assert capsys.readouterr().err == "error: unexpected ValueError: no such key (GPULEDGER_DEBUG=1 shows where)\n"
    monkeypatch.setenv("GPULEDGER_DEBUG", "1")
    with pytest.raises(KeyError):
        unexpected(KeyError("x"))


def test_a_warning_in_a_pipe_is_one_line(capsys, tmp_path: Path) -> None:
    # rich wrapped stderr at 80 columns when it was not a terminal: a warning's job list went on a line of its own
    data = tmp_path / "data"
    run_demo(data, nodes=1, gpus_per_node=1, hours=0.05, step_s=10, seed=1)
    sacct = tmp_path / "sacct.psv"
    sacct.write_text("JobID|User\n77|x\n")
    assert call(capsys, "jobs", "import", "--data-dir", data, "--sacct-parsable", sacct)[0] == 0
    code, _, err = call(capsys, "fairshare", "--data-dir", data)
    assert code == 0
    assert err.splitlines() == ["warning: 1 measured job(s) without a scheduler record or an agent's account are not "
                                "charged: 77"]


def test_a_file_that_is_not_utf8_is_named_in_one_line(capsys, demo_dir: Path, tmp_path: Path) -> None:
    # `report usage` on such a config, and a grid intensity CSV, ended 'unexpected UnicodeDecodeError' (exit 1); an
    # association tree or usage CSV was refused by the decoder's words, naming no file
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"account,parent,user,shares\n\xff\n")
    (tmp_path / "bad.toml").write_bytes(b'cluster = "\xff"\n')
    (tmp_path / "grid.toml").write_text(f'[report]\ngrid_intensity_csv = "{bad}"\n')
    tree = tmp_path / "tree.csv"
    tree.write_text("account,parent,user,shares\na,,,1\n")
    said = f"{bad}: not UTF-8 text (invalid start byte at byte 27)"
    for argv, expected in (
            (("report", "usage", "--config", tmp_path / "bad.toml"), f"{tmp_path / 'bad.toml'}: not UTF-8 text"),
            (("fairshare", "--config", tmp_path / "bad.toml"), f"{tmp_path / 'bad.toml'}: not UTF-8 text"),
            (("report", "usage", "--config", tmp_path / "grid.toml"), said),
            (("fairshare", "--associations", bad), said),
            (("fairshare", "--associations", tree, "--usage", bad), said),
            (("jobs", "import", "--sacct-parsable", bad), said)):
        code, out, err = call(capsys, *argv, "--data-dir", demo_dir)
        assert code == 2 and out == "" and expected in one_error_line(err), (argv, err)
