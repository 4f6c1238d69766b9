"""What a CLI review found the ``hicache`` command line quietly accepting, each now refused in one
line (exit 2) naming what was wrong and where it came from: abbreviated flags, misspelled
``HICACHE_*`` variables, options given at their default value where they do not apply (serve and
plan), ``--stage-bounds`` read one way by ``plan`` and another by ``serve``; and what ``plan``'s
serve line and the CPU-mode arena say (``--device``, ``cannot allocate``)."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.core.config import (
    OTHER_ENV, SETTINGS, ServeConfig, check_env, load_config, sizing, validate,
)
from hicache.core import config
from hicache.core.errors import UsageError
from hicache.core.settings import ENV_PREFIX

ROOT = Path(__file__).resolve().parents[1]
ROWS = {"preset": "dsv4-tiny", "device_rows": "page=8,swa_page=8,req_slot=4", "host_ratio": "2"}


def one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``hicache ARGV`` in this process: exit status 2 and one line on stderr (returned)."""
    from hicache.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusals exit
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, (argv, code, err)
    return err.strip()


# ----------------------------------------------------------------------- 1. abbreviations
def _parsers(argv: list[str]) -> list[argparse.ArgumentParser]:
    """The parser ``build_parser(argv)`` builds and every sub-parser under it."""
    from hicache.cli import build_parser

    out, todo = [], [build_parser(argv)]
    while todo:
        p = todo.pop()
        out.append(p)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo.extend(a.choices.values())
    return out


def test_no_parser_takes_an_abbreviated_long_flag(capsys):
    """``hicache serve --kv-me 1G`` quietly meant ``--kv-mem``: every parser of every command
    (and bench) now takes a long flag only in full, and says which one was meant."""
    from hicache.cli import BENCHES, COMMANDS

    for argv in [[c] for c in COMMANDS] + [["bench", b] for b in BENCHES]:
        for p in _parsers(argv):
            assert p.allow_abbrev is False, (argv, p.prog)
    err = one_line_exit_2(["serve", "--preset", "no-such-model", "--kv-me", "1G"], capsys)
    assert err == ("hicache serve: error: unrecognized arguments: --kv-me 1G; did you mean "
                   "--kv-mem? (see hicache serve -h)")
    err = one_line_exit_2(["plan", "--preset", "dsv4-tiny", "--kv-me=1G"], capsys)
    assert err.startswith("hicache plan: error: unrecognized arguments: --kv-me=1G; did you "
                          "mean --kv-mem?")
    err = one_line_exit_2(["stats", "--timeout", "0.2", "--jso"], capsys)
    assert "did you mean --json?" in err
    err = one_line_exit_2(["bench", "pin", "--hel"], capsys)
    assert err.startswith("hicache bench pin: error: unrecognized arguments: --hel")


def test_a_mistyped_command_names_the_nearest_one(capsys):
    """Flags got "did you mean", commands did not (an operator review)."""
    err = one_line_exit_2(["srve", "--kv-mem", "1G"], capsys)
    assert err.startswith("hicache: error: argument COMMAND: invalid choice: 'srve'")
    assert err.endswith("; did you mean serve? (see hicache -h)"), err
    err = one_line_exit_2(["bench", "e2f"], capsys)
    assert err.endswith("; did you mean e2e? (see hicache bench -h)"), err
    err = one_line_exit_2(["xyzzy"], capsys)
    assert "did you mean" not in err and err.endswith(" (see hicache -h)"), err


# ----------------------------------------------------------------------- 2. the environment
def test_a_misspelled_hicache_variable_is_refused_naming_the_setting(capsys, monkeypatch):
    typo = ENV_PREFIX + "HOST_MME"  # spelled so, the source scan below does not see a name
    with pytest.raises(UsageError) as e:
        load_config(ROWS, env={typo: "256GiB"})
    assert str(e.value) == (f"environment: {typo} (did you mean HICACHE_HOST_MEM?) names no "
                            "setting of hicache serve (docs/config.md lists them); unset it or "
                            "correct the name")
    with pytest.raises(UsageError, match=f"{ENV_PREFIX}ZZQ names no setting"):
        check_env({ENV_PREFIX + "ZZQ": "1"})  # nothing near: no guess
    # every setting's variable and every variable something else reads passes
    check_env({**{s.env: "x" for s in SETTINGS}, **{k: "x" for k in OTHER_ENV}})
    load_config(ROWS, env={k: "1" for k in OTHER_ENV if k != "HICACHE_CONFIG_FILE"})
    # stats reads HICACHE_SOCKET: a misspelled one would probe another daemon's socket
    monkeypatch.setenv(ENV_PREFIX + "SOKET", "ipc:///tmp/nowhere.sock")
    err = one_line_exit_2(["stats", "--timeout", "0.2"], capsys)
    assert "did you mean HICACHE_SOCKET?" in err


def test_serve_refuses_a_misspelled_variable_in_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{ENV_PREFIX + "KV_ME": "1G"})
    r = subprocess.run([sys.executable, "-m", "hicache.cli", "serve", "--preset", "dsv4-tiny",
                        "--kv-mem", "64MiB", "--host-ratio", "2", "--socket",
                        f"ipc://{tmp_path}/d.sock"], capture_output=True, text=True, env=env,
                       cwd=str(ROOT), timeout=60)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.startswith(f"hicache serve: error: environment: {ENV_PREFIX}KV_ME (did you "
                               "mean HICACHE_KV_MEM?)") and len(r.stderr.splitlines()) == 1


_NAME = re.compile(r"(?<![A-Za-z0-9_])HICACHE_[A-Z0-9_]*[A-Z0-9]")
_CODE = {".py", ".sh", ".toml", ".yml", ".yaml", ".cfg", ".ini", ".json", ".c", ".cu", ".h",
         ".cpp"}


def _source_files() -> list[Path]:
    """The checkout's code, scripts and build files (not the docs, which show misspellings,
    nor virtual environments, caches or .git)."""
    out = [ROOT / "Makefile", *(p for p in (ROOT / ".ci").glob("*") if p.is_file())]
    for top in ROOT.iterdir():
        if top.name.startswith(".") or not top.is_dir():
            continue
        out += [p for p in top.rglob("*") if p.suffix in _CODE and "__pycache__" not in p.parts
                and p.is_file()]
    return [p for p in out if p.exists()]


def test_every_hicache_variable_the_code_reads_is_a_setting_or_listed():
    """``OTHER_ENV`` must name every HICACHE_* variable anything in the checkout reads or sets
    (the SGLang adapter, the L3 master's shim, test knobs, scripts): else ``hicache serve``
    would refuse an environment the project itself makes."""
    known = {s.env for s in SETTINGS} | set(OTHER_ENV)
    seen: dict[str, str] = {}
    for path in _source_files():
        for name in _NAME.findall(path.read_text(errors="replace")):
            seen.setdefault(name, str(path.relative_to(ROOT)))
    assert "HICACHE_SGLANG_MODEL" in seen and "HICACHE_TIMING_ASSERT" in seen  # the scan works
    missing = {n: where for n, where in seen.items() if n not in known}
    assert not missing, f"add these to config.OTHER_ENV (with who reads them): {missing}"


# ----------------------------------------------------------------------- 3. does not apply
GIVEN_AT_DEFAULT = [
    ({"max_running": "256"}, "--max-running sizes device rows from --kv-mem"),
    ({"pd_role": "none"}, "--pd-role sizes device rows from --kv-mem"),
    ({"swa_full_tokens_ratio": "0.8"}, "--swa-full-tokens-ratio sizes device rows"),
    ({"copy_engine": "off"}, "--copy-engine off: the copy engines are a GPU's"),
    ({"copy_engine": "auto"}, "--copy-engine auto: the copy engines are a GPU's"),
    ({"metrics_addr": "127.0.0.1"}, "--metrics-addr applies with --metrics-port"),
    ({"min_sparse_prompt_len": "32768"}, "--min-sparse-prompt-len applies with --sparse-rows"),
    ({"sparse_clients": "1"}, "--sparse-clients applies with --sparse-rows"),
    ({"l3_protocol": "tcp"}, "--l3-protocol given but --l3 is off"),
    ({"l3_local_host": "127.0.0.1"}, "--l3-local-host given but --l3 is off"),
    ({"l3_epoch_recheck": "2"}, "--l3-epoch-recheck given but --l3 is off"),
    ({"l3_segment": "0"}, "--l3-segment given but --l3 is off"),
    ({"kv_mem": "64MiB", "device_rows": None, "swa_mode": "ring",
      "swa_full_tokens_ratio": "0.8"}, "--swa-full-tokens-ratio sizes paged SWA pools"),
]


@pytest.mark.parametrize("flags, msg", GIVEN_AT_DEFAULT, ids=[m for _, m in GIVEN_AT_DEFAULT])
def test_a_setting_given_at_its_default_where_it_does_not_apply_is_refused(flags, msg, tmp_path):
    """These checks compared values with the defaults, so ``--max-running 256`` beside
    ``--device-rows`` (or ``--copy-engine off`` in CPU mode) slipped through. A flag typed where
    it does not apply is now refused even at its default value. A HICACHE_* variable or a
    settings-file value at the default is not (a shared file lists defaults; a demo's daemon
    inherits the shell's variables); away from its default it is, naming that place."""
    base = {k: v for k, v in {**ROWS, **flags}.items() if v is not None}
    with pytest.raises(UsageError, match=re.escape(msg)) as e:
        load_config(base, env={})
    assert "(from" not in str(e.value)  # a flag names itself
    name = next(k for k in flags if k not in ("kv_mem", "device_rows", "swa_mode"))
    flags_only = {k: v for k, v in base.items() if k != name}
    at_default = config._convert(name, flags[name], name) == config.default_value(name)
    f = tmp_path / "s.toml"
    f.write_text(f"{name} = {json.dumps(flags[name])}\n")
    if at_default:  # the file and the environment may repeat a default
        load_config(flags_only, env={f"HICACHE_{name.upper()}": flags[name]})
        load_config(flags_only, config_file=str(f), env={})
        return
    with pytest.raises(UsageError, match=re.escape(msg)) as e:
        load_config(flags_only, env={f"HICACHE_{name.upper()}": flags[name]})
    assert str(e.value).endswith(f"(from HICACHE_{name.upper()})"), str(e.value)
    with pytest.raises(UsageError, match=re.escape(msg)) as e:
        load_config(flags_only, config_file=str(f), env={})
    assert f"{name} in config file {f}" in str(e.value), str(e.value)


def test_the_example_settings_file_fits_a_daemon_sized_by_device_rows():
    """``docs/serve.example.toml`` (one file for every stage, sized with ``kv_mem``, listing
    defaults such as ``max_running``) with ``--device-rows`` and ``--device cpu``: the flag
    replaces the file's ``kv_mem`` and nothing the file repeats at its default is refused."""
    cfg = load_config({"device": "cpu", "device_rows": "page=8,swa_page=4,req_slot=4",
                       "host_ratio": "2"}, config_file=str(ROOT / "docs" / "serve.example.toml"),
                      env={})
    assert cfg.kv_mem is None and cfg.device_rows


def test_defaults_never_trigger_a_refusal():
    cfg = load_config(ROWS, env={})
    assert cfg.copy_engine == "auto" and cfg.max_running == 256 and cfg.l3 == "off"
    validate(ServeConfig(preset="dsv4-tiny", device_rows={"page": 8}))  # built in code
    with pytest.raises(UsageError, match="--copy-engine on: the copy engines are a GPU's"):  # in code: off default
        validate(ServeConfig(preset="dsv4-tiny", copy_engine="on"))


# ----------------------------------------------------------------------- 4, 5. plan
def test_the_serve_line_of_plan_names_a_gpu(capsys):
    """Pasted as printed on a GPU host, the serve line started a CPU-mode daemon (no
    ``--device``)."""
    from hicache.cli import main

    assert main(["plan", "--preset", "dsv4-flash", "--kv-mem", "1GiB", "--pp-size", "2",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for s in d["stages"]:
        assert s["serve_command"].startswith("hicache serve --device cuda:0 --preset dsv4-flash")
    assert main(["plan", "--preset", "dsv4-flash", "--kv-mem", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "  serve: hicache serve --device cuda:0 " in out
    assert out.rstrip().endswith("serve lines: one daemon per GPU of each stage; change --device "
                                 "cuda:0 to that GPU's index and add --metrics-port")


@pytest.mark.parametrize("extra, msg", [
    (["--force"], "--force accepts a host tier not larger than the device pools; it applies "
                  "with --host-mem or --host-ratio"),
    (["--request-tokens", "131072"], "--request-tokens applies only with --hisparse"),
    (["--request-tokens", "65536", "--hot-slots", "2048"],
     "--request-tokens and --hot-slots apply only with --hisparse"),
    (["--pages-per-checkpoint", "32", "--host-ratio", "4"],
     "--pages-per-checkpoint splits the host tier of --host-mem"),
    (["--swa-mode", "ring", "--swa-full-tokens-ratio", "0.8"],
     "--swa-full-tokens-ratio sizes paged SWA pools"),
])
def test_plan_refuses_an_option_that_does_not_apply(extra, msg, capsys):
    err = one_line_exit_2(["plan", "--preset", "dsv4-flash", "--kv-mem", "100GiB", *extra],
                          capsys)
    assert err.startswith(f"hicache plan: error: {msg}"), err


def test_plan_options_that_apply_still_run(capsys):
    from hicache.cli import main

    for extra in (["--force", "--host-ratio", "0.5"], ["--hisparse", "--request-tokens", "65536"],
                  ["--host-mem", "400GiB", "--pages-per-checkpoint", "32"],
                  ["--swa-full-tokens-ratio", "0.8"]):
        assert main(["plan", "--preset", "dsv4-flash", "--kv-mem", "100GiB", *extra]) == 0, extra
        capsys.readouterr()


# ----------------------------------------------------------------------- 6. stage bounds
def test_serve_reads_stage_bounds_as_plan_does(tmp_path, capsys):
    """``plan --stage-bounds 0:22,22:43`` plans 2 stages; ``serve`` with the same flags refused
    ("... --pp-size says 1"). Without ``--pp-size`` both now take the count of the bounds; a
    ``--pp-size`` that disagrees is refused naming both flags and where each came from."""
    from hicache.cli import main

    cfg = load_config({"preset": "dsv4-flash", "stage_bounds": "0:22,22:43", "kv_mem": "1GiB",
                       "host_mem": "2GiB", "pp_rank": "1"}, env={})
    st = sizing(cfg).layout.stage
    assert (cfg.pp_size, st.pp_size, st.start, st.end) == (2, 2, 22, 43)
    assert "pp_size" not in cfg.__dict__["sources"]  # inferred, not given
    assert main(["plan", "--preset", "dsv4-flash", "--kv-mem", "1GiB", "--stage-bounds",
                 "0:22,22:43", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["pp"] == 2
    base = {"preset": "dsv4-flash", "stage_bounds": "0:22,22:43", "kv_mem": "1GiB",
            "host_mem": "2GiB"}
    with pytest.raises(UsageError) as e:
        load_config(base, env={"HICACHE_PP_SIZE": "1"})
    assert str(e.value) == "--stage-bounds gives 2 stages, --pp-size says 1 (from HICACHE_PP_SIZE)"
    with pytest.raises(UsageError, match=r"^--stage-bounds gives 2 stages, --pp-size says 3$"):
        load_config({**base, "pp_size": "3"}, env={})
    assert load_config({**base, "pp_size": "2"}, env={}).pp_size == 2


# ----------------------------------------------------------------------- 7. the arena's words
def test_the_arena_says_allocate_in_cpu_mode_and_pin_on_a_gpu():
    """CPU mode pins nothing (no registration), yet its refusal said ``cannot pin``."""
    from hicache.host_pools.arena import PinnedArena
    from hicache.host_pools.errors import CapacityError

    import psutil

    huge = psutil.virtual_memory().total * 4
    with pytest.raises(CapacityError, match=r"^cannot allocate .* can be allocated$"):
        PinnedArena(huge, None)
    with pytest.raises(CapacityError, match=r"^cannot pin .* can be pinned$"):
        PinnedArena(huge, None, registrar=object())  # type: ignore[arg-type]  # refused first


def test_serve_refuses_a_host_tier_or_l3_segment_too_big_before_torch_naming_them(tmp_path):
    """A host tier (or host tier and L3 segment) the machine cannot hold is refused by the
    preflight, before torch loads, led by the settings that sized it and where they came from:
    the refusal used to come from the arena after torch, naming no setting, and an
    ``--l3-segment`` over the machine's memory was not checked at all (the daemon said "ready"
    and Mooncake's set-up failed every 3 s)."""
    import psutil

    from hicache.core.sizes import format_bytes

    big = format_bytes(psutil.virtual_memory().total * 2).replace(" ", "")
    toml = tmp_path / "serve.toml"
    toml.write_text(f'host_mem = "{big}"\n')
    base = [sys.executable, "-m", "hicache.cli", "serve", "--device", "cpu", "--preset",
            "dsv4-tiny", "--device-rows", "page=8,swa_page=4,req_slot=4", "--socket",
            f"ipc://{tmp_path}/d.sock"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    l3 = ["--l3", "mooncake", "--l3-master", "127.0.0.1:1", "--l3-metadata",
          "http://127.0.0.1:1/metadata", "--l3-scope", "test/dsv4-tiny@1"]
    for extra, env_add, lead, tail in (
            ([], {"HICACHE_CONFIG_FILE": str(toml)}, f"--host-mem {big[:-3]} {big[-3:]}: ",
             f" (from host_mem in config file {toml})"),
            (["--host-mem", "1GiB", *l3, "--l3-segment", big], {},
             f"--host-mem 1.00 GiB and --l3-segment {big[:-3]} {big[-3:]}: ", "")):
        r = subprocess.run(base + extra, capture_output=True, text=True, cwd=str(ROOT),
                           env={**env, **env_add}, timeout=60)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r
        msg = r.stderr.strip()
        assert msg.startswith(f"hicache serve: error: {lead}cannot allocate ") and \
            msg.endswith(f"can be allocated{tail}"), msg
    assert not list(tmp_path.glob("*.sock*"))


def test_a_pp_stages_arena_over_memory_says_its_rows_were_agreed(capsys):
    """With PP stages the host rows are agreed over the stages, so a stage's arena is smaller
    than its --host-mem: the refusal named only --host-mem and a smaller figure, unexplained
    (an operator review)."""
    import psutil

    from hicache.cli import main
    from hicache.core.sizes import format_bytes

    big = format_bytes(psutil.virtual_memory().total * 2).replace(" ", "")
    assert main(["serve", "--check", "--device", "cpu", "--preset", "dsv4-flash", "--kv-mem",
                 "2GiB", "--max-running", "16", "--pp-size", "2", "--pp-rank", "0",
                 "--host-mem", big]) == 2
    err = capsys.readouterr().err.strip()
    assert re.match(rf"hicache serve: error: --host-mem {big[:-3]} {big[-3:]} \(a host arena "
                    r"of [\d.]+ GiB: the host rows agreed over the 2 PP stages\): cannot "
                    r"allocate [\d.]+ GiB: .* can be allocated$", err), err


def test_a_command_missing_from_the_build_says_so_whatever_its_flags(monkeypatch, capsys):
    """A command whose module is not in the build has no flags; given some, it is still
    refused as missing, not with its flags called unrecognized."""
    import importlib

    from hicache.cli import main

    real = importlib.import_module

    def fake(name: str, *a: object, **k: object):
        if name == "hicache.bench.l3":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake)
    assert main(["bench", "l3", "--pages", "32"]) == 2
    err = capsys.readouterr().err
    assert "'l3' is not available in this build" in err and "unrecognized" not in err, err


@pytest.mark.parametrize("flags, env, msg", [
    ({}, {"HICACHE_LOAD_EVENT_SETS": "8"},
     "load_event_sets applies in GPU mode (--device cuda:N): a CPU load has no per-layer events "
     "(from HICACHE_LOAD_EVENT_SETS)"),
    ({"device": "cuda:0"}, {"HICACHE_INLINE_MAX_BYTES": "1MiB"},
     "inline_max_bytes applies in CPU mode: a GPU daemon never copies on its server thread "
     "(from HICACHE_INLINE_MAX_BYTES)"),
    ({"socket": "tcp://127.0.0.1:9913", "metrics_port": "9913"}, {},
     "--metrics-port 9913 is the port of --socket tcp://127.0.0.1:9913: each needs its own"),
    ({"l3": "mooncake", "l3_master": "127.0.0.1:99999", "l3_metadata": "P2PHANDSHAKE"}, {},
     "--l3 mooncake needs --l3-master HOST:PORT (port 1..65535), got '127.0.0.1:99999'"),
    ({"l3": "mooncake", "l3_metadata": "P2PHANDSHAKE"}, {},  # said "got None"
     "--l3 mooncake needs --l3-master HOST:PORT (port 1..65535), not given"),
    ({"l3": "mooncake", "l3_master": "127.0.0.1:9"}, {},
     "--l3 mooncake needs --l3-metadata http://HOST:PORT/metadata (or P2PHANDSHAKE), not given"),
    ({"heartbeat_timeout": "1e12"}, {},
     "--heartbeat-timeout must be in [0.5, 86400] seconds, got 1e+12"),
    ({"heartbeat_timeout": "0.01"}, {},  # a typo for 10 reaped every engine in 0.1 s
     "--heartbeat-timeout must be in [0.5, 86400] seconds, got 0.01"),
    ({}, {"HICACHE_SOCKET": "foo"},
     "--socket: unsupported socket address 'foo'; use ipc://PATH or tcp://127.0.0.1:PORT "
     "(from HICACHE_SOCKET)"),
    # Python's own words ("invalid literal for int() with base 10") and an unnamed variable
    ({}, {"HICACHE_METRICS_PORT": " "},
     "environment: bad value for HICACHE_METRICS_PORT: must be an integer, got ' '"),
    ({}, {"HICACHE_SPIN_US": "fast"},
     "environment: bad value for HICACHE_SPIN_US: must be a number, got 'fast'"),
    ({}, {"HICACHE_STAGE_BOUNDS": "x"},
     "environment: bad value for HICACHE_STAGE_BOUNDS: stage bounds: cannot read 'x'; give "
     "START:END per stage, comma-separated, e.g. 0:22,22:43"),
])
def test_values_a_daemon_would_not_use_or_cannot_serve_are_refused(flags, env, msg):
    """From a review of the command line: settings one mode never reads were accepted (the
    other mode's are refused); a metrics port equal to the socket's failed only after the
    arena was pinned; an L3 master port over 65535 gave a daemon whose tier stayed offline;
    a heartbeat timeout of 1e12 s overflowed the SGLang adapter's wait; a bad socket from the
    environment did not say where it came from."""
    with pytest.raises(UsageError) as e:
        load_config({**ROWS, **flags}, env=env)
    assert str(e.value) == msg


@pytest.mark.parametrize("argv, msg", [
    (["bench", "pin", "--size", "64MiB", "--chunk", "0"],
     "hicache bench pin: error: --chunk must be at least one page"),
    (["bench", "soak", "--heartbeat-timeout", "0"],
     "hicache bench soak: error: --heartbeat-timeout applies with --crash-clients N only"),
    (["bench", "soak", "--crash-clients", "1", "--heartbeat-timeout", "0"],
     "hicache bench soak: error: --heartbeat-timeout must be in [0.5, 3600] seconds"),
    (["bench", "soak", "--crash-daemon", "1", "--call-timeout", "-1"],
     "hicache bench soak: error: --call-timeout must be in (0, 3600] seconds"),
    (["bench", "e2e", "--device", "cpu", "--pp-size", "0"],
     "hicache bench e2e: error: --pp-size must be positive, got 0"),
    (["bench", "fuzz", "--time-limit", "0"],
     "hicache bench fuzz: error: --time-limit must be a positive number of seconds"),
    (["demo", "--device-pages", "0"], "hicache demo: error: --device-pages must be positive"),
    (["demo", "--progress-seconds", "-1"],
     "hicache demo: error: --progress-seconds must be 0 (none) or a positive number"),
    (["demo", "--dry", "--host-ratio", "inf"],
     "hicache demo: error: --host-ratio must be in (0, 1024], got inf"),
    (["demo", "--demo-metrics-port", "99999"],
     "hicache demo: error: --demo-metrics-port must be 0..65535, got 99999"),
    (["demo", "--hisparse", "--device", "foo"],
     "hicache demo: error: --device must be auto, cpu or cuda:N, got 'foo'"),
    (["demo", "--mirror", "full", "--host-pages", "10"],
     "hicache demo: error: a full mirror's daemon keeps host rows in the device pools' "
     "proportions: 10 host pages for 128 device pages leave it no request-slot row"),
    (["demo", "--dry", "--host-pages", "200000000"],
     "hicache demo: error: the host tier of 200,000,000 pages is over the demo's"),
])
def test_bench_and_demo_values_are_refused_in_one_line(argv, msg, capsys):
    """From a review: each of these ended in a traceback (exit 1), started a daemon or a full
    soak first, or ran with the value replaced (``--device-pages 0`` became 128)."""
    assert one_line_exit_2(argv, capsys).startswith(msg)


@pytest.mark.parametrize("env, msg", [
    ({"HICACHE_DEVICE": "gpu"},
     "hicache stats: error: --device must be 'cpu' or 'cuda:N', got 'gpu' (from HICACHE_DEVICE)"),
    ({"HICACHE_SOCKET": ""},
     "hicache stats: error: HICACHE_SOCKET is set but empty: unset it, or give the daemon's "
     "socket"),
])
def test_stats_and_clients_refuse_the_variables_serve_refuses(env, msg, capsys, monkeypatch):
    """``stats`` (and a ``Client`` given no address) took ``HICACHE_DEVICE=gpu`` for a socket
    named gpu.sock and reported no daemon there (exit 1), and an empty ``HICACHE_SOCKET`` as
    unset, where ``serve`` refuses both."""
    monkeypatch.delenv("HICACHE_SOCKET", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert one_line_exit_2(["stats"], capsys) == msg


def test_stage_bounds_from_a_settings_file_as_strings_or_pairs(tmp_path):
    """``stage_bounds = ["0:3", "3:6"]`` (a natural TOML spelling) was "too many values to
    unpack"; strings and [start, end] pairs both read now, and anything else is refused
    naming the entry."""
    from hicache.core.config import load_config

    for text in ('["0:3", "3:6"]', '[[0, 3], [3, 6]]', '"0:3,3:6"'):
        f = tmp_path / "b.toml"
        f.write_text(f"stage_bounds = {text}\n")
        cfg = load_config({"host_ratio": "2"}, str(f), env={})
        assert cfg.stage_bounds == ((0, 3), (3, 6)) and cfg.pp_size == 2, text
    for text, why in (("[[0, 1, 2]]", r"entry \[0, 1, 2\] is not"),
                      ('["0:3,3:6"]', "entry '0:3,3:6' is not"),  # one entry, one stage
                      ('{"0:3" = 1, "3:6" = 2}', "got a value of type dict"), ("3", "of type int")):
        f.write_text(f"stage_bounds = {text}\n")
        with pytest.raises(UsageError, match=f"bad value for stage_bounds: .*{why}"):
            load_config({"host_ratio": "2"}, str(f), env={})


def test_stats_finds_the_daemon_its_settings_file_names(tmp_path, capsys, monkeypatch):
    """``stats`` looks where ``serve`` listens: the socket (or the device's default socket) of
    the settings file, from ``--config-file`` or ``HICACHE_CONFIG_FILE``, under the
    ``HICACHE_*`` variables as ``serve`` merges them. It used to read the variables only, and
    a daemon set up through the documented file looked "not running"."""
    from hicache.cli import main
    from hicache.core.config import default_socket, served_address

    for k in ("HICACHE_SOCKET", "HICACHE_DEVICE", "HICACHE_CONFIG_FILE"):
        monkeypatch.delenv(k, raising=False)
    sock, dev = tmp_path / "s.toml", tmp_path / "d.toml"
    sock.write_text(f'[serve]\nsocket = "ipc://{tmp_path}/d.sock"\ndevice = "cuda:3"\n')
    dev.write_text('device = "cuda:1"\nhost_mem = "1GiB"\n')
    assert served_address(str(sock)) == f"ipc://{tmp_path}/d.sock"
    assert served_address(str(dev)) == default_socket("cuda:1")
    assert served_address(str(dev), {"HICACHE_DEVICE": "cuda:2"}) == default_socket("cuda:2")
    assert served_address(None, {"HICACHE_CONFIG_FILE": str(sock),
                                 "HICACHE_SOCKET": "ipc:///x.sock"}) == "ipc:///x.sock"
    assert served_address(None, {}) == default_socket("cpu")
    for argv, env in ((["stats", "--config-file", str(sock)], {}),
                      (["stats"], {"HICACHE_CONFIG_FILE": str(sock)})):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert main(argv) == 1  # asked the file's socket: nothing there
        assert capsys.readouterr().err == f"hicache stats: no socket at {tmp_path}/d.sock (is " \
                                          "the daemon running?)\n"
    bad = tmp_path / "bad.toml"
    bad.write_text('device = "gpu"\n')
    monkeypatch.delenv("HICACHE_CONFIG_FILE")
    assert one_line_exit_2(["stats", "--config-file", str(bad)], capsys) == (
        f"hicache stats: error: --device must be 'cpu' or 'cuda:N', got 'gpu' (from device in "
        f"config file {bad})")
    assert "give one of --socket" in one_line_exit_2(
        ["stats", "--config-file", str(bad), "--device", "cpu"], capsys)
    # a key serve refuses (``sockte``) was read past, and stats asked the default socket
    typo = tmp_path / "typo.toml"
    typo.write_text(f'sockte = "ipc://{tmp_path}/d.sock"\n')
    assert one_line_exit_2(["stats", "--config-file", str(typo)], capsys) == (
        f"hicache stats: error: config file {typo}: unknown setting 'sockte' (did you mean "
        f"'socket'?); docs/config.md lists the settings")
    # an engine's client reads past it (its hicache may be older than the daemon's)
    assert served_address(str(typo)) == default_socket("cpu")
    # a file that gives only a device: still the default socket, with the hint about it
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert main(["stats", "--config-file", str(dev)]) == 1
    assert "this is the default socket, which follows XDG_RUNTIME_DIR" in capsys.readouterr().err
    # where the file came from is what a refusal names; a socket must be a string
    monkeypatch.setenv("HICACHE_CONFIG_FILE", str(tmp_path / "missing.toml"))
    assert one_line_exit_2(["stats"], capsys).startswith(
        "hicache stats: error: HICACHE_CONFIG_FILE: cannot read ")
    bad.write_text("socket = 5\n")
    monkeypatch.setenv("HICACHE_CONFIG_FILE", str(bad))
    assert "must be a string like ipc:///PATH, got a value of type int" in \
        one_line_exit_2(["stats"], capsys)


@pytest.mark.parametrize("flags, env, msg", [
    ({"host_ratio": "2"}, {"HICACHE_PP_SIZE": "100"},
     "--pp-size: pp size 100 is larger than the 6 layers (from HICACHE_PP_SIZE)"),
    ({"host_ratio": "2"}, {"HICACHE_STAGE_BOUNDS": "0:1,1:0"},
     "--stage-bounds: stage 1 bounds [1, 0) hold no layer"),
    ({}, {"HICACHE_HOST_MEM": "1"}, "--host-mem: host budget 1 B is too small for this stage"),
])
def test_sizing_refusals_name_the_setting_and_where_it_came_from(flags, env, msg):
    """The layout's and the host rows' refusals named no setting, so a value from a file or a
    variable was refused without saying where it came from (found by a review)."""
    from hicache.core.config import sizing

    cfg = load_config({"preset": "dsv4-tiny", "device_rows": "page=8,swa_page=8,req_slot=4",
                       **flags}, env=env)
    with pytest.raises(UsageError) as e:
        sizing(cfg)
    text = config.with_source(str(e.value), cfg)
    assert text.startswith(msg) and text.endswith(f"(from {next(iter(env))})"), text


def test_l3_over_rdma_needs_the_rdma_devices_it_names(tmp_path, monkeypatch):
    """``--l3-protocol rdma`` on a host without RDMA devices started, said "online" and ran
    without them (one Mooncake warning); now the preflight refuses it, and a named device the
    host lacks, in one line each."""
    from hicache.controllers import preflight as pf
    from hicache.core.config import load_config

    base = {"device": "cpu", "preset": "dsv4-tiny", "device_rows": "page=8,swa_page=4,req_slot=4",
            "host_ratio": 2, "socket": f"ipc://{tmp_path}/d.sock", "l3": "mooncake",
            "l3_master": "127.0.0.1:1", "l3_metadata": "http://127.0.0.1:1/metadata",
            "l3_protocol": "rdma", "l3_scope": "test/dsv4-tiny@1"}
    sysfs = tmp_path / "infiniband"
    monkeypatch.setattr(pf, "RDMA_SYSFS", str(sysfs))  # missing: no device
    with pytest.raises(UsageError, match=r"^--l3-protocol rdma: this host has no RDMA device"):
        pf.preflight(load_config(base, env={}), check=True)
    (sysfs / "mlx5_0").mkdir(parents=True)
    cfg = load_config({**base, "l3_rdma_devices": "mlx5_0,mlx5_1"}, env={})
    with pytest.raises(UsageError, match=r"no RDMA device mlx5_1 on this host \(it has mlx5_0\)"):
        pf.preflight(cfg, check=True)
    pf.preflight(load_config({**base, "l3_rdma_devices": "mlx5_0"}, env={}), check=True)


def test_the_stage_host_capacity_says_what_a_full_mirror_caches(capsys):
    """The stage's "host token capacity" is page rows x 256, what the checkpoints mirror caches;
    the full mirror the serve line starts caches fewer (its pages need a swa_page row each),
    which the line did not say (forty-eighth session's operator review)."""
    from hicache.cli import main

    assert main(["plan", "--preset", "dsv4-flash", "--kv-mem", "100GiB", "--host-mem",
                 "256GiB"]) == 0
    out = capsys.readouterr().out
    assert "  host token capacity      7,797,504 (page rows x 256); a full mirror caches " \
           "6,237,440\n" in out
    assert "the daemon the serve line starts: 24,365 pages = 6,237,440 cached tokens" in out
    assert main(["plan", "--preset", "dsv4-flash", "--kv-mem", "100GiB", "--host-mem",
                 "256GiB", "--swa-mode", "ring"]) == 0
    out = capsys.readouterr().out
    assert "(page rows x 256)\n" in out and "a full mirror caches" not in out
