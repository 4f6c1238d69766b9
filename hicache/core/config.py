"""One typed configuration for ``hicache serve``: defaults < TOML file < HICACHE_* env < flags.

``ServeConfig`` holds every setting; ``SETTINGS`` describes each one once (its flag, its
``HICACHE_<NAME>`` variable, its TOML key = the field name, its meaning): ``hicache serve``
builds its flags from it and docs/config.md's table is generated from it
(``python -m hicache.core.config``). ``load_config(flags, config_file=None, env=os.environ)``
merges the sources (``flags`` holds only what the command line set); in TOML and flags a dash
may replace an underscore. Every bad value raises ``UsageError`` naming the key and its source.
A ``HICACHE_*`` variable that is no setting and not in ``OTHER_ENV`` (what other parts read) is
refused (``check_env``), naming the nearest setting. A setting given where it does not apply is
refused when it is away from its default (any source) or typed as a flag even at its default
(``given``); a default, or a file or variable at the default value, never is. Without ``pp_size``, ``stage_bounds`` gives the pipeline size
(``planner.pp_size_of``, as ``hicache plan`` reads it).

Sizing (``sizing(cfg) -> Sizing``): the served stage's layout, its device rows and the host rows.
Device rows come from the planner for ``kv_mem`` (the same rows ``hicache plan`` prints for that
stage) or are given as ``device_rows``; host rows follow ``host_mem`` or ``host_ratio``
(``hicache.core.sizes.host_rows``). A host tier not larger than the device pools is refused
unless ``force``.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Mapping, NamedTuple

from hicache.core.addresses import (  # noqa: F401 - re-exported for the daemon and tests
    check_address, check_curve, default_socket, runtime_dir,
)
from hicache.core.errors import UsageError
from hicache.core.settings import BOOL_FIELDS, ENV_PREFIX, SETTINGS, Setting  # noqa: F401
from hicache.core.layout import INDEX_SPACES, Layout, LayoutError, load_model
from hicache.core.planner import (
    DEFAULT_MAX_RUNNING, DEFAULT_SWA_RATIO, HOST_SPLITS, PD_ROLES, PlanInputs, parse_bounds,
    parse_fraction,
    plan, pp_size_of, refuse_unused, stage_host_rows, stage_layouts,
)
from hicache.core.resume import C4_RATIO, DEFAULT_PAGES_PER_CKPT
from hicache.core.sizes import (check_host_larger, check_rows, format_bytes, parse_bytes,
                                used_spaces)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")  # = engine.radix
# .POLICIES (a test checks)


# GPU mode's default busy-poll window after a request (--spin-us): an engine that is serving
# sends commands every few to tens of ms, so its daemon does not sleep between them (sleeping
# threads' wake-ups and cold caches cost a LOAD's reply 0.05-0.65 ms on an H200 host); a daemon
# whose engine went quiet sleeps after 50 ms. One core per GPU while the engine works.
GPU_SPIN_US = 50_000.0


@dataclass
class ServeConfig:
    device: str = "cpu"  # "cpu" or "cuda:N"
    socket: str | None = None  # None: default ipc socket under the runtime dir
    allow_remote: bool = False
    preset: str | None = None
    model_config: str | None = None  # HF-style config.json (``--model-config``)
    tp_size: int = 1
    pp_size: int = 1
    pp_rank: int = 0
    stage_bounds: tuple[tuple[int, int], ...] | None = None
    swa_mode: str = "paged"
    c128_state: str = "online"
    mtp: bool | None = None  # None: the model's own
    indexer: str | None = None  # None: the model's own
    kv_mem: int | None = None  # bytes: device rows from the planner
    max_running: int = DEFAULT_MAX_RUNNING
    pd_role: str = "none"
    swa_full_tokens_ratio: Fraction = DEFAULT_SWA_RATIO
    device_rows: dict[str, int] = field(default_factory=dict)
    host_mem: int | None = None  # bytes
    host_ratio: float | None = None
    host_split: str = "device"  # "device" or "checkpoints" (``sizes.checkpoint_host_rows``)
    pages_per_checkpoint: int = DEFAULT_PAGES_PER_CKPT
    force: bool = False
    write_policy: str = "write_through"
    metrics_port: int = 0  # 0 = off
    metrics_addr: str = "127.0.0.1"
    heartbeat_timeout: float = 10.0
    numa_node: str = "auto"  # "auto", "off" or a node number
    touch_threads: int | None = None
    inline_max_bytes: int = 256 << 10  # CPU mode: ops up to this size run on the server thread
    spin_us: float | None = None  # busy-poll this long after a request before sleeping
    # (0 = never; None: ``GPU_SPIN_US`` in GPU mode, 0 in CPU mode: ``server_spin_us``)
    copy_engine: str = "auto"  # GPU mode: batched copy-engine DMA for big rows (auto, on, off)
    load_event_sets: int = 4  # GPU mode: sets of per-layer load events, used round robin
    max_clients: int = 64
    ack_retention: int = 4096  # acks kept per client for poll_acks
    shm_dirs: tuple[str, ...] = ("/dev/shm",)  # the first: the daemon's wake-up socket
    zero_on_free: bool = False  # zero a host row's bytes when it is freed (reads need a write anyway)
    curve_secret_key: str | None = None  # the daemon's CURVE secret key file (zmq.auth format)
    curve_clients: str | None = None  # directory of allowed clients' CURVE public .key files
    parent_pid: int | None = None  # exit when this process is gone (launchers set it)
    dumpable: bool = False  # leave the process dumpable (same-uid ptrace, /proc fds, cores)
    allow_shutdown: bool = False  # accept the ``shutdown`` command (off: signals only)
    log_level: str = "info"
    l3: str = "off"  # "off" or "mooncake"
    l3_master: str | None = None  # HOST:PORT of mooncake_master
    l3_metadata: str | None = None  # http://HOST:PORT/metadata (or P2PHANDSHAKE)
    l3_scope: str | None = None  # the served weights (name@revision): in every L3 object's name
    l3_protocol: str = "tcp"  # tcp | rdma
    l3_rdma_devices: str = ""  # e.g. mlx5_0,mlx5_1 (rdma only)
    l3_local_host: str = "127.0.0.1"  # address this daemon's Mooncake client advertises
    l3_segment: int = 0  # bytes this daemon contributes to the store (0 = none)
    l3_epoch_recheck: float = 2.0  # s: key store, how long an L3 namespace epoch read is used
    sparse_rows: int = 0  # HiSparse: C4 page rows per C4 layer of each client region (0: off)
    sparse_clients: int = 1  # HiSparse: clients that may hold a sparse region at once
    min_sparse_prompt_len: int = 32768  # HiSparse: shortest prompt (full tokens) admitted

    @property
    def server_spin_us(self) -> float:
        """The busy-poll window the server loop uses (``spin_us``, or its mode's default)."""
        if self.spin_us is not None:
            return self.spin_us
        return GPU_SPIN_US if self.device != "cpu" else 0.0

    @property
    def cuda_index(self) -> int | None:
        return None if self.device == "cpu" else int(self.device.split(":")[1])

    def plan_inputs(self) -> PlanInputs:
        """The planner's inputs for this deployment (``kv_mem`` 0 when rows are given)."""
        if self.preset is None and self.model_config is None:
            raise UsageError("no model given: use --preset NAME or --model-config config.json")
        try:
            model = load_model(self.preset, self.model_config)
        except LayoutError as e:  # named as the flag, so its source can be told too
            raise UsageError(f"{'--preset' if self.preset is not None else '--model-config'}: "
                             f"{e}") from None
        return PlanInputs(
            model=model, kv_mem=self.kv_mem or 0,
            tp=self.tp_size, pp=self.pp_size, max_running=self.max_running,
            pd_role=self.pd_role, swa_mode=self.swa_mode, mtp=self.mtp, indexer=self.indexer,
            c128_state=self.c128_state, swa_ratio=self.swa_full_tokens_ratio,
            bounds=self.stage_bounds)

    def layout(self) -> Layout:
        return stage_layouts(self.plan_inputs(), self.swa_mode)[self.pp_rank]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shm_dirs"] = list(self.shm_dirs)
        d["swa_full_tokens_ratio"] = float(self.swa_full_tokens_ratio)
        return d


FIELDS = {f.name: f for f in dataclasses.fields(ServeConfig)}


assert {s.name for s in SETTINGS} == set(FIELDS), "every field needs a SETTINGS entry"


# ------------------------------------------------------------------------------- parsing
def _parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {v!r}")


def parse_device_rows(v: Any) -> dict[str, int]:
    """``"page=4096,swa_page=512,req_slot=64"`` or a mapping -> {space: rows}."""
    if isinstance(v, Mapping):
        items = list(v.items())
    else:
        items = []
        for part in str(v).split(","):
            if not part.strip():
                continue
            k, sep, n = part.partition("=")
            if not sep:
                raise ValueError(f"expected SPACE=ROWS, got {part.strip()!r}")
            items.append((k.strip(), n.strip()))
    out = {}
    for k, n in items:
        if k not in INDEX_SPACES:
            raise ValueError(f"unknown index space {k!r}; spaces are {', '.join(INDEX_SPACES)}")
        try:
            n = _int(n)
        except (TypeError, ValueError):
            raise ValueError(f"rows for {k} must be an int, got {n!r}") from None
        if n <= 0:
            raise ValueError(f"rows for {k} must be positive, got {n}")
        if k in out:
            raise ValueError(f"{k} given twice ({out[k]} and {n})")
        out[k] = n
    return out


def _int(v: Any) -> int:
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"not an int: {v!r}")
    try:
        return int(str(v).strip()) if isinstance(v, str) else int(v)
    except ValueError:  # (int()'s own words name its internals)
        raise ValueError(f"must be an integer, got {v!r}") from None


def _list(v: Any) -> list[Any]:
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"give a string like \"0:3,3:6\" or a list of \"0:3\" or [0, 3] "
                         f"entries, got a value of type {type(v).__name__}")
    return list(v)


def _bound(x: Any) -> str:
    """One stage's bounds from a settings-file list: "START:END" or [START, END]."""
    if isinstance(x, str) and "," not in x:
        return x
    if isinstance(x, (list, tuple)) and len(x) == 2 and \
            all(isinstance(y, int) and not isinstance(y, bool) for y in x):
        return f"{x[0]}:{x[1]}"
    raise ValueError(f"stage bounds entry {x!r} is not \"START:END\" or [START, END]")


def _convert(name: str, v: Any, key: str) -> Any:
    if name in ("host_mem", "kv_mem", "inline_max_bytes"):
        n = parse_bytes(v if isinstance(v, int) and not isinstance(v, bool) else str(v), key)
        if n <= 0:
            raise ValueError("must be positive")
        return n
    if name == "l3_segment":
        n = parse_bytes(v if isinstance(v, int) and not isinstance(v, bool) else str(v), key)
        if n < 0:
            raise ValueError("must not be negative")
        return n
    if name == "device_rows":
        return parse_device_rows(v)
    if name == "stage_bounds":  # "0:3,3:6", or a TOML list of "0:3" strings or [0, 3] pairs
        return parse_bounds(v if isinstance(v, str) else ",".join(_bound(x) for x in _list(v)))
    if name == "swa_full_tokens_ratio":
        return parse_fraction(str(v), key)
    if name == "shm_dirs":
        return tuple(str(x) for x in v) if isinstance(v, (list, tuple)) else \
            tuple(p for p in str(v).split(":") if p)
    if name in BOOL_FIELDS:
        return _parse_bool(v)
    if name in ("tp_size", "pp_size", "pp_rank", "metrics_port", "touch_threads",
                "load_event_sets", "max_clients", "ack_retention", "max_running", "parent_pid",
                "sparse_rows", "sparse_clients", "min_sparse_prompt_len",
                "pages_per_checkpoint"):
        return _int(v)
    if name in ("host_ratio", "heartbeat_timeout", "spin_us", "l3_epoch_recheck"):
        if isinstance(v, bool):
            raise ValueError(f"not a number: {v!r}")
        if name == "host_ratio" and isinstance(v, str) and ":" in v:
            return float(parse_fraction(v, "host_ratio"))  # "4:1", as plan reads it
        try:
            f = float(v)
        except ValueError:  # (float()'s own words name its internals)
            raise ValueError(f"must be a number, got {v!r}") from None
        if not math.isfinite(f):
            raise ValueError(f"not a finite number: {v!r}")
        return f
    if name == "numa_node":
        return str(v)
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {type(v).__name__}")
    return v


# settings of which one names a thing the other would name too: a later source (env over the
# file, flags over both) that sets one replaces an earlier source's other
EXCLUSIVE = (("kv_mem", "device_rows"), ("host_mem", "host_ratio"), ("preset", "model_config"))


def _apply(cfg: ServeConfig, values: Mapping[str, Any], source: str,
           sources: dict[str, str] | None = None) -> None:
    given = {("model_config" if k in ("config", "model-config") else k.replace("-", "_"))
             for k, v in values.items() if v is not None}
    for a, b in EXCLUSIVE:
        for mine, other in ((a, b), (b, a)):
            if mine in given and other not in given:
                setattr(cfg, other, default_value(other))
                if sources is not None:  # replaced: no longer where a value came from
                    sources.pop(other, None)
    for key, v in values.items():
        name = key.replace("-", "_")
        if name == "config":  # the old spelling of model_config
            name = "model_config"
        if name not in FIELDS:
            raise UsageError(f"{source}: {_unknown_key(key, v)}")
        if v is None:
            continue
        what = ("--" + name.replace("_", "-") if source == "command line" else
                ENV_PREFIX + name.upper() if source == "environment" else key)
        if sources is not None:
            sources[name] = f"{what} in {source}" if source.startswith("config file") else what
        try:
            setattr(cfg, name, _convert(name, v, what))
        except UsageError as e:  # names the setting, or is named here
            raise UsageError(f"{source}: {e}" if what in str(e) else
                             f"{source}: bad value for {what}: {e}") from None
        except (ValueError, TypeError) as e:
            raise UsageError(f"{source}: bad value for {what}: {e}") from None


def _unknown_key(key: str, value: Any) -> str:
    """A settings file's key that names no setting, with the nearest name (as ``check_env``
    does for variables): a table (``[server]``) is held against ``[serve]``, a key against the
    settings."""
    if isinstance(value, Mapping):  # a table: [serve], or a setting such as device_rows
        near = difflib.get_close_matches(key.replace("-", "_"), ["serve", *FIELDS], n=1)
        if near and near[0] != "serve":
            return (f"unknown table [{key}] (did you mean {near[0]!r}?); docs/config.md lists "
                    f"the settings")
        return (f"unknown table [{key}]{' (did you mean [serve]?)' if near else ''}; settings "
                f"go at the top level or under [serve] (docs/config.md lists them)")
    near = difflib.get_close_matches(key.replace("-", "_"), list(FIELDS), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return f"unknown setting {key!r}{hint}; docs/config.md lists the settings"


def _read_toml(path: str, what: str = "--config-file") -> dict[str, Any]:
    """The settings of TOML file ``path`` (top level and ``[serve]``); a refusal names
    ``what`` gave the path (``--config-file`` or ``HICACHE_CONFIG_FILE``)."""
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise UsageError("--config-file needs Python 3.11+ (tomllib) or the tomli "
                             "package") from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise UsageError(f"{what}: cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{what}: {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8; a Latin-1 comment is enough
        raise UsageError(f"{what}: {path} is not UTF-8 (byte {e.start}: "
                         f"{e.reason})") from None
    serve = data.pop("serve", {})  # settings may sit at the top level or under [serve]
    if not isinstance(serve, dict):
        raise UsageError(f"config file {path}: [serve] must be a table")
    both = sorted(set(data) & set(serve))
    if both:  # which one was meant cannot be told
        raise UsageError(f"config file {path}: {', '.join(both)} set both at the top level and "
                         f"under [serve]; keep one")
    data.update(serve)
    return data


# HICACHE_* variables that are no setting of ``hicache serve`` but that something else reads
# (value: who). ``check_env`` lets them pass; any other HICACHE_* name that is no setting is
# refused as a misspelling. A test greps the source tree for HICACHE_* names and checks that
# each one is a setting or listed here.
OTHER_ENV: dict[str, str] = {
    "HICACHE_CONFIG_FILE": "hicache serve: the settings file (= --config-file; load_config)",
    "HICACHE_SGLANG_MODEL": "the SGLang adapter (hicache.engine.sglang.plugin)",
    "HICACHE_SGLANG_PP_SIZE": "the SGLang adapter (hicache.engine.sglang.plugin)",
    "HICACHE_SGLANG_SOCKET": "the SGLang adapter (hicache.engine.sglang.plugin)",
    "HICACHE_SGLANG_TIMEOUT": "the SGLang adapter (hicache.engine.sglang.plugin)",
    "HICACHE_SGLANG_FORWARD_WAITS": "the SGLang adapter (hicache.engine.sglang.plugin)",
    "HICACHE_SHIM_EXECUTED": "hicache serve's own execution under the bind shim "
                             "(hicache.core.bind_shim.daemon_exec_env)",
    "HICACHE_BIND_ADDR": "the Mooncake bind() shim (hicache.core.bind_shim: loopback_env, and "
                         "daemon_exec_env, which hicache serve applies itself for a loopback "
                         "--l3-local-host)",
    "HICACHE_SGLANG_TEST_DEVICE": "tests/sglang/*.py, set by scripts/gpu_sglang.sh",
    "HICACHE_TEST_L3": "tests/sglang/check_dynamic_backend.py, set by "
                       "tests/test_sglang_adapter.py",
    "HICACHE_TIMING_ASSERT": "tests/test_reaper.py (docs/reliability.md)",
}


def without_serve_settings(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without what ``hicache serve`` would read as its settings: every ``HICACHE_*``
    setting, ``HICACHE_CONFIG_FILE`` and any other ``HICACHE_*`` name it would refuse (the
    variables in ``OTHER_ENV``, read by something else, stay). For a program that starts a
    daemon with settings of its own (the demo, the benches): an operator's exported settings
    or file must not change or refuse that daemon."""
    return {k: v for k, v in env.items() if not k.startswith(ENV_PREFIX)
            or (k in OTHER_ENV and k != "HICACHE_CONFIG_FILE")}


def check_env(env: Mapping[str, str]) -> None:
    """Refuse a ``HICACHE_*`` variable that names no setting and nothing in ``OTHER_ENV``: a
    misspelled setting would otherwise be ignored. One line, naming the nearest known name."""
    known = [s.env for s in SETTINGS] + list(OTHER_ENV)
    bad = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
    if bad:
        said = []
        for k in bad:  # compared without the prefix, which every name shares
            near = difflib.get_close_matches(k[len(ENV_PREFIX):],
                                             [n[len(ENV_PREFIX):] for n in known], n=1)
            said.append(f"{k} (did you mean {ENV_PREFIX}{near[0]}?)" if near else k)
        raise UsageError(f"environment: {', '.join(said)} "
                         f"{'names no setting' if len(bad) == 1 else 'name no settings'} of "
                         f"hicache serve (docs/config.md lists them); unset "
                         f"{'it' if len(bad) == 1 else 'them'} or correct the name")


def served_address(config_file: str | None = None,
                   env: Mapping[str, str] | None = None) -> str:
    """The socket of a daemon started from these sources (what ``hicache stats`` and an
    engine's ``Client()`` talk to when given no address): ``socket``, else ``device``'s default
    socket (cpu when unset), each from the settings file (``config_file``, else
    ``HICACHE_CONFIG_FILE``) and then ``HICACHE_SOCKET`` / ``HICACHE_DEVICE``, which win, as
    ``serve`` merges them. A value ``serve`` would refuse (an empty socket, a device that is not
    ``cpu`` or ``cuda:N``) is a ``UsageError`` naming where it came from, not another socket to
    wait on. Only these two settings are read."""
    return served_socket(config_file, env)[0]


def served_socket(config_file: str | None = None, env: Mapping[str, str] | None = None,
                  strict: bool = False) -> tuple[str, bool]:
    """``served_address``, and whether a socket was named (by the file or ``HICACHE_SOCKET``)
    rather than taken as ``device``'s default. ``strict`` (``hicache stats``, run beside the
    daemon's own settings): a key ``serve`` does not know is refused as ``serve`` refuses it;
    an engine's client (not strict) reads past it, as its hicache may be older than the
    daemon's."""
    env = os.environ if env is None else env
    path = config_file or env.get("HICACHE_CONFIG_FILE")
    data = _read_toml(path, "--config-file" if config_file else "HICACHE_CONFIG_FILE") \
        if path else {}
    for key, v in data.items() if strict else ():  # a misspelled key (``sockte``)
        if key.replace("-", "_") not in FIELDS and key != "config":
            raise UsageError(f"config file {path}: {_unknown_key(key, v)}")
    data = {k.replace("-", "_"): v for k, v in data.items()}
    found: dict[str, tuple[Any, str]] = {k: (data[k], f"{k} in config file {path}")
                                         for k in ("socket", "device") if k in data}
    for k in ("socket", "device"):
        if ENV_PREFIX + k.upper() in env:
            found[k] = (env[ENV_PREFIX + k.upper()], ENV_PREFIX + k.upper())
    if "socket" in found:
        addr, where = found["socket"]
        if not isinstance(addr, str):
            raise UsageError(f"the daemon's socket must be a string like ipc:///PATH, got a "
                             f"value of type {type(addr).__name__} (from {where})")
        if not addr.strip():
            raise UsageError(f"{where} is set but empty: unset it, or give the daemon's "
                             f"socket")
        return addr, True
    device, where = found.get("device", ("cpu", ""))
    try:
        check_device(device if isinstance(device, str) else repr(device))
    except UsageError as e:
        raise UsageError(f"{e} (from {where})") from None
    return default_socket(device), False


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    check_env(env)
    return {k[len(ENV_PREFIX):].lower(): v for k, v in env.items()
            if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX):].lower() in FIELDS}


def load_config(flags: Mapping[str, Any] | None = None, config_file: str | None = None,
                env: Mapping[str, str] | None = None) -> ServeConfig:
    """Merge defaults, the TOML file, HICACHE_* env and flags (later wins), then validate."""
    env = os.environ if env is None else env
    cfg = ServeConfig()
    sources: dict[str, str] = {}  # setting -> where its value came from (not the command line)
    given = config_file
    config_file = config_file or env.get("HICACHE_CONFIG_FILE")
    if config_file:
        _apply(cfg, _read_toml(config_file, "--config-file" if given else "HICACHE_CONFIG_FILE"),
               f"config file {config_file}", sources)
    _apply(cfg, _from_env(env), "environment", sources)
    if flags:
        _apply(cfg, {k: v for k, v in flags.items() if v is not None}, "command line", sources)
    cfg.__dict__["sources"] = sources  # for start-up refusals after this (``with_source``)
    if cfg.stage_bounds is not None and "pp_size" not in sources:  # as `hicache plan` reads it
        cfg.pp_size = pp_size_of(cfg.stage_bounds, None)
    try:
        validate(cfg)
    except UsageError as e:
        raise UsageError(with_source(str(e), cfg)) from None
    return cfg


# a flag, or the TOML key of a setting that has no flag (``named``)
_FLAG_RE = re.compile(r"--([a-z0-9-]+)|(?<![A-Za-z0-9_-])(" + "|".join(
    s.name for s in SETTINGS if not s.flag) + r")(?![A-Za-z0-9_])")


def with_source(msg: str, cfg: ServeConfig) -> str:
    """``msg`` (a check's refusal, naming settings as flags, or as TOML keys where they have
    no flag: ``named``) plus where each setting it names
    came from, when that is not the command line (a file's key, a HICACHE_* variable): the
    sources ``load_config`` recorded on ``cfg``."""
    sources: Mapping[str, str] = cfg.__dict__.get("sources", {})
    seen = []
    for m in _FLAG_RE.finditer(msg):
        where = sources.get((m.group(1) or m.group(2)).replace("-", "_"), "")
        if where and not where.startswith("--") and where not in seen:
            seen.append(where)
    return f"{msg} (from {', '.join(seen)})" if seen else msg


# ------------------------------------------------------------------------------- validation
_DEVICE_RE = re.compile(r"^(cpu|cuda:(\d+))$")


def check_device(text: str) -> None:
    """Refuse a device the daemon cannot serve: ``cpu`` or ``cuda:N`` (an index, always)."""
    if not _DEVICE_RE.fullmatch(text):
        raise UsageError(f"--device must be 'cpu' or 'cuda:N', got {text!r}")
MAX_TOUCH_THREADS = 1024
MAX_HEARTBEAT_TIMEOUT_S = 86400.0  # a day: longer keeps a dead engine's rows all that time
# shorter, the daemon's own loop (asleep up to 0.1 s between polls, housekeeping every quarter
# of the timeout, commands of up to controllers.server.STALL_S counted as silence) reaps
# clients that never stopped talking: a typo (0.01 for 10) would free every engine's rows
MIN_HEARTBEAT_TIMEOUT_S = 0.5

FLAGLESS = tuple(s.name for s in SETTINGS if not s.flag)  # TOML / environment only


def named(name: str) -> str:
    """How a refusal names setting ``name``: its flag, or for a setting that has none
    (``FLAGLESS``) its TOML key, which ``with_source`` follows with the file or variable it
    came from."""
    return name if name in FLAGLESS else "--" + name.replace("_", "-")


def check_shm_dirs(dirs: tuple[str, ...]) -> None:
    """Refuse ``shm_dirs`` unless each folder is absolute and the first (the only one the
    daemon uses) exists and is writable (and searchable) by this user: the daemon makes its
    wake-up socket and sparse regions there, and without it every engine's shared-memory
    channel would be refused later, quietly (requests fall back to ZMQ). Checked with the
    other settings, before anything is allocated."""
    if not dirs or any(not os.path.isabs(d) for d in dirs):
        raise UsageError(f"shm_dirs must name one or more absolute folders, ':'-separated; "
                         f"got {':'.join(dirs)!r}")
    for d in dirs[:1]:
        if not os.path.exists(d):
            why = "does not exist"
        elif not os.path.isdir(d):
            why = "is not a folder"
        elif not os.access(d, os.W_OK | os.X_OK):
            why = "is not writable by this user"
        else:
            try:  # a file made and removed at once: access() says yes to root where none
                fd, probe = tempfile.mkstemp(prefix=".hicache-check-", dir=d)  # can be (/sys)
            except OSError as e:
                why = f"takes no new file ({e.strerror})"
            else:
                os.close(fd)
                os.unlink(probe)
                continue
        raise UsageError(f"shm_dirs: {d} {why}: the daemon makes its wake-up socket there, "
                         f"and without it engines get no shared-memory channel")


def validate(cfg: ServeConfig) -> None:
    """Checks that need nothing but the values (the daemon checks the machine before it
    allocates: ports, socket folder, NUMA node)."""
    check_device(cfg.device)
    if cfg.preset is not None and cfg.model_config is not None:
        raise UsageError("give either --preset or --model-config, not both")
    if cfg.model_config is not None and str(cfg.model_config).endswith(".toml"):
        raise UsageError(f"--model-config (or --config) takes a model's config.json, not "
                         f"{cfg.model_config}: a settings file goes to --config-file")
    choices = {"swa_mode": ("paged", "ring"), "c128_state": ("online", "offline"),
               "pd_role": PD_ROLES, "write_policy": WRITE_POLICIES,
               "log_level": ("debug", "info", "warning", "error"),
               "copy_engine": ("auto", "on", "off"), "host_split": HOST_SPLITS}
    for name, allowed in choices.items():
        v = getattr(cfg, name)
        if (v.lower() if name == "log_level" else v) not in allowed:
            raise UsageError(f"--{name.replace('_', '-')} must be one of "
                             f"{' | '.join(allowed)}, got {v!r}")
    if cfg.indexer not in (None, "fp8", "fp4"):
        raise UsageError(f"--indexer must be fp8 or fp4, got {cfg.indexer!r}")
    if not cfg.metrics_addr.strip():  # (a bind to "" is every interface; the server refused it)
        raise UsageError(f"{named('metrics_addr')} is empty: give the address the metrics "
                         f"endpoint binds (default {default_value('metrics_addr')})")
    for name in ("tp_size", "pp_size", "max_running", "load_event_sets", "max_clients",
                 "ack_retention"):
        if getattr(cfg, name) <= 0:
            raise UsageError(f"{named(name)} must be positive, got {getattr(cfg, name)}")
    if cfg.stage_bounds is not None:
        pp_size_of(cfg.stage_bounds, cfg.pp_size)  # as many bounds as a given --pp-size says
    if not 0 <= cfg.pp_rank < cfg.pp_size:
        raise UsageError(f"--pp-rank must be in 0..{cfg.pp_size - 1} (--pp-size "
                         f"{cfg.pp_size}), got {cfg.pp_rank}")
    if cfg.kv_mem is not None and cfg.device_rows:
        raise UsageError("give --kv-mem (rows from the planner) or --device-rows, not both")
    if cfg.kv_mem is None:
        for name in ("max_running", "pd_role", "swa_full_tokens_ratio"):
            if given(cfg, name):
                raise UsageError(f"--{name.replace('_', '-')} sizes device rows from --kv-mem; "
                                 f"it does not apply to --device-rows")
    refuse_unused(cfg.swa_mode, host_mem=cfg.host_mem is not None,
                  swa_ratio=given(cfg, "swa_full_tokens_ratio"), pages_per_checkpoint=False,
                  host_split=cfg.host_split == "checkpoints" or given(cfg, "host_split"))
    check_shm_dirs(cfg.shm_dirs)
    if cfg.host_mem is not None and cfg.host_ratio is not None:
        raise UsageError("give either --host-mem (bytes) or --host-ratio, not both")
    if cfg.host_ratio is not None and not cfg.host_ratio > 0:
        raise UsageError(f"--host-ratio must be positive, got {cfg.host_ratio}")
    if cfg.host_split == "checkpoints":
        if cfg.pages_per_checkpoint < 1:
            raise UsageError(f"--pages-per-checkpoint must be positive, got "
                             f"{cfg.pages_per_checkpoint}")
    elif given(cfg, "pages_per_checkpoint"):
        raise UsageError("--pages-per-checkpoint applies to --host-split checkpoints only")
    if not 0 <= cfg.metrics_port <= 65535:
        raise UsageError(f"--metrics-port must be 0..65535, got {cfg.metrics_port}")
    if cfg.spin_us is not None and not 0 <= cfg.spin_us <= 100_000:
        raise UsageError(f"--spin-us must be 0..100000, got {cfg.spin_us}")
    if not MIN_HEARTBEAT_TIMEOUT_S <= cfg.heartbeat_timeout <= MAX_HEARTBEAT_TIMEOUT_S:
        raise UsageError(f"--heartbeat-timeout must be in [{MIN_HEARTBEAT_TIMEOUT_S:g}, "
                         f"{MAX_HEARTBEAT_TIMEOUT_S:g}] seconds, got {cfg.heartbeat_timeout:g}")
    if cfg.touch_threads is not None and not 1 <= cfg.touch_threads <= MAX_TOUCH_THREADS:
        raise UsageError(f"--touch-threads must be 1..{MAX_TOUCH_THREADS}, "
                         f"got {cfg.touch_threads}")
    if cfg.sparse_rows < 0:
        raise UsageError(f"--sparse-rows must be >= 0, got {cfg.sparse_rows}")
    if cfg.min_sparse_prompt_len < C4_RATIO:  # a shorter prompt has no C4 token: no row
        raise UsageError(f"--min-sparse-prompt-len must be at least {C4_RATIO} (one C4 token; "
                         f"a shorter prompt would hold no row, and nothing would bound how "
                         f"many a client admits), got {cfg.min_sparse_prompt_len}")
    if not 1 <= cfg.sparse_clients <= cfg.max_clients:
        raise UsageError(f"--sparse-clients must be 1..{cfg.max_clients} (max_clients), got "
                         f"{cfg.sparse_clients}")
    if cfg.numa_node not in ("auto", "off") and not cfg.numa_node.isdigit():
        raise UsageError(f"--numa-node must be 'auto', 'off' or a node number, "
                         f"got {cfg.numa_node!r}")
    if given(cfg, "copy_engine") and cfg.device == "cpu":
        raise UsageError(f"--copy-engine {cfg.copy_engine}: the copy engines are a GPU's (--device "
                         f"cuda:N); CPU mode copies with the CPU, so it does not apply")
    if cfg.parent_pid is not None and cfg.parent_pid <= 1:
        raise UsageError(f"--parent-pid must be a process id above 1, got {cfg.parent_pid}")
    _refuse_unused(cfg)
    _validate_l3(cfg)
    curve = check_curve(cfg)
    if cfg.socket is not None:
        path = cfg.socket[len("ipc://"):] if cfg.socket.startswith("ipc://") else ""
        if path and not path.startswith(("/", "@")):  # served, summed up and labelled as
            cfg.socket = f"ipc://{os.path.abspath(path)}"  # the path engines must be given
        try:
            check_address(cfg.socket, cfg.allow_remote, curve)
        except UsageError as e:  # named, so ``with_source`` can say where the value came from
            raise UsageError(f"--socket: {e}") from None


def metrics_listen(cfg: ServeConfig) -> str:
    """The start of a refusal of a metrics endpoint that cannot listen: the port, and the
    address when one was given (either may be the cause)."""
    from hicache.core.addresses import url_host

    addr = f"--metrics-addr {cfg.metrics_addr} " if given(cfg, "metrics_addr") else ""
    return (f"{addr}--metrics-port {cfg.metrics_port}: cannot listen on "
            f"{url_host(cfg.metrics_addr)}:{cfg.metrics_port}")


def tp_note(cfg: ServeConfig) -> str:
    """The start-up summary's words for ``--tp-size`` ("" at 1): it sizes nothing (MLA: every
    TP rank holds the stage's full KV, each rank's GPU has its own daemon), so it is said."""
    if cfg.tp_size == 1:
        return ""
    return (f", TP {cfg.tp_size} (one daemon per TP rank's GPU, each with the stage's full KV: "
            f"rows do not depend on it)")


def given(cfg: ServeConfig, name: str) -> bool:
    """Whether setting ``name`` counts as given where a check asks: away from its default
    (from any source), or typed on the command line even at its default. A settings file or a
    ``HICACHE_*`` variable at the default value is not (a file shared by every stage may list
    the defaults of options some daemons do not use, and a demo's daemon inherits the shell's
    variables)."""
    sources: Mapping[str, str] = cfg.__dict__.get("sources", {})
    return getattr(cfg, name) != default_value(name) or sources.get(name, "").startswith("--")


def _refuse_unused(cfg: ServeConfig) -> None:
    """An option given where it does not apply is refused, never ignored (defaults never are)."""
    if given(cfg, "metrics_addr") and not cfg.metrics_port:
        raise UsageError("--metrics-addr applies with --metrics-port (metrics are off)")
    for name in ("min_sparse_prompt_len", "sparse_clients"):
        if given(cfg, name) and not cfg.sparse_rows:
            raise UsageError(f"--{name.replace('_', '-')} applies with --sparse-rows (HiSparse "
                             f"is off)")
    if cfg.allow_remote and not (cfg.socket or "").startswith("tcp://"):
        raise UsageError("--allow-remote applies to a tcp:// --socket only (this one is ipc)")
    # what one mode's daemon never reads
    if cfg.device == "cpu" and given(cfg, "load_event_sets"):
        raise UsageError(f"{named('load_event_sets')} applies in GPU mode (--device cuda:N): "
                         f"a CPU load has no per-layer events")
    if cfg.device != "cpu" and given(cfg, "inline_max_bytes"):
        raise UsageError(f"{named('inline_max_bytes')} applies in CPU mode: a GPU daemon never "
                         f"copies on its server thread")
    if cfg.metrics_port and (cfg.socket or "").startswith("tcp://") \
            and cfg.socket.rpartition(":")[2] == str(cfg.metrics_port):
        raise UsageError(f"--metrics-port {cfg.metrics_port} is the port of --socket "
                         f"{cfg.socket}: each needs its own")
    if cfg.l3 == "off":
        off = [f"--{n.replace('_', '-')}" for n in ("l3_protocol", "l3_rdma_devices",
                                                     "l3_local_host", "l3_epoch_recheck")
               if given(cfg, n)]
        if off:
            raise UsageError(f"{', '.join(off)} given but --l3 is off (add --l3 mooncake)")


def _unspecified(host: str) -> bool:
    """Whether ``host`` is an unspecified address (``0.0.0.0``, ``::``): one to bind, never one
    a peer can connect to."""
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _ipv6_loopback(host: str) -> bool:
    """Whether ``host`` is an IPv6 loopback address, or an IPv4-mapped one (``::ffff:127.x``)."""
    import ipaddress

    try:
        a = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if a.version != 6:
        return False
    mapped = a.ipv4_mapped  # type: ignore[union-attr]
    return a.is_loopback or (mapped is not None and mapped.is_loopback)


SCOPE_RE = re.compile(r"^[A-Za-z0-9_.:@/+\-]{1,200}$")


def check_scope(scope: str | None) -> str | None:
    """None when ``scope`` can name the served weights in L3, else why not (one line)."""
    if not scope:
        return ("not given; name the served weights, e.g. deepseek-ai/DeepSeek-V4-Flash@<revision> "
                "(every daemon on the store with the same scope and layout shares pages: a "
                "fine-tune, or new weights, needs a scope of its own)")
    if not SCOPE_RE.fullmatch(scope):
        return f"{scope[:60]!r}: must be 1..200 characters of [A-Za-z0-9_.:@/+-]"
    return None


def _validate_l3(cfg: ServeConfig) -> None:
    if cfg.l3 not in ("off", "mooncake"):
        raise UsageError(f"--l3 must be 'off' or 'mooncake', got {cfg.l3!r}")
    if cfg.l3 == "off":
        names = [f"--{n.replace('_', '-')}" for n in ("l3_master", "l3_metadata", "l3_scope",
                                                       "l3_segment") if given(cfg, n)]
        if names:
            raise UsageError(f"{', '.join(names)} given but --l3 is off (add --l3 mooncake)")
        return
    m = re.match(r"^[^:\s]+:(\d{1,5})$", cfg.l3_master or "")
    if not m or not 0 < int(m.group(1)) <= 65535:
        raise UsageError("--l3 mooncake needs --l3-master HOST:PORT (port 1..65535), "
                         + (f"got {cfg.l3_master!r}" if cfg.l3_master else "not given"))
    md = cfg.l3_metadata
    if not md or not (md == "P2PHANDSHAKE" or re.match(r"^https?://[^\s/]+/\S*$", md)):
        raise UsageError("--l3 mooncake needs --l3-metadata http://HOST:PORT/metadata (or "
                         "P2PHANDSHAKE), " + (f"got {md!r}" if md else "not given"))
    if cfg.l3_protocol not in ("tcp", "rdma"):
        raise UsageError(f"--l3-protocol must be 'tcp' or 'rdma', got {cfg.l3_protocol!r}")
    if given(cfg, "l3_rdma_devices") and cfg.l3_protocol != "rdma":
        raise UsageError("--l3-rdma-devices applies to --l3-protocol rdma only")
    if _unspecified(cfg.l3_local_host):
        raise UsageError(f"--l3-local-host {cfg.l3_local_host}: this is the address the store "
                         f"tells its peers to connect to, and no peer can connect to an "
                         f"unspecified address; give this node's address (127.0.0.1 for a "
                         f"loopback store)")
    if _ipv6_loopback(cfg.l3_local_host):
        # Mooncake's listeners would bind every interface: the bind shim binds IPv4 loopback
        raise UsageError(f"--l3-local-host {cfg.l3_local_host}: Mooncake's listeners cannot "
                         f"be kept on IPv6 loopback (they would listen on every interface); "
                         f"give 127.0.0.1 for a loopback store")
    if not 0 < cfg.l3_epoch_recheck <= 3600:
        raise UsageError(f"--l3-epoch-recheck must be in (0, 3600] seconds, got "
                         f"{cfg.l3_epoch_recheck:g}")
    why = check_scope(cfg.l3_scope)
    if why is not None:
        raise UsageError(f"--l3 mooncake needs --l3-scope: {why}" if not cfg.l3_scope else
                         f"--l3-scope {why}")


# ------------------------------------------------------------------------------- sizing
class Sizing(NamedTuple):
    layout: Layout
    device_rows: dict[str, int]
    host_rows: dict[str, int]
    source: str  # how the device rows were chosen, for the summary
    # the planner's warnings for this stage (``StagePlan.warnings``; none with --device-rows)
    warnings: tuple[str, ...] = ()


def sizing(cfg: ServeConfig) -> Sizing:
    """Layout, device rows and host rows of the stage ``cfg`` serves (module docstring).
    A refusal of the layout or of the host rows that names no setting is led by the one whose
    value it judged (so ``with_source`` can say where that value came from)."""
    try:
        layout, dev, source, warnings, planned = _device_sizing(cfg)
    except LayoutError as e:
        raise UsageError(_led(str(e), "stage_bounds" if cfg.stage_bounds else "pp_size")) \
            from None
    if cfg.host_mem is None and cfg.host_ratio is None:
        raise UsageError("give the host memory: --host-mem 256GiB or --host-ratio 2")
    try:
        layouts, devs = _stages(cfg, layout, dev, planned)
        hosts = stage_host_rows(layouts, devs, cfg.host_mem, cfg.host_ratio, cfg.host_split,
                                cfg.pages_per_checkpoint)
    except UsageError as e:
        raise type(e)(_led(str(e), "host_mem" if cfg.host_mem is not None else "host_ratio")) \
            from None
    host = hosts[cfg.pp_rank] if len(hosts) > 1 else hosts[0]
    if cfg.host_split == "checkpoints":
        source += f"; host split for checkpoints, 1 per {cfg.pages_per_checkpoint} pages"
    if len(hosts) > 1:
        source += f"; host rows agreed over the {len(hosts)} PP stages (the fewest per space)"
    if not cfg.force:
        what = (f"--host-mem {format_bytes(cfg.host_mem)}" if cfg.host_mem is not None
                else f"--host-ratio {cfg.host_ratio:g}")
        if len(hosts) > 1:
            what += f" (host rows agreed over the {len(hosts)} PP stages)"
        check_host_larger(layout, dev, host, what,
                          ("page",) if cfg.host_split == "checkpoints" else None)
    return Sizing(layout, dev, host, source, warnings)


def _stages(cfg: ServeConfig, layout: Layout, dev: dict[str, int], planned: Any
            ) -> tuple[list[Layout], list[dict[str, int]]]:
    """The stages whose host rows this stage's must agree with (``planner.stage_host_rows``):
    with ``host_mem`` and more than one stage every stage, with the planner's device rows
    (``planned``: the plan's stages, with ``kv_mem``) or this stage's ``device_rows`` on each
    (a stage that uses an index space this one has no rows for is refused: its rows cannot
    be known here); else this one."""
    if cfg.host_mem is None or cfg.pp_size == 1:
        return [layout], [dev]
    if planned is not None:
        return [s.layout for s in planned], [dict(s.device_rows) for s in planned]
    layouts = stage_layouts(cfg.plan_inputs(), cfg.swa_mode)
    devs = []
    for lay in layouts:
        need = used_spaces(lay)
        missing = [s for s in need if s not in dev]
        if missing:
            raise UsageError(
                f"--host-mem with {cfg.pp_size} pipeline stages sizes every stage's host rows "
                f"alike, from --device-rows on each; stage {lay.stage.pp_rank} uses index "
                f"space {', '.join(missing)}, which this stage has no rows for: give "
                f"--host-ratio instead")
        devs.append({s: dev[s] for s in need})
    return layouts, devs


def _led(msg: str, name: str) -> str:
    """``msg``, led by setting ``name`` when it names no setting itself."""
    return msg if _FLAG_RE.search(msg) else f"{named(name)}: {msg}"


def _device_sizing(cfg: ServeConfig
                   ) -> tuple[Layout, dict[str, int], str, tuple[str, ...], Any]:
    """(layout, device rows, how they were chosen, the planner's warnings, the plan's stages
    with ``kv_mem``, else None)."""
    if cfg.kv_mem is not None:
        pl = plan(cfg.plan_inputs())
        stage = pl.stages[cfg.pp_rank]
        layout, dev = stage.layout, dict(stage.device_rows)
        warnings = stage.warnings
        held = dev["page"] * layout.model.page_size if "page" in dev else None
        source = (f"planner: --kv-mem {format_bytes(cfg.kv_mem)}, {pl.request_slots} request "
                  f"slots, {held if held is not None else 'no'} device tokens")
    elif cfg.device_rows:
        layout = cfg.layout()
        dev, source, warnings = dict(cfg.device_rows), "--device-rows", ()
        try:
            check_rows(layout, dev)  # every space this stage uses, and no other
        except UsageError as e:
            raise UsageError(f"--device-rows: {e}") from None
    else:
        raise UsageError("size the device pools: --kv-mem 100GiB (rows from the planner, as "
                         "`hicache plan` prints them) or --device-rows page=N,swa_page=M,"
                         "req_slot=K")
    return layout, dev, source, warnings, pl.stages if cfg.kv_mem is not None else None


# ------------------------------------------------------------------------------- docs
def default_value(name: str) -> Any:
    """Setting ``name``'s default value (a fresh one where the field has a factory)."""
    f = FIELDS[name]
    if f.default is dataclasses.MISSING:
        return f.default_factory()  # type: ignore[misc]
    return f.default


def default_text(name: str) -> str:
    """A setting's default as an operator reads it (``""``: none)."""
    default = default_value(name)
    if isinstance(default, Fraction):
        default = float(default)
    if isinstance(default, tuple):
        return ":".join(default)
    return "" if default in (None, {}, (), "") else str(default)


def markdown() -> str:
    """The settings table of docs/config.md."""
    rows = ["| flag | environment | TOML key | default | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        text = default_text(s.name)
        shown = f"`{text}`" if text else "—"
        flag = f"`{s.option}`" if s.option else "—"
        rows.append(f"| {flag} | `{s.env}` | `{s.name}` | {shown} | "
                    f"{s.help.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    from hicache.core.stdout import print_all

    sys.exit(print_all(markdown()))
