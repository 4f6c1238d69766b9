"""Every setting of ``hicache serve``, declared once: its name (the ``ServeConfig`` field and TOML
key), its flag group, its help, whether it has a flag, and older spellings kept as hidden
aliases. The flags, the ``HICACHE_*`` variables and docs/config.md's table all come from
``SETTINGS`` (``hicache.core.config`` checks that every field has an entry).
"""
from __future__ import annotations

from typing import NamedTuple

ENV_PREFIX = "HICACHE_"


class Setting(NamedTuple):
    name: str  # field name = TOML key
    group: str  # flag group of ``hicache serve -h``
    help: str
    flag: bool = True  # False: TOML / environment only
    aliases: tuple[str, ...] = ()  # older spellings, accepted and hidden

    @property
    def option(self) -> str | None:
        return "--" + self.name.replace("_", "-") if self.flag else None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


_D, _M, _S, _H, _E = "daemon", "model and stage", "device sizing", "host memory", "engine side"
_L = "L3 tier (Mooncake Store; needs the 'l3' extra)"
SETTINGS: tuple[Setting, ...] = (
    Setting("device", _D, "cuda:N or cpu (CPU mode: plain shared memory, no GPU)"),
    Setting("socket", _D, "ipc://PATH (a relative PATH is served and shown as its absolute path) "
            "or tcp://127.0.0.1:PORT [ipc://$XDG_RUNTIME_DIR/hicache/"
            "<device>.sock, e.g. cuda0.sock; /tmp/hicache-$UID/... without a runtime dir]"),
    Setting("allow_remote", _D, "accept a non-loopback tcp address (needs both CURVE settings)"),
    Setting("curve_secret_key", _D, "the daemon's CURVE secret key file (mode 0600, zmq.auth "
            "certificate format)"),
    Setting("curve_clients", _D, "directory of the allowed clients' CURVE public .key files"),
    Setting("heartbeat_timeout", _D, "seconds of silence after which a client is reaped "
            "(0.5..86400)"),
    Setting("metrics_port", _D, "Prometheus /metrics port (0 = off)"),
    Setting("metrics_addr", _D, "address the metrics endpoint binds"),
    Setting("log_level", _D, "debug, info, warning or error: the level of hicache's own loggers "
            "(other libraries log warnings and errors only)"),
    Setting("spin_us", _D, "busy-poll this many microseconds after a request before sleeping "
            "(lower latency, more CPU; 0 = never) [50000 in GPU mode: one core while the engine "
            "sends commands; 0 in CPU mode]"),
    Setting("dumpable", _D, "leave the daemon dumpable: processes of its uid may then ptrace it, "
            "read its memory (every client's host-tier bytes) and open its descriptors, and it "
            "may write core files (for debuggers and profilers; off by default)"),
    Setting("allow_shutdown", _D, "accept the shutdown command from clients (off by default: "
            "it is refused, and only a stop signal or --parent-pid stops the daemon)"),
    Setting("parent_pid", _D, "exit when this process exits (set by demo and bench launchers)"),
    Setting("inline_max_bytes", _D, "CPU mode: operations up to this size run on the server "
            "thread", flag=False),
    Setting("copy_engine", _D, "GPU mode: auto, on or off: big page rows (32 KiB or more) move "
            "between host and GPU as batched copy-engine DMA (needs a CUDA 12.8+ driver; 'on' "
            "refuses to start without it) [auto]"),
    Setting("load_event_sets", _D, "GPU mode: sets of per-layer load events, used round robin",
            flag=False),
    Setting("max_clients", _D, "clients tracked at most", flag=False),
    Setting("ack_retention", _D, "acks kept per client for poll_acks", flag=False),
    Setting("shm_dirs", _D, "where the daemon keeps its wake-up socket (the first of these "
            "':'-separated folders; CPU device pools are memfds handed in and need none)",
            flag=False),
    Setting("preset", _M, "model preset: dsv4-flash, dsv4-pro, dsv4-tiny"),
    Setting("model_config", _M, "a Hugging Face style config.json (instead of --preset)",
            aliases=("--config",)),
    Setting("tp_size", _M, "tensor parallel size (MLA: every TP rank holds the full KV pools, so "
            "the rows do not change)"),
    Setting("pp_size", _M, "pipeline stages (even split, the last stages taking the "
            "remainder as SGLang does, unless --stage-bounds) [1, or the number of "
            "--stage-bounds]"),
    Setting("pp_rank", _M, "the stage this daemon serves, 0..pp-size-1"),
    Setting("stage_bounds", _M, "explicit [start,end) target layers per stage, e.g. 0:22,22:43"),
    Setting("swa_mode", _M, "paged (SWA pages) or ring (one SWA ring per request slot)"),
    Setting("c128_state", _M, "online (1 row per request) or offline (128-slot ring)"),
    Setting("mtp", _M, "MTP draft layers on the last stage [the model's own]"),
    Setting("indexer", _M, "fp8 or fp4 C4 indexer keys [the model's own]"),
    Setting("kv_mem", _S, "KV budget per GPU: device rows from the planner, as `hicache plan` "
            "prints them (instead of --device-rows)"),
    Setting("max_running", _S, "with --kv-mem: running requests per worker (request slots)"),
    Setting("pd_role", _S, "with --kv-mem: none, prefill or decode (decode keeps 2 x "
            "max-running slots)"),
    Setting("swa_full_tokens_ratio", _S, "with --kv-mem, paged SWA: SWA tokens / full tokens, "
            "in (0, 1]"),
    Setting("device_rows", _S, "device rows per index space, e.g. page=4096,swa_page=512,"
            "req_slot=64 (instead of --kv-mem)"),
    Setting("host_mem", _H, "host pool size per GPU, e.g. 256GiB (rows in proportion to the "
            "device rows)"),
    Setting("host_ratio", _H, "host rows = ratio x device rows (instead of --host-mem)"),
    Setting("host_split", _H, "how --host-mem is split over the index spaces: device (in the "
            "device rows' proportions: a full mirror) or checkpoints (page rows, and one "
            "checkpoint row per --pages-per-checkpoint of them: a checkpoints mirror)"),
    Setting("pages_per_checkpoint", _H, "with --host-split checkpoints: page rows per "
            "checkpoint row"),
    Setting("force", _H, "accept a host tier not larger than the device pools"),
    Setting("numa_node", _H, "auto (the GPU's node), off, or a node number"),
    Setting("zero_on_free", _H, "zero host rows when they are freed (rows are unreadable until "
                                "their owner backs something up into them either way)"),
    Setting("touch_threads", _H, "threads first-touching the host pool [by node and size]"),
    Setting("sparse_rows", _H, "HiSparse: C4 page rows per C4 layer of each client's sparse "
            "host region (0 = no sparse mode; docs/hisparse.md)"),
    Setting("sparse_clients", _H, "HiSparse: clients that may hold a sparse region at once, "
            "each its own region of --sparse-rows rows, made on its first sparse command [1]"),
    Setting("min_sparse_prompt_len", _H, "HiSparse: shortest prompt (full tokens) admitted to "
            "sparse mode; at least 4 (one C4 token)"),
    Setting("write_policy", _E, "write_through, write_through_selective or write_back: the "
            "radix cache's write policy for engines of this daemon that set none"),
    Setting("l3", _L, "off or mooncake [off]"),
    Setting("l3_master", _L, "mooncake_master address HOST:PORT"),
    Setting("l3_metadata", _L, "metadata server URL, e.g. http://127.0.0.1:8080/metadata"),
    Setting("l3_scope", _L, "the served weights, e.g. deepseek-ai/DeepSeek-V4-Flash@REVISION: "
            "part of every L3 object's name (required with --l3 mooncake; a fine-tune or new "
            "weights need their own scope)"),
    Setting("l3_protocol", _L, "transfer protocol: tcp or rdma [tcp]"),
    Setting("l3_rdma_devices", _L, "RDMA devices for --l3-protocol rdma"),
    Setting("l3_local_host", _L, "address this daemon's store client advertises [127.0.0.1]"),
    Setting("l3_segment", _L, "memory this daemon contributes to the store, e.g. 4GiB (0: pages "
                              "live in other members' segments)"),
    Setting("l3_epoch_recheck", _L, "key store: seconds a namespace's epoch read from L3 is used "
            "for L3 reads before it is read again (another daemon's kv_clear is seen within "
            "about this long), in (0, 3600] [2]"),
)
BOOL_FIELDS = ("allow_remote", "mtp", "force", "zero_on_free", "dumpable", "allow_shutdown")
