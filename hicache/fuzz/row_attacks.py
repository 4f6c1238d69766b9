"""Hostile messages about rows: transfers (``backup`` / ``load``) with bad, foreign, freed or
mixed ids, frees of rows nobody holds, double free and use after free (set-up sequences), and
request state (``swap_in`` / ``swap_out`` / ``clear_slot`` with bad slots, host rows and
drafts). ``RowAttacks`` holds these ``k_*`` kinds; ``Hostile`` draws them with the rest.
"""
from __future__ import annotations

from typing import Any, Callable

from hicache.core import protocol as P
from hicache.fuzz.cases import (BAD_FIELD, BAD_ROWS, INT64_MAX, INT64_MIN, NOT_OWNER, NOT_REG,
                                Case, Deferred, MessageBuilder, _ids)


class RowAttacks(MessageBuilder):
    """The row-level kinds of hostile message (see ``Hostile.KINDS``)."""

    # ------------------------------------------------------------------ transfers
    def k_negative_ids(self) -> list[Case]:
        s, cmd = self.space(), self.cmd2()
        neg = [self.rng.choice((-1, -2, INT64_MIN, -(10**12)))]
        if self.rng.random() < 0.5:
            return [self.transfer("negative_ids", cmd, s, neg, self.own(s), BAD_ROWS)]
        return [self.transfer("negative_ids", cmd, s, self.dev(s), neg, BAD_ROWS)]

    def k_out_of_range_ids(self) -> list[Case]:
        s, cmd = self.space(), self.cmd2()
        if self.rng.random() < 0.5:
            bad = [self.rng.choice((self.w.dev_rows[s], self.w.dev_rows[s] + 7, INT64_MAX))]
            return [self.transfer("out_of_range_ids", cmd, s, bad, self.own(s), BAD_ROWS)]
        bad = [self.rng.choice((self.w.host_rows[s], self.w.host_rows[s] * 3, INT64_MAX))]
        return [self.transfer("out_of_range_ids", cmd, s, self.dev(s), bad, BAD_ROWS)]

    def k_duplicate_ids(self) -> list[Case]:
        s, cmd = self.space(), self.cmd2()
        if len(self.w.attacker[s]) < 1 or self.w.dev_rows[s] < 2:
            return self.k_negative_ids()
        if cmd == "backup":  # the same host row twice as a destination
            h = self.own(s)[0]
            return [self.transfer("duplicate_ids", cmd, s, self.dev(s, 2), [h, h], BAD_ROWS)]
        d = self.dev(s)[0]
        hs = self.own(s, 2)
        if len(hs) < 2:
            hs = hs * 2
        return [self.transfer("duplicate_ids", cmd, s, [d, d], hs, BAD_ROWS)]

    def k_length_mismatch(self) -> list[Case]:
        s, cmd = self.space(), self.cmd2()
        if self.rng.random() < 0.3:
            return [self.transfer("length_mismatch", cmd, s, [], [], BAD_ROWS)]
        d = self.dev(s, 2)
        h = self.own(s, 1)
        if self.rng.random() < 0.5:
            d, h = d[:1], self.own(s, 2)
            if len(h) < 2:
                h = h + [h[0]]
        if len(d) == len(h):
            d = d + d[:1]
        return [self.transfer("length_mismatch", cmd, s, d, h, BAD_ROWS)]

    def k_unknown_pool(self) -> list[Case]:
        s, cmd = self.space(), self.cmd2()
        r = self.rng
        name = r.choice(("nope", "", "SWA_KV", "c4_kv\x00", "page", "../../etc/passwd", "x" * 300))
        item = {"pool": name, "src": 0, "dst": 1} if r.random() < 0.6 else \
            {"space": name if name != "page" else "nope", "src": 0, "dst": 1}
        return [self.transfer("unknown_pool", cmd, s, self.dev(s), self.own(s), BAD_FIELD,
                              item=item)]

    def k_bad_item(self) -> list[Case]:
        s, cmd = self.space(), self.cmd2()
        r = self.rng
        choice = r.randrange(6)
        if choice == 0:
            items: Any = []
        elif choice == 1:
            items = [{"space": s, "src": 0, "dst": 1}] * (P.MAX_ITEMS + 1)
        elif choice == 2:
            items = [r.choice((1, "x", None, [0, 1]))]
        elif choice == 3:
            items = [{"space": s, "pool": self.pools[0], "src": 0, "dst": 1}]
        elif choice == 4:
            items = [{"src": 0, "dst": 1}]
        else:
            items = [{"space": s, "src": 0, "dst": 1, r.choice(("unit", "bogus")): "byte"}]
        d, h = self.dev(s), self.own(s)
        src, dst = (d, h) if cmd == "backup" else (h, d)
        return [self.msg("bad_item", "attacker", cmd, {"items": items}, [_ids(src), _ids(dst)],
                         BAD_FIELD)]

    def k_token_misuse(self) -> list[Case]:
        cmd = self.cmd2()
        r = self.rng
        if self.row_pools and r.random() < 0.5:  # token unit on a pool with no token format
            pool = r.choice(self.row_pools)
            s = self.w.layout.pool(pool).index
            item = {"pool": pool, "src": 0, "dst": 1, "unit": "token"}
            return [self.transfer("token_misuse", cmd, s, self.dev(s), self.own(s), BAD_FIELD,
                                  item=item)]
        pool = r.choice(self.token_pools)
        spec = self.w.layout.pool(pool)
        s, tp = spec.index, spec.tokens_per_page
        item = {"pool": pool, "src": 0, "dst": 1, "unit": "token"}
        if r.random() < 0.5:  # a token id past the device rows
            dev = [self.w.dev_rows[s] * tp + r.choice((0, 1, 10**6))]
            return [self.transfer("token_misuse", cmd, s, dev, [self.own(s)[0] * tp], BAD_ROWS,
                                  item=item)]
        free = self.w.free_rows(s)
        if not free:
            return self.k_negative_ids()
        host = [r.choice(free) * tp + r.randrange(tp)]  # a token in a row nobody holds
        return [self.transfer("token_misuse", cmd, s, [0], host, NOT_OWNER, item=item)]

    def k_foreign_rows(self) -> list[Case]:
        """The victim's host rows: back up into them, load from them, free them, swap them."""
        r = self.rng
        s = r.choice([x for x in self.spaces if self.w.victim.get(x)])
        v = r.sample(self.w.victim[s], min(len(self.w.victim[s]), r.choice((1, 2, 3))))
        what = r.randrange(4)
        peer = r.choice(("attacker", "attacker", "anon"))
        if what < 2:
            cmd = "backup" if what == 0 else "load"
            exp = NOT_OWNER if peer == "attacker" else NOT_REG
            return [self.transfer("foreign_rows", cmd, s, self.dev(s, len(v)), v, exp, peer=peer)]
        if what == 2:
            return [self.msg("foreign_rows", peer, "free", {"rows": {s: 0}}, [_ids(v)], NOT_OWNER)]
        if "req_slot" in self.spaces and self.w.victim.get("req_slot"):
            row = r.choice(self.w.victim["req_slot"])
            cmd = r.choice(("swap_in", "swap_out"))
            f = {"host_row": row, "slot": 0}
            return [self.msg("foreign_rows", "attacker", cmd, f, (), NOT_OWNER)]
        return [self.msg("foreign_rows", peer, "free", {"rows": {s: 0}}, [_ids(v)], NOT_OWNER)]

    def k_free_rows_of_nobody(self) -> list[Case]:
        s = self.space()
        free = self.w.free_rows(s)
        if not free:
            return self.k_foreign_rows()
        rows = self.rng.sample(free, min(len(free), self.w.dev_rows[s],
                                         self.rng.choice((1, 2, 5))))
        if self.rng.random() < 0.5:
            return [self.msg("free_rows_of_nobody", "attacker", "free", {"rows": {s: 0}},
                             [_ids(rows)], NOT_OWNER)]
        return [self.transfer("free_rows_of_nobody", self.cmd2(), s, self.dev(s, len(rows)),
                              rows, NOT_OWNER)]

    def k_double_free(self) -> list[Case]:
        s = "page" if "page" in self.spaces else self.space()
        return self._spare_sequence("double_free", s, lambda rows: self.msg(
            "double_free", "attacker", "free", {"rows": {s: 0}}, [_ids(rows)], NOT_OWNER))

    def k_use_after_free(self) -> list[Case]:
        s = self.space()
        cmd = self.cmd2()
        return self._spare_sequence("use_after_free", s, lambda rows: self.transfer(
            "use_after_free", cmd, s, self.dev(s), rows, NOT_OWNER))

    def _spare_sequence(self, name: str, s: str, build: Callable[[list[int]], Case]) -> list[Case]:
        """alloc one row (set-up), free it (set-up), then ``build(rows)`` (hostile)."""
        state: dict[str, list[int]] = {}

        def took(h: dict[str, Any]) -> None:
            state["rows"] = list(h["_arrays"][h["rows"][s]])
            self.w.spare[s] = list(state["rows"])

        def gone(h: dict[str, Any]) -> None:
            self.w.spare[s] = []

        alloc = self.msg(name, "attacker", "alloc", {"counts": {s: 1}}, (), setup=True, on_ok=took)
        free = Deferred(name, "attacker", [], setup=True, on_ok=gone)
        free.build = lambda: self.msg(name, "attacker", "free", {"rows": {s: 0}},
                                      [_ids(state["rows"])], setup=True, on_ok=gone)
        hostile = Deferred(name, "attacker", [])
        hostile.build = lambda: build(state["rows"])
        return [alloc, free, hostile]

    def k_mixed_ownership(self) -> list[Case]:
        """Own rows plus one foreign (or free) row: all or nothing, so nothing may change."""
        r = self.rng
        s = r.choice([x for x in self.spaces if self.w.victim.get(x) and len(self.w.attacker[x]) >= 1])
        mine = self.own(s, 2)
        other = [r.choice(self.w.victim[s])]
        rows = mine + other
        r.shuffle(rows)
        if r.random() < 0.5:
            return [self.msg("mixed_ownership", "attacker", "free", {"rows": {s: 0}},
                             [_ids(rows)], NOT_OWNER)]
        return [self.transfer("mixed_ownership", self.cmd2(), s, self.dev(s, len(rows)), rows,
                              NOT_OWNER)]

    # ------------------------------------------------------------------ request state
    def k_bad_slot(self) -> list[Case]:
        if "req_slot" not in self.spaces:
            return self.k_negative_ids()
        r = self.rng
        n = self.w.dev_rows["req_slot"]
        bad = r.choice((-1, n, n + 5, INT64_MAX, INT64_MIN))
        which = r.randrange(4)
        if which == 0:
            return [self.msg("bad_slot", "attacker", "swap_out", {"slot": bad}, (), BAD_ROWS)]
        if which == 1:
            return [self.msg("bad_slot", "attacker", "swap_in",
                             {"slot": bad, "host_row": self.own("req_slot")[0]}, (), BAD_ROWS)]
        if which == 2:
            return [self.msg("bad_slot", "attacker", "clear_slot", {"slots": [0, bad]}, (),
                             BAD_ROWS)]
        slots = r.choice(([0, 0], [1, 2, 1], []))
        return [self.msg("bad_slot", "attacker", "clear_slot", {"slots": slots}, (),
                         BAD_FIELD if not slots else BAD_ROWS)]

    def k_bad_host_row(self) -> list[Case]:
        if "req_slot" not in self.spaces:
            return self.k_out_of_range_ids()
        r = self.rng
        n = self.w.host_rows["req_slot"]
        cmd = r.choice(("swap_in", "swap_out"))
        if r.random() < 0.5:
            row, exp = r.choice((-1, n, INT64_MAX, INT64_MIN)), BAD_ROWS
        else:
            free = self.w.free_rows("req_slot")
            if not free:
                return self.k_out_of_range_ids()
            row, exp = r.choice(free), NOT_OWNER
        f: dict[str, Any] = {"host_row": row, "slot": 0}
        if cmd == "swap_in" and r.random() < 0.3 and exp == BAD_ROWS:
            f["release"] = True
        return [self.msg("bad_host_row", "attacker", cmd, f, (), exp)]

    def k_bad_draft(self) -> list[Case]:
        if "req_slot" not in self.spaces:
            return self.k_bad_item()
        r = self.rng
        drafts = [{"seq_lens": [1], "accept_lens": [0], "num_draft": 0},
                  {"seq_lens": [1], "accept_lens": [0], "num_draft": 65},
                  {"seq_lens": [1], "accept_lens": [0], "num_draft": "3"},
                  {"seq_lens": [1, 2], "accept_lens": [0], "num_draft": 3},
                  {"seq_lens": [-1], "accept_lens": [0], "num_draft": 3},
                  {"seq_lens": [1], "accept_lens": [4], "num_draft": 3},
                  {"seq_lens": [1], "accept_lens": [0], "num_draft": 3, "evil": 1},
                  {"seq_lens": "1", "accept_lens": [0], "num_draft": 3},
                  {"accept_lens": [0], "num_draft": 3}]
        return [self.msg("bad_draft", "attacker", "clear_slot",
                         {"slots": [0], "draft": r.choice(drafts)}, (), BAD_FIELD)]

    def k_bad_poll(self) -> list[Case]:
        f = self.rng.choice(({"max": 0}, {"max": -1}, {"max": 4097}, {"max": 10**20},
                             {"ops": ["1"]}, {"ops": [1.0]}))
        return [self.msg("bad_poll", "attacker", "poll_acks", f, (), BAD_FIELD)]
