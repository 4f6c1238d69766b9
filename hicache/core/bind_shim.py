"""Mooncake's listeners on loopback: the bind() shim, and where a process's Mooncake listens.

Mooncake 0.3.13 binds some listeners to every interface whatever its flags say (the master's
embedded HTTP metadata server ignores ``--http_metadata_server_host``; a store client's
handshake and TCP data listeners are hard-coded to the wildcard address). The shim, preloaded,
turns such a wildcard bind into a chosen IPv4 address.

Contract:

* ``mooncake_dir()``: the installed ``mooncake`` package directory (it ships ``mooncake_master``
  and ``mooncake_client``), or ``None`` when the wheel is not installed.
* ``bind_shim()``: the compiled shim's path (built once with ``cc`` into
  ``$XDG_CACHE_HOME/hicache``; ``RuntimeError`` saying why it cannot be). It rewrites wildcard
  binds to ``HICACHE_BIND_ADDR = ADDR[@PATH]`` (default 127.0.0.1); with ``@PATH`` only binds
  called from code loaded from a file whose path contains PATH (Mooncake's libraries).
* ``loopback_env()``: environment for a Mooncake process (master, storage member, or a daemon
  with ``--l3``) that must listen on 127.0.0.1 only: the shim preloaded, and
  ``MC_TCP_BIND_ADDRESS`` so the advertised address is loopback too.
* For ``hicache serve --l3 mooncake``: ``daemon_exec_env(local_host, environ)``, the variables
  under which it executes itself once more so that a loopback ``--l3-local-host`` puts
  Mooncake's listeners on that address (only binds made by Mooncake's libraries rewritten; None
  when there is nothing to do or it cannot be done, ``shim_problem`` then saying why);
  ``listen_note(local_host)``, the summary's phrase saying where they listen;
  ``own_listeners()``, this process's listening TCP addresses; ``is_loopback(host)``,
  ``shim_loaded()``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import ipaddress
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Mapping


_SHIM_C = r"""
/* hicache: rewrite wildcard bind() addresses to HICACHE_BIND_ADDR = ADDR[@PATH] (default
   127.0.0.1); with @PATH, only binds called from code loaded from a file whose path contains
   PATH (Mooncake's libraries: the daemon's own listeners keep the addresses they were given). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
static int caller_in(const void *caller, const char *path) {
    Dl_info info;
    if (!path || !*path) return 1;
    if (!dladdr(caller, &info) || !info.dli_fname) return 0;
    return strstr(info.dli_fname, path) != NULL;
}
int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real;
    if (!real) real = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *env = getenv("HICACHE_BIND_ADDR");
    char want[64] = "127.0.0.1";
    const char *only = NULL;
    struct in_addr v4;
    if (env && *env) {
        size_t n = strcspn(env, "@");
        if (n >= sizeof want) return real(fd, addr, len);
        memcpy(want, env, n);
        want[n] = 0;
        if (env[n] == '@') only = env + n + 1;
    }
    if (!addr || inet_pton(AF_INET, want, &v4) != 1) return real(fd, addr, len);
    if (!caller_in(__builtin_return_address(0), only)) return real(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr != htonl(INADDR_ANY)) return real(fd, addr, len);
        a.sin_addr = v4;
        return real(fd, (const struct sockaddr *)&a, sizeof a);
    }
    if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (memcmp(&a.sin6_addr, &in6addr_any, sizeof a.sin6_addr)) return real(fd, addr, len);
        memset(&a.sin6_addr, 0, sizeof a.sin6_addr);  /* IPv4-mapped: v4 peers still connect */
        a.sin6_addr.s6_addr[10] = 0xff;
        a.sin6_addr.s6_addr[11] = 0xff;
        memcpy(&a.sin6_addr.s6_addr[12], &v4, 4);
        return real(fd, (const struct sockaddr *)&a, sizeof a);
    }
    return real(fd, addr, len);
}
"""


def mooncake_dir() -> Path | None:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        if (Path(d) / "mooncake_master").exists():
            return Path(d)
    return None


def bind_shim() -> str:
    """Path of the compiled bind shim (built on first use)."""
    digest = hashlib.sha256(_SHIM_C.encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hicache"
    so = cache / f"bind_loopback-{digest}.so"
    if so.exists():
        return str(so)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("a C compiler (cc) is needed to build the loopback bind shim for "
                           "Mooncake's listeners")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as d:
        src = Path(d) / "shim.c"
        src.write_text(_SHIM_C)
        out = Path(d) / "shim.so"
        r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src), "-ldl"],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"building the bind shim failed: {r.stderr.strip()[:300]}")
        os.replace(out, so)
    return str(so)


def loopback_env() -> dict[str, str]:
    return {"LD_PRELOAD": bind_shim(), "HICACHE_BIND_ADDR": "127.0.0.1",
            "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "WARNING",
            "GLOG_minloglevel": "1"}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an ``--l3-local-host``) is ``localhost`` or an IPv4 loopback address:
    the addresses the bind shim can bind Mooncake's listeners to (it rewrites to IPv4)."""
    if host == "localhost":
        return True
    try:
        a = ipaddress.ip_address(host)
    except ValueError:
        return False
    return a.version == 4 and a.is_loopback


def shim_loaded() -> str | None:
    """Path of the bind shim mapped into this process (preloaded at exec), or None."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    m = re.search(r"(/\S*/bind_loopback-[0-9a-f]+\.so)$", maps, re.M)
    return m.group(1) if m else None


EXECUTED = "HICACHE_SHIM_EXECUTED"  # set in the execution daemon_exec_env asks for
shim_problem: str | None = None  # why ``daemon_exec_env`` could not apply the shim (summary)


def daemon_exec_env(local_host: str, environ: Mapping[str, str]) -> dict[str, str] | None:
    """The variables under which ``hicache serve --l3 mooncake`` executes itself again so that
    Mooncake's wildcard listeners bind ``local_host`` (a loopback address: a peer on another
    host could not reach a client that advertises it anyway): the shim preloaded, and
    ``HICACHE_BIND_ADDR=ADDR@<the mooncake package's folder>``, so only binds called from
    Mooncake's libraries (``mooncake/``, ``mooncake_*.libs/``) are rewritten and the daemon's
    own listeners (metrics, a tcp socket) keep the addresses they were given. None when there is
    nothing to do: not loopback, no Mooncake wheel (the daemon refuses ``--l3`` then), the shim
    already loaded (e.g. under ``loopback_env()``), or it was preloaded and did not load, or it
    cannot be built (then ``shim_problem`` says why)."""
    global shim_problem
    d = mooncake_dir()
    if not is_loopback(local_host) or d is None or shim_loaded():
        return None
    if environ.get(EXECUTED):  # this process is that execution: never a second one
        shim_problem = "the shim was preloaded at the daemon's start but did not load"
        return None
    try:
        so = bind_shim()
    except (RuntimeError, OSError) as e:  # no compiler, or no writable cache folder
        shim_problem = f"the bind shim cannot be built: {e}"
        return None
    if any(c in so for c in " :\t\n"):  # LD_PRELOAD splits at these: it would not load
        shim_problem = f"the bind shim's path {so!r} holds a separator LD_PRELOAD splits at"
        return None
    pre = environ.get("LD_PRELOAD", "")
    addr = "127.0.0.1" if local_host == "localhost" else local_host
    return {"LD_PRELOAD": f"{so} {pre}".strip(), "HICACHE_BIND_ADDR": f"{addr}@{d}",
            "MC_TCP_BIND_ADDRESS": environ.get("MC_TCP_BIND_ADDRESS") or addr, EXECUTED: "1"}


def listen_note(local_host: str) -> str:
    """Where this process's Mooncake client listens, in one phrase (the daemon's summary)."""
    if shim_loaded():
        env = os.environ.get("HICACHE_BIND_ADDR") or ""
        addr = env.split("@", 1)[0] or "127.0.0.1"
        return f"Mooncake listens on {addr} only (loopback bind shim)"
    if is_loopback(local_host):
        why = shim_problem or "the loopback bind shim is not loaded"
        return (f"Mooncake listens on all interfaces (0.0.0.0 and [::]) although "
                f"--l3-local-host {local_host} is loopback: {why}")
    return (f"Mooncake listens on all interfaces (0.0.0.0 and [::], its own binding; "
            f"--l3-local-host {local_host} is not IPv4 loopback): restrict access with the "
            f"network")


def own_listeners() -> list[str]:
    """Addresses of this process's listening TCP sockets (``/proc/self/net/tcp{,6}``)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    out = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            col = row.split()
            if len(col) < 10 or col[3] != "0A" or col[9] not in mine:  # 0A: LISTEN
                continue
            host, port = col[1].split(":")
            raw = bytes.fromhex(host)
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(words)
            if ip.version == 4:
                out.append(f"{ip}:{int(port, 16)}")
            else:  # as ss writes them: [::ffff:127.0.0.1]
                mapped = ip.ipv4_mapped
                out.append(f"[{'::ffff:' + str(mapped) if mapped else ip}]:{int(port, 16)}")
    return out
