"""The generator of malformed and hostile messages: ``Hostile`` and its ``KINDS`` (name,
weight). ``next()`` draws a kind and returns one ``Case`` — or a short sequence of set-up steps
and then the hostile one — each with the error codes it must get. The frame / header level,
alloc / free counts and registration kinds live here; the row-level kinds (transfers, request
state) come from ``RowAttacks``, reads of unwritten rows and options that do not apply from
``TrustAttacks``, HiSparse requests and rows from ``SparseAttacks``.
"""
from __future__ import annotations

import json
import random
import secrets
from typing import Any, Sequence

from hicache.core import protocol as P
from hicache.fuzz.cases import BAD_FIELD, BAD_FRAME, NOT_REG, Case, E, World, _ids, _json
from hicache.fuzz.sparse_attacks import SparseAttacks


class Hostile(SparseAttacks):
    """Malformed and hostile messages (see ``KINDS``). ``next()`` returns a list of cases: one
    hostile message, or a few set-up steps and then the hostile one (double free, use after
    free). Peers: ``attacker`` (registered, holds rows), ``anon`` (never registers), ``ghost``
    (registered once, then unregistered)."""

    def __init__(self, world: World, rng: random.Random,
                 kinds: Sequence[str] | None = None) -> None:
        """``kinds``: draw only these (equal weights); default every kind of ``KINDS``."""
        super().__init__(world, rng)
        table = self.KINDS if kinds is None else [(n, 1.0) for n in kinds]
        self._fns = [getattr(self, "k_" + n) for n, _ in table]
        self._weights = [w for _, w in table]

    # name, weight
    KINDS = (
        ("random_bytes", 6), ("not_object", 2), ("bad_utf8", 1), ("deep_json", 1),
        ("bad_version", 2), ("bad_id", 2), ("unknown_command", 2), ("unknown_field", 2),
        ("missing_field", 2), ("wrong_type", 8), ("ragged_frame", 2), ("missing_frame", 3),
        ("extra_frames", 3), ("too_many_frames", 1), ("long_list", 1), ("oversize_header", 0.05),
        ("huge_count", 3), ("negative_count", 2), ("unknown_space", 2), ("bad_request_id", 2),
        ("negative_ids", 4), ("out_of_range_ids", 5), ("duplicate_ids", 4), ("length_mismatch", 4),
        ("unknown_pool", 3), ("bad_item", 4), ("token_misuse", 3), ("foreign_rows", 6),
        ("free_rows_of_nobody", 3), ("double_free", 2), ("use_after_free", 2),
        ("mixed_ownership", 3), ("bad_slot", 3), ("bad_host_row", 3), ("bad_draft", 2),
        ("bad_poll", 2), ("register_again", 1), ("bad_register", 5), ("before_register", 5),
        ("after_unregister", 4), ("unwritten_read", 4), ("draft_without_ring", 1),
        ("cpu_wait_event", 1), ("sparse_unknown_request", 2), ("sparse_foreign_request", 3),
        ("sparse_foreign_rows", 3), ("bad_hand_in", 2), ("shutdown_refused", 1),
    )

    # ------------------------------------------------------------------ frame and header level
    def k_random_bytes(self) -> list[Case]:
        r = self.rng
        n = r.choice((0, 1, 3, 8, 17, 64, 300))
        frames = [r.randbytes(n)] + [r.randbytes(r.choice((0, 5, 8, 16))) for _ in
                                     range(r.choice((0, 0, 1, 3)))]
        return [Case("random_bytes", r.choice(("attacker", "anon")), frames,
                     E({"bad_header", "bad_frame", "bad_version"}))]

    def k_not_object(self) -> list[Case]:
        body = self.rng.choice([b"[1,2,3]", b'"heartbeat"', b"42", b"null", b"true", b"[]",
                                b'[{"v":1,"cmd":"stats","id":1}]', b"1e999"])
        return [Case("not_object", "attacker", [body], E({"bad_header"}))]

    def k_bad_utf8(self) -> list[Case]:
        body = self.rng.choice([b'{"v":1,"cmd":"st\xffats","id":1}', b"\xfe\xff{}", b"\xc3("])
        return [Case("bad_utf8", "anon", [body], E({"bad_header"}))]

    def k_deep_json(self) -> list[Case]:
        r = self.rng
        if r.random() < 0.5:
            depth = r.choice((5_000, 100_000))
            body = b"[" * depth + b"]" * depth
            return [Case("deep_json", "anon", [body], E({"bad_header"}))]
        nest: Any = 1
        for _ in range(r.choice((12, 40, 200))):
            nest = {"a": nest}
        cmd = r.choice(("register", "clear_slot"))
        f, fr = self.valid(cmd)
        if cmd == "register":
            f["layout"] = dict(f["layout"], extra=nest)
        else:
            f["draft"] = {"seq_lens": nest}
        return [self.msg("deep_json", "anon" if cmd == "register" else "attacker", cmd, f, fr,
                         E({"bad_header"}))]

    def k_bad_version(self) -> list[Case]:
        v = self.rng.choice(["missing", 0, 2, 99, "1", None, [1], {"v": 1}, -1])
        h: dict[str, Any] = {"cmd": "stats", "id": self.rid()}
        if v != "missing":
            h["v"] = v
        return [Case("bad_version", self.rng.choice(("attacker", "anon")), [_json(h)],
                     E({"bad_version"}), rid=h["id"])]

    def k_bad_id(self) -> list[Case]:
        v = self.rng.choice(["missing", "7", 1.5, None, True, [1], {"x": 1}])
        h: dict[str, Any] = {"v": 1, "cmd": "heartbeat"}
        if v != "missing":
            h["id"] = v
        return [Case("bad_id", "attacker", [_json(h)], E({"bad_header"}))]

    def k_unknown_command(self) -> list[Case]:
        c = self.rng.choice(["nope", "", "HEARTBEAT", "__class__", "eval", "x" * 5000, 7, None,
                             ["stats"], {"cmd": "stats"}, True])
        return [self.msg("unknown_command", "attacker", "stats", {"cmd": c}, (),
                         E({"unknown_command"}))]

    def k_unknown_field(self) -> list[Case]:
        cmd = self.rng.choice(list(P.COMMANDS))
        if cmd == "shutdown":
            cmd = "stats"
        f, fr = self.valid(cmd)
        f[self.rng.choice(["bogus", "__proto__", "ID", "k", "ok", "error"])] = 1
        return [self.msg("unknown_field", "attacker", cmd, f, fr, BAD_FIELD)]

    def k_missing_field(self) -> list[Case]:
        options = [(c, k) for c, cm in P.COMMANDS.items() for k, (_, req) in cm.fields.items() if req]
        cmd, k = self.rng.choice(options)
        f, fr = self.valid(cmd)
        f.pop(k, None)
        return [self.msg("missing_field", "attacker", cmd, f, fr if cmd != "free" else [],
                         E({"bad_field"}))]

    _WRONG = {
        "int": ["3", 1.5, True, None, [], {}], "frame": ["0", 0.0, False, None],
        "bool": [1, "true", None, [], 0.0], "str": [1, None, [], {}, True],
        "dict": [[], 1, "x", None], "list": [{}, 1, "x", None],
        "opt_str": [1, [], {}, True], "opt_int": ["1", 1.5, True, [], {}],
        "str_int_map": [[], 1, {"page": -1}, {"page": "1"}, {"page": 1.5}, {"page": True},
                        {"page": None}],
        "int_list": [{}, "0", [1.5], ["0"], [True], [None]],
        "opt_int_list": [{}, "0", [1.5], [True]],
        "str_list": [{}, "x", [1], [None]],
    }

    def k_wrong_type(self) -> list[Case]:
        options = [(c, k, kind) for c, cm in P.COMMANDS.items() for k, (kind, _) in cm.fields.items()]
        cmd, k, kind = self.rng.choice(options)
        f, fr = self.valid(cmd)
        f[k] = self.rng.choice(self._WRONG[kind])
        peer = "anon" if cmd == "register" else "attacker"
        return [self.msg("wrong_type", peer, cmd, f, fr, BAD_FIELD)]

    def k_ragged_frame(self) -> list[Case]:
        cmd = self.rng.choice(("backup", "load", "free", "stats"))
        f, fr = self.valid(cmd)
        fr = list(fr) or [b""]
        i = self.rng.randrange(len(fr))
        fr[i] = fr[i] + self.rng.randbytes(self.rng.choice((1, 3, 7)))
        return [self.msg("ragged_frame", "attacker", cmd, f, fr, BAD_FRAME)]

    def k_missing_frame(self) -> list[Case]:
        r = self.rng
        cmd = r.choice(("backup", "load", "free"))
        f, fr = self.valid(cmd)
        if cmd == "free":
            s = next(iter(f["rows"]))
            f["rows"][s] = r.choice((1, 2, 63, 10**9))
            return [self.msg("missing_frame", "attacker", cmd, f, fr, BAD_FRAME)]
        k = r.choice(("src", "dst"))
        f["items"][0][k] = r.choice((2, 3, 64, -1, 10**12))
        if r.random() < 0.4:
            fr = fr[:1]  # truncated: one of the two frames never came
            f["items"][0][k] = 1
        return [self.msg("missing_frame", "attacker", cmd, f, fr, BAD_FRAME)]

    def k_extra_frames(self) -> list[Case]:
        r = self.rng
        cmd = r.choice(("heartbeat", "stats", "poll_acks", "alloc", "backup", "load", "free",
                        "buffer_infos", "clear_slot"))
        f, fr = self.valid(cmd)
        fr = list(fr) + [_ids([r.randrange(4)] * r.choice((1, 2))) for _ in range(r.choice((1, 2, 5)))]
        return [self.msg("extra_frames", "attacker", cmd, f, fr, BAD_FRAME)]

    def k_too_many_frames(self) -> list[Case]:
        n = P.MAX_INDEX_FRAMES + self.rng.choice((1, 2, 50))
        return [self.msg("too_many_frames", "attacker", "stats", {}, [_ids([0])] * n, BAD_FRAME)]

    def k_long_list(self) -> list[Case]:
        n = P.MAX_LIST_LEN + self.rng.choice((1, 100))
        if self.rng.random() < 0.5:
            return [self.msg("long_list", "attacker", "poll_acks", {"ops": list(range(n))}, (),
                             BAD_FIELD)]
        return [self.msg("long_list", "attacker", "clear_slot", {"slots": [0] * n}, (),
                         BAD_FIELD)]

    def k_oversize_header(self) -> list[Case]:
        pad = "x" * (P.MAX_HEADER_BYTES + 16)
        return [self.msg("oversize_header", "attacker", "stats", {"pad": pad}, (), BAD_FRAME)]

    # ------------------------------------------------------------------ host rows: alloc / free
    def k_huge_count(self) -> list[Case]:
        s = self.space()
        n = self.rng.choice((self.w.host_rows[s] + 1, 10**6, 2**31, 2**63, 2**64 + 5, 10**100))
        return [self.msg("huge_count", self.rng.choice(("attacker", "anon")), "alloc",
                         {"counts": {s: n}}, (), E({"no_space"}))]

    def k_negative_count(self) -> list[Case]:
        s = self.space()
        return [self.msg("negative_count", "attacker", "alloc",
                         {"counts": {s: self.rng.choice((-1, -(2**63), -10**30))}}, (),
                         BAD_FIELD)]

    def k_unknown_space(self) -> list[Case]:
        name = self.rng.choice(("nope", "", "PAGE", "page ", "swa_kv", "../page", "\u00e9"))
        if self.rng.random() < 0.5:
            return [self.msg("unknown_space", "attacker", "alloc", {"counts": {name: 1}}, (),
                             BAD_FIELD)]
        return [self.msg("unknown_space", "attacker", "free", {"rows": {name: 0}},
                         [_ids([0])], BAD_FIELD)]

    def k_bad_request_id(self) -> list[Case]:
        req = self.rng.choice(("", "r" * (P.MAX_NAME_LEN + 1)))
        cmd = self.rng.choice(("alloc", "free", "swap_out"))
        f, fr = self.valid(cmd)
        f["request"] = req
        return [self.msg("bad_request_id", "attacker", cmd, f, fr, BAD_FIELD)]

    # ------------------------------------------------------------------ registration
    def k_register_again(self) -> list[Case]:
        f, _ = self.valid("register")
        return [self.msg("register_again", "attacker", "register", f, (),
                         E({"already_registered"}))]

    def k_bad_register(self) -> list[Case]:
        """A stranger's registration with one thing wrong; it must stay unregistered."""
        r = self.rng
        f = json.loads(json.dumps(self.w.attacker_fields))
        if self.w.anon_token is not None:  # its own pools handed in: each fault meets its check
            f["fd_token"] = self.w.anon_token
        pools = sorted(f["buffers"])
        which = r.randrange(17)
        exp: frozenset[str]
        if which == 0:
            f["layout"]["model"]["num_layers"] += 1
            exp = E({"layout_mismatch"})
        elif which == 1:
            f["layout"]["stage"]["pp_rank"] = r.choice(("abc", [0], None, -1, 10**9))
            exp = E({"layout_mismatch"})
        elif which == 2:
            f["layout"] = r.choice(({}, {"model": []}, {"model": {}, "stage": {}},
                                    {"model": f["layout"]["model"], "stage": "x"}))
            exp = E({"layout_mismatch"})
        elif which == 3:
            f["mode"] = r.choice(("gpu", "", "CPU", "x" * 40))
            exp = BAD_FIELD
        elif which == 4:
            f["mode"] = "cuda"
            exp = E({"unsupported", "bad_handle"})
        elif which == 5:
            s = r.choice(sorted(f["device_rows"]))
            if r.random() < 0.5:
                del f["device_rows"][s]
            else:
                f["device_rows"][s] = 0
            exp = E({"bad_field"})
        elif which == 6:
            f["device_rows"]["bogus"] = 4
            exp = E({"bad_field"})
        elif which == 7:
            p = r.choice(pools)
            f["buffers"][p][0]["fd"] = r.choice((1, -1, "0", None, 2**63, 0.0, True))
            exp = E({"bad_handle"})
        elif which == 8:
            p = r.choice(pools)
            f["buffers"][p][-1]["offset"] = r.choice((10**12, -4096, "0", 2**63))
            exp = E({"bad_handle"})
        elif which == 9:
            p = r.choice(pools)
            f["buffers"][p][0]["rows"] += r.choice((1, -1, 10**9))
            exp = E({"bad_handle"})
        elif which == 10:
            p = r.choice(pools)
            f["buffers"][p][0]["row_bytes"] = r.choice((8, 0, 10**9))
            exp = E({"bad_handle"})
        elif which == 11:
            p = r.choice(pools)
            if r.random() < 0.5:
                del f["buffers"][p]
            else:
                f["buffers"][p] = f["buffers"][p][:-1]
            exp = E({"layout_mismatch"})
        elif which == 12:
            p = r.choice(pools)
            f["buffers"][p][0] = r.choice((None, 1, "x", []))
            exp = E({"bad_handle"})
        elif which == 13:
            p = r.choice(pools)
            f["buffers"][p][0]["kind"] = r.choice(("cuda_ipc", "file", None))
            exp = E({"bad_handle"})
        elif which == 14:
            f["events"] = ["AAAA"]
            exp = BAD_FIELD
        elif which == 15:  # a token it never got (another client's intake is not its own)
            f["fd_token"] = r.choice((1, 2**63 + 1, secrets.randbits(64)))
            exp = E({"bad_handle"})
        else:
            f["tp_rank"] = -1
            exp = BAD_FIELD
        return [self.msg("bad_register", "anon", "register", f, (), exp)]

    def k_bad_hand_in(self) -> list[Case]:
        """A count out of range (a stranger), or a registered client asking to hand more in:
        refused, and no intake is opened."""
        if self.rng.random() < 0.5:
            return [self.msg("bad_hand_in", "attacker", "hand_in", {"count": 1}, (),
                             E({"already_registered"}))]
        n = self.rng.choice((0, -1, 65, 10**9))
        return [self.msg("bad_hand_in", "anon", "hand_in", {"count": n}, (), BAD_FIELD)]

    def k_shutdown_refused(self) -> list[Case]:
        """``shutdown`` from any peer of a daemon started without ``--allow-shutdown``: refused,
        and the daemon keeps serving (the runner checks it answers the next case)."""
        peer = self.rng.choice(("attacker", "anon", "ghost"))
        return [self.msg("shutdown_refused", peer, "shutdown", {}, (), E({"unsupported"}))]

    def k_before_register(self) -> list[Case]:
        return [self._unregistered("before_register", "anon")]

    def k_after_unregister(self) -> list[Case]:
        return [self._unregistered("after_unregister", "ghost")]

    def _unregistered(self, name: str, peer: str) -> Case:
        cmd = self.rng.choice(("backup", "load", "swap_out", "swap_in", "clear_slot",
                               "unregister"))
        f, fr = self.valid(cmd)
        return self.msg(name, peer, cmd, f, fr, NOT_REG)

    # ------------------------------------------------------------------ drawing
    def next(self) -> list[Case]:
        fn = self.rng.choices(self._fns, self._weights)[0]
        return fn()
