"""One typed configuration for ``hicache serve``: defaults < TOML file < HICACHE_* env < flags.

``ServeConfig`` holds every setting; ``load_config(flags, config_file=None, env=os.environ)``
merges the sources (``flags`` holds only what the command line set). Keys are the field names;
in TOML and flags a dash may replace an underscore, the environment uses ``HICACHE_<NAME>``
(``HICACHE_HOST_MEM=8GiB``, ``HICACHE_DEVICE_ROWS=page=4096,swa_page=512,req_slot=64``).
Every bad value raises ``UsageError`` naming the key and where it came from.

Socket addresses: ``ipc://PATH`` (default: ``$XDG_RUNTIME_DIR/hicache/<device>.sock`` or
``/tmp/hicache-$UID/<device>.sock``, directory 0700, socket 0600), ``tcp://`` on loopback;
any other address needs ``allow_remote`` *and* CURVE (``curve_secret_key``: the daemon's
secret key file, private; ``curve_clients``: a directory of allowed client public keys, both
in ``zmq.auth`` certificate format). CURVE may also be used on loopback.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from hicache.core.errors import UsageError
from hicache.core.layout import INDEX_SPACES

ENV_PREFIX = "HICACHE_"


@dataclass
class ServeConfig:
    device: str = "cpu"  # "cpu" or "cuda:N"
    socket: str | None = None  # None: default ipc socket under the runtime dir
    allow_remote: bool = False
    preset: str | None = None
    model_config: str | None = None  # HF-style config.json (``--config``)
    pp_size: int = 1
    pp_rank: int = 0
    swa_mode: str = "paged"
    c128_state: str = "online"
    mtp: bool = True
    host_mem: int | None = None  # bytes
    host_ratio: float | None = None
    device_rows: dict[str, int] = field(default_factory=dict)
    metrics_port: int = 0  # 0 = off
    metrics_addr: str = "127.0.0.1"
    heartbeat_timeout: float = 10.0
    numa_node: str = "auto"  # "auto", "off" or a node number
    touch_threads: int | None = None
    inline_max_bytes: int = 256 << 10  # CPU mode: ops up to this size run on the server thread
    spin_us: float = 0.0  # busy-poll this long after a request before sleeping (0 = never)
    load_event_sets: int = 4  # GPU mode: sets of per-layer load events, used round robin
    max_clients: int = 64
    ack_retention: int = 4096  # acks kept per client for poll_acks
    shm_dirs: tuple[str, ...] = ("/dev/shm",)  # CPU mode: where device-pool files may live
    zero_on_free: bool = False  # zero a host row's bytes when it is freed (reads need a write anyway)
    curve_secret_key: str | None = None  # the daemon's CURVE secret key file (zmq.auth format)
    curve_clients: str | None = None  # directory of allowed clients' CURVE public .key files
    log_level: str = "info"
    sparse_rows: int = 0  # HiSparse: C4 page rows per C4 layer of the sparse host region (0 = off)
    min_sparse_prompt_len: int = 32768  # HiSparse: shortest prompt (full tokens) admitted

    @property
    def cuda_index(self) -> int | None:
        return None if self.device == "cpu" else int(self.device.split(":")[1])

    def layout(self):  # -> hicache.core.layout.Layout
        from hicache.core.layout import build_layout, load_model

        if self.preset is None and self.model_config is None:
            raise UsageError("no model given: use --preset NAME or --config config.json")
        model = load_model(self.preset, self.model_config)
        return build_layout(model, self.pp_size, self.pp_rank, swa_mode=self.swa_mode,
                            c128_state=self.c128_state, mtp=self.mtp)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shm_dirs"] = list(self.shm_dirs)
        return d


FIELDS = {f.name: f for f in dataclasses.fields(ServeConfig)}


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
        if isinstance(n, bool):
            raise ValueError(f"rows for {k} must be an int")
        n = int(n)
        if n <= 0:
            raise ValueError(f"rows for {k} must be positive, got {n}")
        out[k] = n
    return out


def _parse_bytes(v: Any) -> int:
    from hicache.core.sizes import parse_bytes

    n = parse_bytes(v if isinstance(v, int) and not isinstance(v, bool) else str(v))
    if n <= 0:
        raise ValueError("must be positive")
    return n


def _convert(name: str, v: Any) -> Any:
    if name in ("host_mem", "inline_max_bytes"):
        return _parse_bytes(v)
    if name == "device_rows":
        return parse_device_rows(v)
    if name == "shm_dirs":
        return tuple(str(x) for x in v) if isinstance(v, (list, tuple)) else \
            tuple(p for p in str(v).split(":") if p)
    if name in ("allow_remote", "mtp", "zero_on_free"):
        return _parse_bool(v)
    if name in ("pp_size", "pp_rank", "metrics_port", "touch_threads", "load_event_sets",
                "max_clients", "ack_retention", "sparse_rows", "min_sparse_prompt_len"):
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError(f"not an int: {v!r}")
        return int(v)
    if name in ("host_ratio", "heartbeat_timeout", "spin_us"):
        if isinstance(v, bool):
            raise ValueError(f"not a number: {v!r}")
        return float(v)
    if name == "numa_node":
        return str(v)
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {type(v).__name__}")
    return v


def _apply(cfg: ServeConfig, values: Mapping[str, Any], source: str) -> None:
    for key, v in values.items():
        name = key.replace("-", "_")
        if name == "config":  # the flag --config is the model config.json
            name = "model_config"
        if name not in FIELDS:
            raise UsageError(f"{source}: unknown setting {key!r}; settings are "
                             f"{', '.join(sorted(FIELDS))}")
        if v is None:
            continue
        try:
            setattr(cfg, name, _convert(name, v))
        except (ValueError, TypeError) as e:
            raise UsageError(f"{source}: bad value for {key}: {e}") from None


def _read_toml(path: str) -> dict[str, Any]:
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
        raise UsageError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"config file {path} is not valid TOML: {e}") from None
    # settings may sit at the top level or under [serve]
    serve = data.pop("serve", {})
    if not isinstance(serve, dict):
        raise UsageError(f"config file {path}: [serve] must be a table")
    data.update(serve)
    return data


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out = {}
    for k, v in env.items():
        if not k.startswith(ENV_PREFIX) or k == "HICACHE_CONFIG_FILE":
            continue
        name = k[len(ENV_PREFIX):].lower()
        if name in FIELDS:
            out[name] = v
    return out


def load_config(flags: Mapping[str, Any] | None = None, config_file: str | None = None,
                env: Mapping[str, str] | None = None) -> ServeConfig:
    """Merge defaults, the TOML file, HICACHE_* env and flags (later wins), then validate."""
    env = os.environ if env is None else env
    cfg = ServeConfig()
    config_file = config_file or env.get("HICACHE_CONFIG_FILE")
    if config_file:
        _apply(cfg, _read_toml(config_file), f"config file {config_file}")
    _apply(cfg, _from_env(env), "environment")
    if flags:
        _apply(cfg, {k: v for k, v in flags.items() if v is not None}, "command line")
    validate(cfg)
    return cfg


# ------------------------------------------------------------------------------- validation
_DEVICE_RE = re.compile(r"^(cpu|cuda:(\d+))$")


def validate(cfg: ServeConfig) -> None:
    if not _DEVICE_RE.match(cfg.device):
        raise UsageError(f"device must be 'cpu' or 'cuda:N', got {cfg.device!r}")
    if cfg.preset is not None and cfg.model_config is not None:
        raise UsageError("give either a preset or a model config file, not both")
    if cfg.swa_mode not in ("paged", "ring"):
        raise UsageError(f"swa_mode must be 'paged' or 'ring', got {cfg.swa_mode!r}")
    if cfg.c128_state not in ("online", "offline"):
        raise UsageError(f"c128_state must be 'online' or 'offline', got {cfg.c128_state!r}")
    if cfg.host_mem is not None and cfg.host_ratio is not None:
        raise UsageError("give either host_mem (bytes) or host_ratio, not both")
    if cfg.host_ratio is not None and not cfg.host_ratio > 0:
        raise UsageError(f"host_ratio must be positive, got {cfg.host_ratio}")
    if not 0 <= cfg.metrics_port <= 65535:
        raise UsageError(f"metrics_port must be 0..65535, got {cfg.metrics_port}")
    if not 0 <= cfg.spin_us <= 100_000:
        raise UsageError(f"spin_us must be 0..100000, got {cfg.spin_us}")
    if not cfg.heartbeat_timeout > 0:
        raise UsageError(f"heartbeat_timeout must be positive, got {cfg.heartbeat_timeout}")
    for name in ("load_event_sets", "max_clients", "ack_retention"):
        if getattr(cfg, name) <= 0:
            raise UsageError(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.sparse_rows < 0:
        raise UsageError(f"sparse_rows must not be negative, got {cfg.sparse_rows}")
    if cfg.min_sparse_prompt_len <= 0:
        raise UsageError(f"min_sparse_prompt_len must be positive, got {cfg.min_sparse_prompt_len}")
    if cfg.numa_node not in ("auto", "off") and not cfg.numa_node.isdigit():
        raise UsageError(f"numa_node must be 'auto', 'off' or a node number, got {cfg.numa_node!r}")
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise UsageError(f"log_level must be debug, info, warning or error, got {cfg.log_level!r}")
    curve = check_curve(cfg)
    if cfg.socket is not None:
        check_address(cfg.socket, cfg.allow_remote, curve)


def check_curve(cfg: ServeConfig) -> bool:
    """True when CURVE is configured (both settings, a private key file, a client directory)."""
    key, clients = cfg.curve_secret_key, cfg.curve_clients
    if key is None and clients is None:
        return False
    if key is None or clients is None:
        raise UsageError("CURVE needs both --curve-secret-key (the daemon's secret key file) "
                         "and --curve-clients (a directory of allowed client public keys)")
    try:
        st = os.stat(key)
    except OSError as e:
        raise UsageError(f"curve secret key {key}: {e.strerror}") from None
    if st.st_mode & 0o077:
        raise UsageError(f"curve secret key {key} is readable by other users (mode "
                         f"{st.st_mode & 0o777:o}); chmod 600 it")
    if not os.path.isdir(clients):
        raise UsageError(f"curve clients directory {clients} does not exist")
    return True


def runtime_dir() -> str:
    """Owner-only directory for default sockets: $XDG_RUNTIME_DIR/hicache or /tmp/hicache-UID."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return os.path.join(base, "hicache")
    return f"/tmp/hicache-{os.getuid()}"


def default_socket(device: str) -> str:
    tag = device.replace(":", "")
    return f"ipc://{os.path.join(runtime_dir(), tag + '.sock')}"


def check_address(addr: str, allow_remote: bool = False, curve: bool = False) -> str:
    """Return the transport ('ipc' or 'tcp') of an acceptable address, else raise UsageError:
    a non-loopback tcp address needs ``allow_remote`` and CURVE."""
    if addr.startswith("ipc://"):
        path = addr[len("ipc://"):]
        if not path or path.startswith("@"):
            raise UsageError(f"ipc socket {addr!r}: give a filesystem path (abstract sockets "
                             f"have no permissions)")
        return "ipc"
    if addr.startswith("tcp://"):
        host, _, port = addr[len("tcp://"):].rpartition(":")
        host = host.strip("[]")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"tcp address {addr!r} needs a port, e.g. tcp://127.0.0.1:5577")
        loopback = host == "localhost"
        if not loopback:
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = False
        if loopback:
            return "tcp"
        if not allow_remote:
            raise UsageError(f"{addr} is not a loopback address; remote clients need "
                             f"--allow-remote and CURVE keys")
        if not curve:
            raise UsageError(f"{addr}: remote access needs CURVE authentication: give "
                             f"--curve-secret-key and --curve-clients")
        return "tcp"
    raise UsageError(f"unsupported socket address {addr!r}; use ipc://PATH or "
                     f"tcp://127.0.0.1:PORT")
