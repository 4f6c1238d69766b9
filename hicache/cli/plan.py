"""``hicache plan``: token capacity per pipeline stage, device and host pool rows.

Every value is read as a string and checked here, so a bad one ends as one ``UsageError`` line
(exit 2) instead of argparse's usage block. See ``hicache.core.planner`` for the rules. Flag
names are ``hicache serve``'s (SGLang's ``--tp-size``, ``--pp-size``; the older ``--tp``,
``--pp``, ``--dp``, ``--config`` are hidden aliases). Per stage it prints the ``hicache serve``
command line that sizes that stage's daemon exactly as planned (``serve_command``; on
``--device cuda:0``, which the operator changes to each GPU's index), and with a host size the
host tier's token capacity; a host tier not larger than the device pools is refused unless
``--force``. An option given where it does not apply is refused (``--force`` without a host
size, ``--request-tokens`` / ``--hot-slots`` without ``--hisparse``, ``--pages-per-checkpoint``
without ``--host-mem``, ``--swa-full-tokens-ratio`` with ``--swa-mode ring``), even at its
default value. Without ``--pp-size``, ``--stage-bounds`` gives the stage count
(``planner.pp_size_of``, as ``hicache serve`` reads it).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys

from hicache.core.errors import UsageError
from hicache.core.hisparse_plan import hisparse_plan
from hicache.core.host_tier import host_tier_by_mirror
from hicache.core.layout import PRESETS, LayoutError, load_model
from hicache.core.planner import (
    DEFAULT_MAX_RUNNING, DEFAULT_SWA_RATIO, HOST_SPLITS, PD_ROLES, SWA_MODES, Plan, PlanInputs,
    StagePlan, human_bytes, parse_bounds, parse_count, parse_fraction, parse_size, plan,
    pp_size_of, refuse_unused, stage_layouts,
)
from hicache.core.resume import DEFAULT_PAGES_PER_CKPT
from hicache.core.sizes import check_host_larger

REQUEST_TOKENS = 131072  # --hisparse: full tokens per long request, unless --request-tokens
SERVE_DEVICE = "cuda:0"  # the serve lines' device: the operator puts each GPU's index there


def negatives_as_values(p: argparse.ArgumentParser) -> None:
    """Let "-5GiB" reach our own checks as a value (argparse only knows "-5" and "-.5")."""
    if hasattr(p, "_negative_number_matcher"):
        p._negative_number_matcher = re.compile(r"^-\.?\d")


def add_arguments(p: argparse.ArgumentParser) -> None:
    negatives_as_values(p)
    src = p.add_argument_group("model (one of)")
    src.add_argument("--preset", metavar="NAME", help=f"model preset: {', '.join(PRESETS)}")
    src.add_argument("--model-config", metavar="FILE", help="a Hugging Face style config.json")
    src.add_argument("--config", dest="model_config", help=argparse.SUPPRESS)
    p.add_argument("--kv-mem", metavar="SIZE", help="KV memory budget per GPU: bytes or e.g. "
                   "100GiB, 80GB, 512MiB (required)")
    p.add_argument("--tp-size", default="1", metavar="N", help="tensor parallel size (KV pools "
                   "are replicated per TP rank: MLA has one KV head) [1]")
    p.add_argument("--tp", dest="tp_size", help=argparse.SUPPRESS)
    p.add_argument("--pp-size", default=None, metavar="N", help="pipeline stages, even split "
                   "[the number of --stage-bounds, else 1]")
    p.add_argument("--pp", dest="pp_size", help=argparse.SUPPRESS)
    p.add_argument("--stage-bounds", metavar="S:E,...", help="explicit [start,end) target layers "
                   "per stage, e.g. 0:22,22:43 (MTP layers go to the last stage)")
    p.add_argument("--dp-size", default="1", metavar="N", help="data parallel workers [1]")
    p.add_argument("--dp", dest="dp_size", help=argparse.SUPPRESS)
    p.add_argument("--max-running", default=str(DEFAULT_MAX_RUNNING), metavar="N",
                   help=f"max running requests per DP worker [{DEFAULT_MAX_RUNNING}]")
    p.add_argument("--pd-role", default="none", metavar="ROLE", help="none | prefill | decode; "
                   "decode keeps 2 x max-running request slots (incoming transfers) [none]")
    p.add_argument("--swa-mode", default="paged", metavar="MODE", help="paged (SWA pages, "
                   "token-scaled) | ring (one SWA ring per request slot) [paged]")
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=None,
                   help="MTP draft layers and 16-slot C4 state rings [the model's own]")
    p.add_argument("--indexer", metavar="DTYPE", help="fp8 | fp4 C4 indexer keys [the model's]")
    p.add_argument("--c128-state", default="online", metavar="KIND",
                   help="online (1 row per request) | offline (128-slot ring) [online]")
    p.add_argument("--swa-full-tokens-ratio", default=None, metavar="R",
                   help="paged SWA: SWA pool tokens / full-token pool tokens, in (0, 1] "
                        f"[{float(DEFAULT_SWA_RATIO):g}]")
    host = p.add_argument_group("host pool (at most one)")
    host.add_argument("--host-mem", metavar="SIZE",
                      help="host budget per GPU: bytes or e.g. 400GiB")
    host.add_argument("--host-ratio", metavar="R", help="host rows : device rows, e.g. 4 or 4:1")
    host.add_argument("--host-split", default=None, metavar="SPLIT",
                      help="device (host rows in the device rows' proportions) | checkpoints "
                           "(page rows plus one checkpoint row per K, as serve --host-split "
                           "checkpoints makes them; needs --host-mem) [device]")
    host.add_argument("--pages-per-checkpoint", default=None, metavar="K",
                      help="with --host-mem, checkpoints mirror: one host checkpoint row per K "
                           f"page rows [{DEFAULT_PAGES_PER_CKPT}]")
    p.add_argument("--force", action="store_true",
                   help="with a host size: accept a host tier not larger than the device pools")
    sp = p.add_argument_group("HiSparse (sparse C4 on the host)")
    sp.add_argument("--hisparse", action="store_true", help="also count concurrent long "
                    "requests per GPU with and without HiSparse")
    sp.add_argument("--request-tokens", default=None, metavar="N",
                    help=f"full tokens per long request [{REQUEST_TOKENS}]")
    sp.add_argument("--hot-slots", default=None, metavar="N",
                    help="hot-buffer slots per C4 layer [2 x the model's index_topk]")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _choice(value: str | None, choices: tuple[str, ...], flag: str) -> str | None:
    if value is not None and value not in choices:
        raise UsageError(f"{flag} must be one of {' | '.join(choices)}, got {value!r}")
    return value


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """Check every argument and build the planner's inputs; raises ``UsageError``."""
    if (args.preset is None) == (args.model_config is None):
        raise UsageError("give exactly one of --preset NAME or --model-config FILE")
    if args.kv_mem is None:
        raise UsageError("--kv-mem is required (KV budget per GPU, e.g. 100GiB)")
    model = load_model(args.preset, args.model_config)
    bounds = parse_bounds(args.stage_bounds) if args.stage_bounds is not None else None
    pp = pp_size_of(bounds, None if args.pp_size is None else
                    parse_count(args.pp_size, "--pp-size"))
    if args.host_mem is not None and args.host_ratio is not None:
        raise UsageError("give --host-mem or --host-ratio, not both")
    _refuse_unused(args)
    return PlanInputs(
        model=model,
        kv_mem=parse_size(args.kv_mem, "--kv-mem"),
        tp=parse_count(args.tp_size, "--tp-size"),
        pp=pp,
        dp=parse_count(args.dp_size, "--dp-size"),
        max_running=parse_count(args.max_running, "--max-running"),
        pd_role=_choice(args.pd_role, PD_ROLES, "--pd-role") or "none",
        swa_mode=_choice(args.swa_mode, SWA_MODES, "--swa-mode") or "paged",
        mtp=args.mtp,
        indexer=_choice(args.indexer, ("fp8", "fp4"), "--indexer"),
        c128_state=_choice(args.c128_state, ("online", "offline"), "--c128-state") or "online",
        swa_ratio=DEFAULT_SWA_RATIO if args.swa_full_tokens_ratio is None else
        parse_fraction(args.swa_full_tokens_ratio, "--swa-full-tokens-ratio"),
        host_mem=None if args.host_mem is None else parse_size(args.host_mem, "--host-mem"),
        host_ratio=None if args.host_ratio is None else parse_fraction(args.host_ratio,
                                                                      "--host-ratio"),
        bounds=bounds,
        pages_per_checkpoint=DEFAULT_PAGES_PER_CKPT if args.pages_per_checkpoint is None else
        parse_count(args.pages_per_checkpoint, "--pages-per-checkpoint"),
        host_split=_choice(args.host_split, HOST_SPLITS, "--host-split") or "device",
    )


def _refuse_unused(args: argparse.Namespace) -> None:
    """Refuse an option given where it does not apply, whatever its value (its default too)."""
    if args.force and args.host_mem is None and args.host_ratio is None:
        raise UsageError("--force accepts a host tier not larger than the device pools; it "
                         "applies with --host-mem or --host-ratio (no host tier is planned)")
    if not args.hisparse:
        given = [f for f, v in (("--request-tokens", args.request_tokens),
                                ("--hot-slots", args.hot_slots)) if v is not None]
        if given:
            raise UsageError(f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} "
                             "only with --hisparse")
    refuse_unused(_choice(args.swa_mode, SWA_MODES, "--swa-mode") or "paged",
                  host_mem=args.host_mem is not None,
                  swa_ratio=args.swa_full_tokens_ratio is not None,
                  pages_per_checkpoint=args.pages_per_checkpoint is not None,
                  host_split=args.host_split is not None)


def check_host(pl: Plan, args: argparse.Namespace) -> None:
    """Refuse a host tier not larger than the device pools on any stage, unless ``--force``."""
    if args.force or (args.host_mem is None and args.host_ratio is None):
        return
    what = f"--host-mem {args.host_mem}" if args.host_mem is not None \
        else f"--host-ratio {args.host_ratio}"
    spaces = ("page",) if pl.inputs.host_split == "checkpoints" else None  # as serve checks
    for s in pl.stages:
        check_host_larger(s.layout, s.device_rows, s.host_rows, what, spaces)


def serve_command(pl: Plan, args: argparse.Namespace, pp_rank: int) -> str:
    """The ``hicache serve`` line that sizes stage ``pp_rank``'s daemon as this plan does."""
    i = pl.inputs
    cmd = ["hicache", "serve", "--device", SERVE_DEVICE]
    cmd += ["--preset", args.preset] if args.preset else ["--model-config", args.model_config]
    cmd += ["--kv-mem", args.kv_mem.strip()]
    if i.tp != 1:
        cmd += ["--tp-size", str(i.tp)]
    if i.pp != 1:
        cmd += ["--pp-size", str(i.pp), "--pp-rank", str(pp_rank)]
    if args.stage_bounds:
        cmd += ["--stage-bounds", args.stage_bounds]
    if i.max_running != DEFAULT_MAX_RUNNING:
        cmd += ["--max-running", str(i.max_running)]
    if i.pd_role != "none":
        cmd += ["--pd-role", i.pd_role]
    if i.swa_mode != "paged":
        cmd += ["--swa-mode", i.swa_mode]
    if i.swa_ratio != DEFAULT_SWA_RATIO:
        cmd += ["--swa-full-tokens-ratio", str(i.swa_ratio)]
    if i.c128_state != "online":
        cmd += ["--c128-state", i.c128_state]
    if i.mtp is not None:
        cmd.append("--mtp" if i.mtp else "--no-mtp")
    if i.indexer is not None:
        cmd += ["--indexer", i.indexer]
    if i.host_mem is not None:
        cmd += ["--host-mem", args.host_mem.strip()]
    elif i.host_ratio is not None:
        cmd += ["--host-ratio", repr(float(i.host_ratio))]
    if i.host_split != "device":
        cmd += ["--host-split", i.host_split]
        if args.pages_per_checkpoint is not None:
            cmd += ["--pages-per-checkpoint", str(i.pages_per_checkpoint)]
    if args.force and (i.host_mem is not None or i.host_ratio is not None):
        cmd.append("--force")
    return " ".join(shlex.quote(c) for c in cmd)


def host_tokens(s: StagePlan) -> int | None:
    """Full tokens the stage's host tier holds (its ``page`` rows x page size)."""
    n = s.host_rows.get("page")
    return None if n is None else n * s.layout.model.page_size


# --------------------------------------------------------------------------- human output
def _n(v: int | None) -> str:
    return "unbounded" if v is None else f"{v:,}"


def _rows(rows: dict[str, int]) -> str:
    return ", ".join(f"{space} {n:,}" for space, n in rows.items())


def _header(pl: Plan) -> list[str]:
    i, m = pl.inputs, pl.inputs.effective_model
    gpus = i.tp * i.pp * i.dp
    counts = {r: sum(1 for x in m.compress_ratios if x == r) for r in (0, 4, 128)}
    role = f", pd-role {i.pd_role}" if i.pd_role != "none" else ""
    swa = (f"paged (SWA tokens = {float(i.swa_ratio):g} x full tokens)" if i.swa_mode == "paged"
           else "ring (one SWA ring per request slot)")
    return [
        f"model     {m.name}: {m.num_layers} layers ({counts[4]} C4, {counts[128]} C128, "
        f"{counts[0]} SWA-only) + {m.num_mtp_layers} MTP",
        f"budget    {human_bytes(i.kv_mem)} ({i.kv_mem:,} B) KV per GPU; TP {i.tp} x PP {i.pp} "
        f"x DP {i.dp} = {gpus} GPU{'s' if gpus > 1 else ''} (KV replicated on each TP rank)",
        f"requests  max-running {i.max_running}{role} -> {pl.request_slots} request slots "
        "per DP worker",
        f"modes     SWA {swa}; MTP {'on' if i.use_mtp else 'off'}; indexer {m.indexer_dtype}; "
        f"C128 state {i.c128_state}",
    ]


def _stage_lines(s: StagePlan, host_asked: bool, serve: str, agreed: bool = False
                 ) -> list[str]:
    lay, st = s.layout, s.layout.stage
    mtp = len(st.layers("swa")) - (st.end - st.start)
    title = f"stage {st.pp_rank}: layers [{st.start}, {st.end})" + (f" + {mtp} MTP" if mtp else "")
    out = ["", title,
           f"  {'pool':<17}{'rows of':<10}{'tok/row':>8}{'row bytes':>11}{'layers':>8}"
           f"{'ring':>6}{'bytes/row id':>14}"]
    for p in lay.pools.values():
        out.append(f"  {p.name:<17}{p.index:<10}{p.tokens_per_page or '-':>8}{p.page_bytes:>11,}"
                   f"{p.num_layers:>8}{p.ring:>6}{p.page_bytes * p.num_layers:>14,}")
    fixed = s.fixed_bytes_per_request
    page = s.layout.model.page_size
    out += [
        f"  bytes per full token     {float(s.bytes_per_full_token):,.2f}",
        f"  fixed bytes per request  {fixed:,} (x {s.slots} slots = {fixed * s.slots:,})",
        f"  token capacity (alone)   {_n(s.token_capacity)}",
        f"  device rows              {_rows(s.device_rows)} = {human_bytes(s.device_bytes)}",
    ]
    if host_asked:
        out.append(f"  host rows                {_rows(s.host_rows)} = {human_bytes(s.host_bytes)}"
                   + (" (agreed over the stages: the fewest per space)" if agreed else ""))
        line = f"  host token capacity      {_n(host_tokens(s))} (page rows x {page})"
        if "swa_page" in s.host_rows:  # a full mirror's page needs a swa_page row too (a
            # stage of SWA-only layers has no page rows: its swa_page rows bound it alone)
            held = min(s.host_rows[x] for x in ("page", "swa_page") if x in s.host_rows)
            line += f"; a full mirror caches {_n(held * page)}"
        out.append(line)
    out.append(f"  serve: {serve}" + ("" if host_asked else "  (add --host-mem SIZE)"))
    return out


def format_plan(pl: Plan, args: argparse.Namespace) -> str:
    i = pl.inputs
    lines = _header(pl)
    for s in pl.stages:
        lines += _stage_lines(s, i.host_mem is not None or i.host_ratio is not None,
                              serve_command(pl, args, s.layout.stage.pp_rank),
                              i.host_mem is not None and len(pl.stages) > 1)
    cap = pl.token_capacity
    lines += ["",
              f"capacity  {_n(cap)} tokens per DP worker (min over stages)"
              + ("" if cap is None else f"; x DP {i.dp} = {cap * i.dp:,}")]
    ratio = pl.ring_vs_paged
    cap_of = {m: "does not fit (see the warning)" if m in pl.unfit else f"{_n(v)} tokens"
              for m, v in (("paged", pl.paged_capacity), ("ring", pl.ring_capacity))}
    lines.append(f"paged vs ring, same inputs: paged {cap_of['paged']} | ring {cap_of['ring']}"
                 + ("" if ratio is None else f" | ring/paged = {ratio:.3f} ({ratio - 1:+.1%})"))
    lines += _mirror_lines(pl)
    lines += [f"warning: {w}" for w in pl.warnings]
    lines.append(f"serve lines: one daemon per GPU of each stage; change --device "
                 f"{SERVE_DEVICE} to that GPU's index and add --metrics-port")
    return "\n".join(lines)


def _mirror_lines(pl: Plan) -> list[str]:
    tiers = host_tier_by_mirror(pl.inputs)
    if tiers is None:
        return []
    out = ["", f"host tier of {human_bytes(pl.inputs.host_mem or 0)} by mirror (min over stages):"]
    for mirror in ("full", "checkpoints"):
        t = tiers[mirror]
        if "error" in t:
            out.append(f"  {mirror:<12} n/a: {t['error']}")
            continue
        ck = f", {t['checkpoints']:,} checkpoints" if mirror == "checkpoints" else ""
        out.append(f"  {mirror:<12} {t['pages']:,} pages{ck} = {t['cached_tokens']:,} cached "
                   f"tokens, {t['cached_tokens_per_host_gib']:,} per host GiB")
        out.append(f"  {'':<12} the daemon the serve line starts: {t['served_pages']:,} pages = "
                   f"{t['served_cached_tokens']:,} cached tokens")
    if "checkpoints_vs_full" in tiers:
        out.append(f"  checkpoints hold {tiers['checkpoints_vs_full']:.2f}x the tokens of a full "
                   f"mirror (one checkpoint per {pl.inputs.pages_per_checkpoint} pages)")
    if pl.inputs.host_split == "checkpoints":
        out.append("  (the first figure of each mirror takes the host memory split for it; the "
                   "serve line makes the checkpoints split, the second figure)")
    else:
        out.append("  (the first figure of each mirror takes the host memory split for it, "
                   "which serve makes with --host-split checkpoints; the serve line splits host "
                   "rows in the device rows' proportions, the second figure)")
    return out


def run(args: argparse.Namespace) -> int:
    inputs = inputs_from_args(args)
    try:
        result = plan(inputs)
    except LayoutError as e:  # the stages: named as the flag that made them, as serve does
        raise UsageError(f"{'--stage-bounds' if args.stage_bounds else '--pp-size'}: {e}") \
            from None
    check_host(result, args)
    sparse = None
    if args.hisparse:
        tokens = REQUEST_TOKENS if args.request_tokens is None else \
            parse_count(args.request_tokens, "--request-tokens")
        slots = None if args.hot_slots is None else parse_count(args.hot_slots, "--hot-slots")
        if slots is not None and slots < inputs.model.index_topk:
            raise UsageError(f"--hot-slots {slots} is below the model's index_topk "
                             f"{inputs.model.index_topk}: a step's misses would not fit")
        sparse = hisparse_plan(stage_layouts(inputs, inputs.swa_mode), inputs.kv_mem, tokens,
                               slots)
    if args.json:
        d = result.to_dict()
        d["host_tier_by_mirror"] = host_tier_by_mirror(result.inputs)
        for s, sd in zip(result.stages, d["stages"]):
            sd["host_token_capacity"] = host_tokens(s) if s.host_rows else None
            sd["serve_command"] = serve_command(result, args, s.layout.stage.pp_rank)
        if sparse is not None:
            d["hisparse"] = sparse.to_dict()
            d["hisparse_concurrency_ratio"] = d["hisparse"]["hisparse_concurrency_ratio"]
        json.dump(d, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_plan(result, args))
        if sparse is not None:
            print("\n".join([""] + sparse.lines()))
    return 0

