"""Hostile messages about trust boundaries: reads of host rows nobody wrote (``not_written``)
and options that do not apply to the daemon's pools or mode (``unsupported``): one kind per
such option. ``TrustAttacks`` holds these ``k_*`` kinds; ``Hostile`` draws them with the rest.
"""
from __future__ import annotations

from hicache.fuzz.cases import Case, E, _ids
from hicache.fuzz.row_attacks import RowAttacks

NOT_WRITTEN, UNSUPPORTED = E({"not_written"}), E({"unsupported"})


class TrustAttacks(RowAttacks):
    """The trust-boundary kinds of hostile message (see ``Hostile.KINDS``)."""

    def k_unwritten_read(self) -> list[Case]:
        """Load (or swap in) the attacker's own rows: allocated, never backed up."""
        r = self.rng
        if "req_slot" in self.spaces and self.w.attacker.get("req_slot") and r.random() < 0.3:
            f = {"host_row": self.own("req_slot")[0], "slot": 0}
            return [self.msg("unwritten_read", "attacker", "swap_in", f, (), NOT_WRITTEN)]
        s = r.choice([x for x in self.spaces if self.w.attacker.get(x)])
        rows = self.own(s, r.choice((1, 2)))
        if r.random() < 0.5:
            return [self.transfer("unwritten_read", "load", s, self.dev(s, len(rows)), rows,
                                  NOT_WRITTEN)]
        pool = r.choice(self.w.layout.space_pools(s))
        item: dict = {"pool": pool.name, "src": 0, "dst": 1}
        host, dev = rows[:1], self.dev(s, 1)
        if pool.token_granular and r.random() < 0.5:  # one token of a never written page
            item["unit"] = "token"
            host, dev = [host[0] * pool.tokens_per_page + r.randrange(pool.tokens_per_page)], \
                [dev[0] * pool.tokens_per_page]
        return [self.msg("unwritten_read", "attacker", "load", {"items": [item]},
                         [_ids(host), _ids(dev)], NOT_WRITTEN)]

    def k_draft_without_ring(self) -> list[Case]:
        """clear_slot draft= where no request-slot pool holds ring state: refused, not a no-op."""
        pools = self.w.layout.space_pools("req_slot")
        if not pools or any(p.dtype == "fp32_state" and p.ring > 1 for p in pools):
            return self.k_cpu_wait_event()  # the rule applies here: nothing hostile to send
        n = self.rng.randint(1, 4)
        draft = {"seq_lens": [self.rng.randrange(100)], "accept_lens": [0], "num_draft": n}
        return [self.msg("draft_without_ring", "attacker", "clear_slot",
                         {"slots": [0], "draft": draft}, (), UNSUPPORTED)]

    def k_cpu_wait_event(self) -> list[Case]:
        """wait_event on a CPU-mode daemon (no interprocess events): refused, not ignored."""
        if self.rng.random() < 0.5 or "req_slot" not in self.spaces:
            f, fr = self.valid("backup")
            f["wait_event"] = self.rng.choice((0, 1, 7))
            return [self.msg("cpu_wait_event", "attacker", "backup", f, fr, UNSUPPORTED)]
        return [self.msg("cpu_wait_event", "attacker", "swap_out",
                         {"slot": 0, "wait_event": 0}, (), UNSUPPORTED)]
