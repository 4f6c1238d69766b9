"""Hostile HiSparse messages and the sparse victim they are aimed at.

* ``SparseVictim(client)`` — on a daemon with a sparse region (``--sparse-rows``), the victim
  client admits one sparse request backed up from its patterned ``c4_kv`` device rows and
  snapshots those sparse rows (read through the region's descriptor, no torch); ``verify()`` counts the
  (layer, row) pairs that changed, ``region_clean()`` frees the request and checks that the
  whole region can be admitted again (nobody else holds a row). Without a region it records
  ``world() is None`` and the sparse kinds expect ``unsupported``.
* ``SparseAttacks`` — the ``k_sparse_*`` kinds ``Hostile`` draws: an unknown request
  (``bad_field``), the victim's request extended, freed or admitted again by the attacker
  (``not_owner`` / ``bad_field``), and admissions naming the victim's host-tier rows as prefix
  hits (``not_owner``) or rows out of range (``bad_rows``). Each must be refused before
  anything changes.
"""
from __future__ import annotations

import os
import secrets
from typing import Any

from hicache.core.fd_handout import fetch_fd
from hicache.fuzz.cases import BAD_FIELD, BAD_ROWS, E, NOT_OWNER, Case, _ids
from hicache.fuzz.trust_attacks import TrustAttacks

UNSUPPORTED = E({"unsupported"})
REQUEST = "fuzz-victim-sparse"


class SparseVictim:
    """The victim's sparse request and its bytes (see the module docstring)."""

    def __init__(self, client: Any, victim_page_rows: list[int]) -> None:
        from hicache.engine.client import CommandRefused

        self.client, self.info, self.rows = client, None, []
        try:
            info = client.sparse_region()
        except CommandRefused as e:
            if e.code != "unsupported":
                raise
            return
        c4_per_page = int(info["tokens_per_page"])
        pages = 2 if int(info["rows"]) >= 3 else 1
        prompt = max(int(info["min_sparse_prompt_len"]), pages * c4_per_page * 4)
        pages = -(-(prompt // 4) // c4_per_page)
        self.info, self.prompt = info, prompt
        self.rows = client.sparse_admit(REQUEST, prompt, device_rows=list(range(pages)))
        self.host_rows = list(victim_page_rows)
        self.snap = self._read()

    def world(self) -> dict[str, Any] | None:
        if self.info is None:
            return None
        return {"request": REQUEST, "prompt": self.prompt, "pages": len(self.rows),
                "min_prompt": int(self.info["min_sparse_prompt_len"]),
                "rows": int(self.info["rows"]), "victim_host_rows": self.host_rows}

    def _read(self) -> list[bytes]:
        i = self.client.sparse_region()  # each reply offers the region's descriptor once
        pb, stride = int(i["page_bytes"]), int(i["layer_stride"])
        fd = fetch_fd(str(i["fds"]), int(i["token"]), "sparse region")
        try:
            return [os.pread(fd, pb, l * stride + r * pb)
                    for l in range(int(i["layers"])) for r in self.rows]
        finally:
            os.close(fd)

    def verify(self) -> int:
        """(layer, row) pairs of the victim's sparse rows that differ from the snapshot."""
        if self.info is None:
            return 0
        return sum(a != b for a, b in zip(self.snap, self._read()))

    def region_clean(self) -> bool:
        """Free the victim's request; then every row of the region must be free."""
        if self.info is None:
            return True
        from hicache.engine.client import CommandRefused

        n = int(self.info["rows"])
        prompt = max(self.prompt, n * int(self.info["tokens_per_page"]) * 4)
        try:
            if self.client.sparse_free(REQUEST) != len(self.rows):
                return False
            got = self.client.sparse_admit(REQUEST + "-all", prompt)
        except CommandRefused:
            return False
        self.client.sparse_free(REQUEST + "-all")
        return len(got) == n


class SparseAttacks(TrustAttacks):
    """The HiSparse kinds of hostile message (see ``Hostile.KINDS``)."""

    def _expect(self, codes: frozenset[str]) -> frozenset[str]:
        return codes if self.w.sparse else UNSUPPORTED

    def k_sparse_unknown_request(self) -> list[Case]:
        """Extend or free a request nobody admitted."""
        name = self.rng.choice(("nobody-" + secrets.token_hex(4), REQUEST + "x", REQUEST[:-1]))
        if self.rng.random() < 0.5:
            f = {"request": name, "tokens": self.rng.choice((0, 400, 1 << 40))}
            return [self.msg("sparse_unknown_request", "attacker", "sparse_extend", f, (),
                             self._expect(BAD_FIELD))]
        return [self.msg("sparse_unknown_request", "attacker", "sparse_free", {"request": name},
                         (), self._expect(BAD_FIELD))]

    def k_sparse_foreign_request(self) -> list[Case]:
        """The attacker extends or frees the victim's request (names are per client: to it, the
        victim's name is unknown)."""
        sp, r = self.w.sparse, self.rng.random()
        prompt = sp["prompt"] if sp else 1 << 12
        if r < 0.4:
            f: dict[str, Any] = {"request": REQUEST, "tokens": prompt + self.rng.choice((0, 4, 1000))}
            frames: list[bytes] = []
            if self.rng.random() < 0.5:  # with a backup that would overwrite the victim's tokens
                f.update(device_tokens=0, first=0)
                frames = [_ids([0, 1])]
            return [self.msg("sparse_foreign_request", "attacker", "sparse_extend", f, frames,
                             self._expect(BAD_FIELD))]
        return [self.msg("sparse_foreign_request", "attacker", "sparse_free",
                         {"request": REQUEST}, (), self._expect(BAD_FIELD))]

    def k_sparse_foreign_rows(self) -> list[Case]:
        """An admission naming another client's host-tier rows as prefix hits, or rows out of
        range (host_rows or device_rows)."""
        sp = self.w.sparse
        name = "att-" + secrets.token_hex(4)
        prompt = sp["prompt"] if sp else 1 << 12
        pages = sp["pages"] if sp else 1
        r = self.rng.random()
        if sp and r < 0.5:
            rows = self.rng.sample(sp["victim_host_rows"], min(pages, len(sp["victim_host_rows"])))
            f = {"request": name, "prompt_tokens": prompt, "host_rows": 0}
            return [self.msg("sparse_foreign_rows", "attacker", "sparse_admit", f, [_ids(rows)],
                             NOT_OWNER)]
        bad = [self.rng.choice((-1, 1 << 40, self.w.host_rows.get("page", 0)))]
        key = "host_rows" if r < 0.75 else "device_rows"
        ids = bad if key == "host_rows" else bad * pages
        f = {"request": name, "prompt_tokens": prompt, key: 0}
        return [self.msg("sparse_foreign_rows", "attacker", "sparse_admit", f, [_ids(ids)],
                         self._expect(BAD_ROWS))]
