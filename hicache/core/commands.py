"""The command table of wire protocol v1 (a leaf module): every command declared once, with its
request fields, reply fields, whether an ack follows, its daemon handler and one line of what
it does. ``protocol`` validates against it, the fuzzer draws from it, the daemon looks up its
handlers in it, and ``markdown_table()`` is docs/protocol.md's table (a test keeps them equal).
"""
from __future__ import annotations

from dataclasses import dataclass

# ------------------------------------------------------------------------------- schemas
# A field spec: (types, required). ``int`` excludes bool. ``"frame"`` = index of an index frame.
# ``"str_int_map"`` = {str: int>=0}. Nested structures (items, buffers, draft) are shape-checked
# here and value-checked by the daemon's handlers.
_T = {
    "int": (int,), "bool": (bool,), "str": (str,), "dict": (dict,), "list": (list,),
    "frame": (int,), "str_int_map": (dict,), "int_list": (list,), "str_list": (list,),
    "opt_str": (str, type(None)), "opt_int": (int, type(None)), "opt_int_list": (list, type(None)),
}

@dataclass(frozen=True)
class Command:
    """One command, declared once: its request fields ``{name: (kind, required)}``, the fields
    of its reply, whether an operation ack follows (``acks``), the daemon's handler function
    (``controllers.handlers``), and one line of what it does. Validation, the fuzzer's
    vocabulary, docs/protocol.md's table and the client's methods all read this table."""

    name: str
    fields: dict[str, tuple[str, bool]]
    reply: tuple[str, ...]
    acks: bool
    handler: str
    summary: str


# L3 object kind: mirror "full" (default) or "checkpoints"; ckpt: the checkpoints of the keys
_L3_KIND = {"mirror": ("str", False), "ckpt": ("bool", False)}
_TABLE: tuple[Command, ...] = (
    Command("heartbeat", {"full": ("bool", False)},
            ("t", "version", "protocol", "device", "heartbeat_timeout", "registered", "reaped",
             "pid", "pid_start"),
            False,
            "heartbeat", "liveness; with full, the daemon's layout and host rows"),
    Command("register", {"layout": ("dict", True), "device_rows": ("str_int_map", True),
                         "buffers": ("dict", True), "mode": ("str", True),
                         "tp_rank": ("int", False), "events": ("str_list", False),
                         "name": ("opt_str", False), "fd_token": ("int", False)},
            ("client", "host_rows", "device", "stage_layers", "load_events", "heartbeat_timeout",
             "session"),
            False,
            "register", "open a worker's device pools (sealed memfds handed in, or CUDA IPC) and "
                        "events"),
    Command("hand_in", {"count": ("int", True)}, ("fd_socket", "fd_token"), False, "hand_in",
            "CPU: take a worker's pool descriptors (sealed memfds) in on the descriptor socket "
            "for its register"),
    Command("unregister", {}, ("freed", "deferred"), False, "unregister",
            "free the client's rows and close its device mappings"),
    Command("alloc", {"counts": ("str_int_map", True), "request": ("opt_str", False)},
            ("rows",), False, "alloc", "allocate host rows in several spaces, all or none"),
    Command("free", {"rows": ("str_int_map", True), "request": ("opt_str", False)},
            ("freed", "deferred"), False, "free", "free host rows (deferred while in flight)"),
    Command("backup", {"items": ("list", True), "wait_event": ("opt_int", False),
                       "alloc": ("bool", False), "request": ("opt_str", False)},
            ("op", "ack", "rows"), True, "backup",
            "device -> host copy of rows or tokens; with alloc, into rows it allocates"),
    Command("load", {"items": ("list", True), "wait_event": ("opt_int", False)},
            ("op", "ack", "event_set", "issued"), True, "load",
            "host -> device copy, layer by layer, one event per stage layer on GPU"),
    Command("swap_out", {"slot": ("int", True), "request": ("opt_str", False),
                         "host_row": ("opt_int", False), "wait_event": ("opt_int", False)},
            ("op", "ack", "host_row"), True, "swap_out",
            "copy one request slot's state rows to a host row"),
    Command("swap_in", {"host_row": ("int", True), "slot": ("int", True),
                        "release": ("bool", False), "request": ("opt_str", False)},
            ("op", "ack", "event_set", "issued"), True, "swap_in",
            "copy a swapped-out request back into any slot"),
    Command("clear_slot", {"slots": ("int_list", True), "draft": ("dict", False)},
            ("op", "ack"), True, "clear_slot",
            "zero request slots, or apply the MTP draft rule to their state rings"),
    Command("poll_acks", {"ops": ("opt_int_list", False), "max": ("int", False)},
            ("acks", "in_flight", "session"), False, "poll_acks", "take retained acks"),
    Command("channel", {"optional": ("bool", False)},
            ("fds", "request_bytes", "reply_bytes", "token", "wake", "declined"), False,
            "channel", "open a shared-memory command channel (a local client): requests and "
            "replies through a sealed memfd both map, the daemon woken through a Unix datagram "
            "socket; an optional request it cannot grant is declined, not refused"),
    Command("stats", {"check": ("bool", False)},
            ("device", "daemon", "clients", "workers", "in_flight", "merged_ops", "spin_us",
             "channels", "gpu_sharing", "kernel_variants", "host", "pending_free", "metrics",
             "l3", "kv_store", "invariants"),
            False, "stats",
            "usage, metrics, invariant check"),
    Command("buffer_infos", {}, ("pools",), False, "buffer_infos",
            "host pool addresses for a transfer engine (PD direct-to-host)"),
    # HiSparse (controllers/sparse.py; docs/hisparse.md)
    Command("sparse_region", {}, ("fds", "token", "layers", "rows", "page_bytes",
                                  "layer_stride", "bytes", "tokens_per_page",
                                  "min_sparse_prompt_len", "c4_layers"), False, "sparse_region",
            "the sparse host region (a sealed memfd) an engine maps and registers"),
    Command("sparse_admit", {"request": ("str", True), "prompt_tokens": ("int", True),
                             "device_rows": ("frame", False), "host_rows": ("frame", False)},
            ("c4_tokens", "pages", "reused_pages", "op", "ack"), True, "sparse_admit",
            "admit a long request to sparse mode: host page rows, prompt C4 KV backed up"),
    Command("sparse_extend", {"request": ("str", True), "tokens": ("int", True),
                              "device_tokens": ("frame", False), "first": ("int", False)},
            ("c4_tokens", "pages", "op", "ack"), True, "sparse_extend",
            "grow a sparse request; back up new decode C4 tokens from device tokens"),
    Command("sparse_free", {"request": ("str", True)}, ("freed_rows",), False, "sparse_free",
            "free a sparse request's host rows"),
    Command("sparse_report", {"lookups": ("int", True), "swapped_in": ("int", True)}, (),
            False, "sparse_report", "add an engine's hot-buffer counts to the metrics"),
    Command("reset", {}, ("freed", "deferred"), False, "reset", "free all the client's rows"),
    Command("shutdown", {}, ("stopping",), False, "shutdown",
            "stop the daemon (a daemon started with `--allow-shutdown`; else `unsupported`)"),
    Command("l3_query", {"keys": ("str_list", True), **_L3_KIND, "each": ("bool", False),
                         "deadline_ms": ("int", False)},
            ("op",), True, "l3_query",
            "L3: how many leading objects of a key chain the store holds (in the ack)"),
    Command("l3_prefetch", {"keys": ("str_list", True), "rows": ("str_int_map", True),
                            "deadline_ms": ("int", False), **_L3_KIND}, ("op",), True,
            "l3_prefetch", "L3: read objects into the client's host rows, best effort before "
                           "a deadline"),
    Command("l3_put", {"keys": ("str_list", True), "rows": ("str_int_map", True), **_L3_KIND},
            ("op",), True, "l3_put",
            "L3: write host rows' objects in the background, skipping existing keys"),
    # key store: an engine's shared host pool <-> daemon host rows by page key
    # (controllers/kv_store.py; docs/sglang.md, seam 2)
    Command("kv_attach", {"name": ("str", True), "namespace": ("str", True),
                          "pool": ("opt_str", False), "space": ("opt_str", False),
                          "pid": ("int", False), "pages": ("int", True),
                          "page_bytes": ("int", False), "layers": ("list", False),
                          "handoff": ("bool", False)},
            ("nonce", "proofs", "fd_socket", "fd_token", "fds"), False, "kv_attach",
            "key store: map an engine host pool's shared-memory files (pid, fd; or handed in "
            "on the descriptor socket), pending proof"),
    Command("kv_verify", {}, ("attached",), False, "kv_verify",
            "key store: check the nonce the engine wrote into each mapped file (or map the "
            "files it handed in); pools usable"),
    Command("kv_put", {"name": ("str", True), "keys": ("str_list", True),
                       "pages": ("frame", True)}, ("stored",), False, "kv_put",
            "key store: copy engine host pages into daemon host rows under their keys"),
    Command("kv_get", {"name": ("str", True), "keys": ("str_list", True),
                       "pages": ("frame", True)}, ("found", "pending"), False, "kv_get",
            "key store: copy stored pages of these keys into engine host pages"),
    Command("kv_exists", {"name": ("str", True), "keys": ("str_list", True)},
            ("present", "pending"), False, "kv_exists",
            "key store: which keys hold a page of this pool"),
    Command("kv_clear", {"namespace": ("str", True), "deadline_ms": ("int", False)},
            ("dropped", "op"), True, "kv_clear",
            "key store: drop every page stored under a namespace (with L3: a new epoch there "
            "first, answered in the ack)"),
    Command("kv_detach", {}, ("detached",), False, "kv_detach",
            "key store: unmap every engine host pool of this client"),
)
COMMANDS: dict[str, Command] = {c.name: c for c in _TABLE}


def markdown_table() -> str:
    """docs/protocol.md's command table, from ``COMMANDS`` (a test keeps the doc in step)."""
    out = ["| command | fields (`?` optional) | reply | ack | what it does |",
           "|---|---|---|---|---|"]
    for c in _TABLE:
        fields = ", ".join(f"`{k}{'' if req else '?'}`: {kind}"
                           for k, (kind, req) in c.fields.items()) or "—"
        out.append(f"| `{c.name}` | {fields} | {', '.join(c.reply)} | "
                   f"{'yes' if c.acks else 'no'} | {c.summary} |")
    return "\n".join(out)
