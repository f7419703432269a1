"""bench/pg_serve.py's report: the summary it writes to JSON (medians and paired ratios per part)
and its markdown, one section per part (ingest shared and pinned, instances, heartbeat round
trips, end to end)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from exhook_server.config import Config
from testkit.plumbing import (
    dec,
    min_med_max,
    mmm,
    num,
    share,
)

BATCH_VINS = 200
INGEST_SIDES = ("pg", "pg_unbounded", "raw", "lmdb")
#: Warm-up batches per client channel before a server side is measured.
WARM_BATCHES_PER_CLIENT = 4
#: The instances part's open-loop tables: key in each round (and in its summary, after
#: "instances_"), and what the progress line calls it.
OPEN_TABLES = {"fixed_rate": "fixed total rate", "per_instance_rate": "equal load per instance"}
E2E_SIDES = ("pg", "lmdb")
INGEST_NAMES = {
    "pg": "serve on PostgreSQL",
    "pg_unbounded": "serve on PostgreSQL, no backlog bound",
    "raw": "raw asyncpg loop",
    "lmdb": "serve on LMDB",
}
#: The sides in the per-round tables' headers.
INGEST_SHORT = {"pg": "PostgreSQL", "pg_unbounded": "PostgreSQL, no bound", "raw": "raw", "lmdb": "LMDB"}
#: The sides in the pinned per-round table's CPU-busy columns.
BUSY_SHORT = {"pg": "pg", "pg_unbounded": "pg no bound", "raw": "raw", "lmdb": "LMDB"}
UNBOUNDED_RATIO = "ratio PostgreSQL without the bound / raw asyncpg (paired per round)"
UNBOUNDED_NOTE = (
    f"The side *{INGEST_NAMES['pg_unbounded']}* is there to show the backlog bound's price beside the raw loop "
    "(a batch counts the queues of a sample of its VINs and of those listed at half the bound, which the raw loop "
    "does not): the same server, fresh "
    "database and warm-up as *serve on PostgreSQL*, with `max_pending_per_vehicle = 0` "
    "(`SDV_FANOUT_MAX_PENDING_PER_VEHICLE=0`), a setting an operator may choose but not the default "
    f"({Config().max_pending_per_vehicle}), so the bounded side stays the product's number."
)
#: An open-loop cell's arrivals not sent (late) above this share: the table says so.
LATE_NOTE_SHARE = 0.01


def summarise(out: dict[str, Any]) -> dict[str, Any]:
    """The medians and ratios bench/run_all.py reads (min / median / max over the rounds)."""
    s: dict[str, Any] = {}
    if ing := out.get("ingest"):
        # "ingest": the shared layout (the keys bench/run_all.py reads); "ingest_pinned": PostgreSQL
        # on its own core, the same keys plus how busy each of the two CPUs was.
        for key, rs in (
            ("ingest", [r for r in ing["rounds"] if "pg" in r]),
            ("ingest_pinned", [r["pinned"] for r in ing["rounds"] if "pinned" in r]),
        ):
            if not rs:
                continue
            sides = sides_of(rs[0])
            s[key] = {
                "ratio_pg_over_raw": mmm([r["pg_over_raw"] for r in rs]),
                "ratio_pg_over_lmdb": mmm([r["pg_over_lmdb"] for r in rs]),
                # Without the backlog bound (max_pending_per_vehicle = 0): the bound's price, not the product.
                **(
                    {"ratio_pg_unbounded_over_raw": mmm([r["pg_unbounded_over_raw"] for r in rs])}
                    if "pg_unbounded" in sides
                    else {}
                ),
                **{
                    f"{side}_{k}": mmm([r[side][k] for r in rs])
                    for side in sides
                    for k in ("rows_per_s", "server_us_per_row", "pg_us_per_row", "client_us_per_row")
                },
            }
            if key == "ingest_pinned":
                cpus = ing["pinned_cpus"]
                s[key]["cpus"] = cpus
                s[key].update(
                    {
                        f"{side}_{role}_cpu_busy": mmm([r[side]["cpu_busy"][str(c)] for r in rs])
                        for side in sides
                        for role, c in cpus.items()
                    }
                )
    if inst := out.get("instances"):
        rs = inst["rounds"]
        keys = (
            "calls_per_s",
            "us_per_call",
            "server_us_per_call",
            "pg_us_per_call",
            "cost_vs_first",
            "rate_vs_first",
            "trips_per_call",
        )
        s["instances"] = {str(n): {k: mmm([r[str(n)][k] for r in rs]) for k in keys} for n in inst["levels"]}
        # The open-loop tables apart: bench/run_all.py reads every key of "instances" as a level.
        # "instances_fixed_rate": offered_per_s in all whatever n; "instances_per_instance_rate":
        # per_instance_per_s each, so n times that in all (each level's offered_per_s).
        for t in OPEN_TABLES:
            if t not in rs[0]:
                continue
            by_level = {
                str(n): {
                    **{k: mmm([r[t][str(n)][k] for r in rs]) for k in (*keys, "p50_ms", "p99_ms")},
                    "offered_per_s": rs[0][t][str(n)]["offered_per_s"],
                    "late": sum(r[t][str(n)]["late"] for r in rs),
                    "arrivals": sum(r[t][str(n)]["offered"] for r in rs),
                }
                for n in inst["levels"]
            }
            rate_key = "offered_per_s" if t == "fixed_rate" else "per_instance_per_s"
            s[f"instances_{t}"] = {rate_key: inst[t], "levels": by_level}
    if hb := out.get("heartbeat"):
        s["heartbeat"] = {
            key: {
                k: mmm([r[key][k] for r in hb["rounds"]])
                for k in (
                    "trips_per_heartbeat",
                    "filter_per_heartbeat",
                    "events_per_heartbeat",
                    "achieved_per_s",
                    "heartbeats_per_statement",
                    "server_us_per_heartbeat",
                    "pg_us_per_heartbeat",
                )
            }
            for key in hb["rounds"][0]
        }
    if ee := out.get("e2e"):
        rs = ee["rounds"]
        s["e2e"] = {
            "ratio_pg_over_lmdb": mmm([r["pg_over_lmdb"] for r in rs]),
            "pg_trips_per_delivery": mmm([r["pg"]["trips_per_delivery"] for r in rs]),
            **{f"{side}_stalls": sum(r[side]["stalls"] for r in rs) for side in E2E_SIDES},
            **{f"{side}_msgs_per_s": mmm([r[side]["msgs_per_s"] for r in rs]) for side in E2E_SIDES},
            **{
                f"{side}_{g.replace(' ', '_')}_us_per_msg": mmm([r[side]["cpu_us_per_msg"].get(g, 0.0) for r in rs])
                for side in E2E_SIDES
                for g in ("server", "postgresql", "total")
            },
        }
    return s


def _row(label: str, values: Sequence[float], fmt: Callable[[float], str]) -> str:
    return f"| {label} | {min_med_max(values, fmt)} |"


def med(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def spread(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    """One table cell: the median, then min-max."""
    return f"{fmt(med(values))} ({fmt(min(values))}-{fmt(max(values))})"


def markdown(out: dict[str, Any]) -> str:
    m = out["meta"]
    lines = [
        f"PostgreSQL {m['pg_version']} (throwaway cluster, fsync and synchronous_commit on, 127.0.0.1), asyncpg "
        f"{m['asyncpg']}, {m['cpus']} CPUs shared by the servers, PostgreSQL, brokers, fleets and this load "
        f"generator (except in ingest's pinned layout); load average (1 min) {m['loadavg_1m_before']:.2f} before, "
        f"{m['loadavg_1m_after']:.2f} after; "
        f"{m['rounds']} paired rounds, order rotating; rates min | median | max, the rest medians. "
        f"{m['wall_s']:.0f} s.",
    ]
    if ing := out.get("ingest"):
        lines += ["", *ingest_markdown(ing, m)]
    if inst := out.get("instances"):
        lines += ["", *instances_markdown(inst, m)]
    if hb := out.get("heartbeat"):
        lines += ["", *heartbeat_markdown(hb, m)]
    if ee := out.get("e2e"):
        lines += ["", *e2e_markdown(ee, m)]
    for part, stmts in out.get("statements", {}).items():
        lines += [
            "",
            f"#### Busiest statements of part {part} (pg_stat_statements, every database)",
            "",
            "| database | calls | total ms | mean ms | rows | statement |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for st in stmts:
            q = st["query"].replace("|", "\\|")
            lines.append(
                f"| {st['db']} | {st['calls']:,} | {st['total_ms']:,.0f} | {st['mean_ms']:.3f} | "
                f"{st['rows']:,} | `{q}` |"
            )
    return "\n".join(lines)


def ratio_rows(rs: list[dict[str, Any]], lmdb_label: str) -> list[str]:
    """The paired ratios: the product's (the target's), without the bound beside it, over LMDB."""
    lines = [
        _row("**ratio PostgreSQL / raw asyncpg** (paired per round; target ≥ 0.8)", [r["pg_over_raw"] for r in rs], dec)
    ]
    if "pg_unbounded" in rs[0]:
        lines.append(_row(UNBOUNDED_RATIO, [r["pg_unbounded_over_raw"] for r in rs], dec))
    lines.append(_row(lmdb_label, [r["pg_over_lmdb"] for r in rs], dec))
    return lines


def round_cells(r: dict[str, Any]) -> str:
    """A per-round table's rates and ratios: each side's rows/s, pg/raw, [no bound/raw,] pg/LMDB."""
    sides = sides_of(r)
    ratios_ = [r["pg_over_raw"], *([r["pg_unbounded_over_raw"]] if "pg_unbounded" in sides else []), r["pg_over_lmdb"]]
    return " | ".join([*(f"{r[s]['rows_per_s']:,.0f}" for s in sides), *(f"{x:.2f}" for x in ratios_)])


def round_header(sides: Sequence[str]) -> str:
    """round_cells' column names."""
    return " | ".join(
        [
            *(f"{INGEST_SHORT[s]} rows/s" for s in sides),
            "pg/raw",
            *(["pg no bound/raw"] if "pg_unbounded" in sides else []),
            "pg/LMDB",
        ]
    )


def ingest_rate_rows(rs: list[dict[str, Any]], sides: Sequence[str], lmdb_ratio: str) -> list[str]:
    """A layout's rates table: VIN-rows/s per side, the ratios (`lmdb_ratio` labels PostgreSQL /
    LMDB), batch latency per side."""
    lines = ["| metric | min | median | max |", "|---|---:|---:|---:|"]
    lines += [_row(f"{INGEST_NAMES[s]} VIN-rows/s", [r[s]["rows_per_s"] for r in rs], num) for s in sides]
    lines += ratio_rows(rs, lmdb_ratio)
    lines += [_row(f"{INGEST_NAMES[s]} batch latency p50 ms", [r[s]["p50_ms"] for r in rs], dec) for s in sides]
    return lines


def ingest_markdown(ing: dict[str, Any], m: dict[str, Any]) -> list[str]:
    rs = ing["rounds"]
    lines: list[str] = []
    if "pg" in rs[0]:
        sides = sides_of(rs[0])
        lines += [
            f"### Ingest: {ing['batches']} batches x {BATCH_VINS} VINs per run, "
            f"{ing['clients']} channels / connections",
            "",
            *ingest_rate_rows(rs, sides, "ratio PostgreSQL / LMDB (paired per round)"),
        ]
        lines += ["", *ingest_cpu_table(rs)]
        procs = rs[0]["pg"]["server_processes"]
        lines += [
            "",
            f"Each run a fresh database (or data dir) and a fresh server ({procs} process(es)); the raw loop writes "
            "into the product's schema (same tables and indexes): per batch one transaction with `INSERT INTO blobs "
            "... ON CONFLICT DO NOTHING` and one `INSERT INTO rows ... SELECT FROM unnest($1) ... ON CONFLICT DO "
            "UPDATE`, nothing else (no receipts, counts, outcomes, backlog bound, old-row read or dispatch check). "
            f"Before a server side is measured, {WARM_BATCHES_PER_CLIENT} batches per channel of other VINs and "
            "requests go in unmeasured (the server's database pool grows to what the load needs, statements get "
            "prepared), as the raw loop opens its connections and prepares outside its measurement. A "
            "checkpoint before every run; CPU counted until the servers and PostgreSQL are idle again. This is the "
            f"**shared** layout: the server, PostgreSQL and this load generator all run on all {m['cpus']} CPUs, so "
            "on a small machine the serve sides pay for three busy programs on the cores the raw side leaves to "
            "PostgreSQL and a tiny client; the pinned layout below gives PostgreSQL a core of its own, as its own "
            "machine in production.",
            *(["", UNBOUNDED_NOTE] if "pg_unbounded" in sides else []),
            "",
            f"| round | order | {round_header(sides)} |",
            "|---:|---|" + "---:|" * (len(sides) + 2 + ("pg_unbounded" in sides)),
        ]
        for i, r in enumerate(rs, 1):
            lines.append(f"| {i} | {r['order']} | {round_cells(r)} |")
    if "pinned" in rs[0]:
        lines += ["", *pinned_markdown(ing, m)]
    elif ing.get("pinned_note"):
        lines += ["", f"Ingest with PostgreSQL on its own core (pinned layout): {ing['pinned_note']}."]
    return lines


def ingest_cpu_table(rs: list[dict[str, Any]], cpus: dict[str, int] | None = None) -> list[str]:
    """CPU µs per VIN-row by group, medians over the rounds; with the pinned layout's `cpus`, how
    busy PostgreSQL's CPU and the client side's CPU were."""
    busy = (
        f" | CPU {cpus['postgresql']} (PostgreSQL's) busy under load "
        f"| CPU {cpus['client']} (client side's) busy under load"
        if cpus
        else ""
    )
    lines = [
        "| CPU µs per VIN-row (median) | sdv-fanout server | PostgreSQL (all its processes) | this process "
        f"| server + PostgreSQL{busy} | other processes (share of a core) |",
        "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if cpus else ""),
    ]
    for side in sides_of(rs[0]):
        srv, pgc = med([r[side]["server_us_per_row"] for r in rs]), med([r[side]["pg_us_per_row"] for r in rs])
        cores = (
            "".join(f" | {share(med([r[side]['cpu_busy'][str(c)] for r in rs]))}" for c in cpus.values())
            if cpus
            else ""
        )
        lines.append(
            f"| {INGEST_NAMES[side]} | {srv:.1f} | {pgc:.1f} | {med([r[side]['client_us_per_row'] for r in rs]):.1f} "
            f"| {srv + pgc:.1f}{cores} | {share(med([r[side]['other_share'] for r in rs]))} |"
        )
    return lines


def pinned_markdown(ing: dict[str, Any], m: dict[str, Any]) -> list[str]:
    """The pinned layout's tables: PostgreSQL on a CPU of its own, the client side on another."""
    rs = [r["pinned"] for r in ing["rounds"]]
    sides = sides_of(rs[0])
    cpus = ing["pinned_cpus"]
    db_cpu, client_cpu = cpus["postgresql"], cpus["client"]
    lines = [
        f"### Ingest, PostgreSQL on its own core: {ing['batches']} batches x {BATCH_VINS} VINs per run, "
        f"PostgreSQL on CPU {db_cpu}, the client side on CPU {client_cpu}",
        "",
        *ingest_rate_rows(rs, sides, "ratio PostgreSQL / LMDB (one-core server, paired per round)"),
    ]
    lines += ["", *ingest_cpu_table(rs, cpus)]
    procs = rs[0]["pg"]["server_processes"]
    db_sides = [s for s in sides if s != "lmdb"]  # the LMDB side leaves PostgreSQL's CPU idle
    lines += [
        "",
        f"In production PostgreSQL runs on a machine of its own. Here it gets CPU {db_cpu} alone: the postmaster and "
        "every process it has are pinned there (`sched_setaffinity`, every thread), and the backends it forks "
        f"later inherit the mask. CPU {client_cpu} is the client side's: for the PostgreSQL and LMDB sides the "
        f"`serve` process tree and this load generator (every thread of it), the server started with that one CPU "
        f"visible and so runs {procs} process(es); for the raw side the raw loop alone. The LMDB side has no "
        f"database: its server and load generator share CPU {client_cpu} while CPU {db_cpu} stays idle, i.e. a "
        "one-core server. The masks are checked after each measurement and set back to all CPUs after each cell. "
        "Cells of both layouts rotate together round by round. How busy each CPU was while the batches went in "
        f"(/proc/stat, anyone's work) says what limits a side: CPU {db_cpu} near 100 % is PostgreSQL, CPU "
        f"{client_cpu} near 100 % the server and load generator, neither means the side waits (commits' fsyncs, "
        "round trips) more than it computes. Other processes (another benchmark, the system) still use either CPU.",
        # Said once, under the shared tables, when they ran.
        *(["", UNBOUNDED_NOTE] if "pg_unbounded" in sides and "pg" not in ing["rounds"][0] else []),
        "",
        f"| round | {round_header(sides)} "
        f"| CPU {db_cpu} busy ({' / '.join(BUSY_SHORT[s] for s in db_sides)}) "
        f"| CPU {client_cpu} busy ({' / '.join(BUSY_SHORT[s] for s in sides)}) |",
        "|---:|" + "---:|" * (len(sides) + 2 + ("pg_unbounded" in sides) + 2),
    ]
    for i, r in enumerate(rs, 1):
        busy = {s: r[s]["cpu_busy"] for s in sides}
        lines.append(
            f"| {i} | {round_cells(r)} "
            f"| {' / '.join(share(busy[s][str(db_cpu)]) for s in db_sides)} "
            f"| {' / '.join(share(busy[s][str(client_cpu)]) for s in sides)} |"
        )
    return lines


def instances_markdown(inst: dict[str, Any], m: dict[str, Any]) -> list[str]:
    rs, levels = inst["rounds"], inst["levels"]
    first = levels[0]
    open_ = [t for t in OPEN_TABLES if t in rs[0]]
    mix = (
        f"{1 - m['subscribe_share'] - m['ack_share']:.0%} heartbeats, {m['subscribe_share']:.0%} subscribes, "
        f"{m['ack_share']:.0%} acks"
    )
    lines = [
        f"### Instances: {mix}, {inst['vins']:,} vehicles, closed loop with {m['clients']} calls in flight spread "
        f"over the instances, {m['duration']:g} s per cell",
        "",
        "| instances | calls/s, median (min-max) | **server + PostgreSQL CPU µs/call** | **cost vs "
        f"{first}** (paired, median (min-max)) | server µs/call | PostgreSQL µs/call | load generator µs/call "
        "| db round trips/call | p99 ms | server CPU (cores) | PostgreSQL CPU (cores) | idle instances (cores) "
        "| other processes |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in levels:
        c = [r[str(n)] for r in rs]
        lines.append(
            f"| {n} | {spread([x['calls_per_s'] for x in c], num)} | {med([x['us_per_call'] for x in c]):,.0f} | "
            f"{spread([x['cost_vs_first'] for x in c], dec)} | {med([x['server_us_per_call'] for x in c]):,.0f} | "
            f"{med([x['pg_us_per_call'] for x in c]):,.0f} | {med([x['client_us_per_call'] for x in c]):,.0f} | "
            f"{med([x['trips_per_call'] for x in c]):.2f} | {med([x['p99_ms'] for x in c]):.1f} | "
            f"{med([x['server_share'] for x in c]):.2f} | {med([x['pg_share'] for x in c]):.2f} | "
            f"{med([x['idle_instances_share'] for x in c]):.2f} | {share(med([x['other_share'] for x in c]))} |"
        )
    lines += [
        "",
        f"Each instance is one `serve` process (`processes = 1`) with its own port and pool, all on one database, "
        f"delivering to one mosquitto; {max(levels)} run throughout, the driver uses the first n. Set-up: every "
        f"vehicle subscribed, then one row each, so each has a delivery out; the acks walk those rows "
        f"({inst['acks_issued']:,} acks issued, {inst['rows_stored'] - inst['rows_left']:,} rows deleted). CPU per "
        "call counts every call issued (warm-up included) and lasts until the servers and PostgreSQL are idle, so the "
        "work behind the answers (heartbeat filter, events) is in it. calls/s is bounded by the 2 shared cores: "
        "read the cost column. At saturation the cost column also holds the machine's: more processes busy on "
        "the same cores add scheduling and waiting to every call"
        + (
            f"; the open-loop {'tables below measure' if len(open_) > 1 else 'table below measures'} the cost below "
            "saturation."
            if open_
            else "."
        ),
    ]
    for t in open_:
        lines += ["", *open_loop_markdown(inst, m, t)]
    return lines


def open_loop_markdown(inst: dict[str, Any], m: dict[str, Any], t: str) -> list[str]:
    """One of the instances part's open-loop tables (`t` in OPEN_TABLES): the same mix at each n's
    total offered rate, its title and prose by table, then which cells (if any) could not send more
    than LATE_NOTE_SHARE of their arrivals."""
    rs, levels = [r[t] for r in inst["rounds"]], inst["levels"]
    title, prose = (fixed_rate_text if t == "fixed_rate" else per_instance_text)(inst, m)
    lines = [
        title,
        "",
        "| instances | offered calls/s | achieved calls/s, median (min-max) | achieved / offered "
        f"| **server + PostgreSQL CPU µs/call** | **cost vs {levels[0]}** (paired, median (min-max)) "
        "| server µs/call | PostgreSQL µs/call | load generator µs/call | db round trips/call | p50 ms | p99 ms "
        "| late: not sent (all rounds, share of arrivals) / send lag p99 ms "
        "| server CPU (cores) | PostgreSQL CPU (cores) | idle instances (cores) | other processes |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    late: list[str] = []
    for n in levels:
        c = [r[str(n)] for r in rs]
        offered = c[0]["offered_per_s"]
        missed = sum(x["late"] for x in c) / max(1, sum(x["offered"] for x in c))
        lines.append(
            f"| {n} | {offered:,.0f} | {spread([x['calls_per_s'] for x in c], num)} | "
            f"{share(med([x['calls_per_s'] / offered for x in c]))} | "
            f"{med([x['us_per_call'] for x in c]):,.0f} | {spread([x['cost_vs_first'] for x in c], dec)} | "
            f"{med([x['server_us_per_call'] for x in c]):,.0f} | {med([x['pg_us_per_call'] for x in c]):,.0f} | "
            f"{med([x['client_us_per_call'] for x in c]):,.0f} | {med([x['trips_per_call'] for x in c]):.2f} | "
            f"{med([x['p50_ms'] for x in c]):.1f} | {med([x['p99_ms'] for x in c]):.1f} | "
            f"{sum(x['late'] for x in c):,} ({missed:.1%}) / {med([x['send_lag_p99_ms'] for x in c]):.1f} | "
            f"{med([x['server_share'] for x in c]):.2f} | "
            f"{med([x['pg_share'] for x in c]):.2f} | {med([x['idle_instances_share'] for x in c]):.2f} | "
            f"{share(med([x['other_share'] for x in c]))} |"
        )
        worst = max(x["late"] / max(1, x["offered"]) for x in c)
        if worst > LATE_NOTE_SHARE:
            late.append(
                f"{n} instance{'s' * (n > 1)} at {offered:,.0f} calls/s ({missed:.1%} of arrivals late over the "
                f"rounds, {worst:.1%} in the worst)"
            )
    low = min(r[str(n)]["offered_per_s"] for r in rs for n in levels)
    lines += [
        "",
        prose,
        "",
        "achieved / offered: calls answered per second over the nominal offered rate; the Poisson arrivals alone "
        f"move it by about ±{1 / (low * m['duration']) ** 0.5:.0%} at {low:,.0f} calls/s over {m['duration']:g} s "
        "(one standard deviation), less at higher rates.",
    ]
    if late:
        lines += [
            "",
            f"**Not all of the offered load was sent in this run**: more than {LATE_NOTE_SHARE:.0%} of a cell's "
            f"arrivals found {inst['max_in_flight']} calls in flight and were not sent, for "
            + "; ".join(late)
            + ". Those cells' achieved rate is under the offered one (the answers came too slowly: the machine was "
            "near saturation, or other load on it), and their CPU per call is over the calls sent.",
        ]
    return lines


def fixed_rate_text(inst: dict[str, Any], m: dict[str, Any]) -> tuple[str, str]:
    """The fixed-rate table's title and prose: one total offered rate, whatever the number of instances."""
    levels, rate = inst["levels"], inst["fixed_rate"]
    title = (
        f"### Instances at a fixed rate of {rate:,.0f} calls/s: the same mix, open loop (Poisson arrivals) spread "
        f"call by call over the instances, at most {inst['max_in_flight']} calls in flight, {m['duration']:g} s per "
        "cell"
    )
    prose = (
        "CPU per call is a cost, so it is measured below saturation: the instances together get the same offered "
        f"rate whatever their number ({rate:,.0f} calls/s, i.e. {rate / max(levels):,.0f} per instance with "
        f"{max(levels)}), the cores keep idle time, and what grows with n is what each instance adds per call, "
        "not the scheduler's work of a saturated machine: each gets 1/n of the calls, so fewer of them share "
        "an event-loop wake-up or a batched heartbeat filter statement (see round trips/call), and its own "
        "timers and pool are spread over fewer calls (a higher `--inst-rate` lowers the cost per call at every "
        "n). Arrivals at their Poisson times, each call issued on time "
        f"unless {inst['max_in_flight']} are already in flight: then it is not sent and counts as late (nothing "
        "queues, so the offered rate is never exceeded to catch up). Same servers, set-up and CPU accounting as "
        "the closed-loop table (every call issued, warm-up included, until the servers and PostgreSQL are idle), "
        "except that counting starts once the driver's channels are open and warm: their set-up would weigh on "
        "a few hundred calls, more with more instances. Its cells rotate with the other tables' cells."
    )
    return title, prose


def per_instance_text(inst: dict[str, Any], m: dict[str, Any]) -> tuple[str, str]:
    """The equal-load table's title and prose: each instance offered the same rate, so n times it in all."""
    levels, each = inst["levels"], inst["per_instance_rate"]
    top = max(levels)
    saturation = med([r[str(top)]["calls_per_s"] for r in inst["rounds"]])
    title = (
        f"### Instances at equal load per instance, {each:,.0f} calls/s each: the same mix, open loop (Poisson "
        f"arrivals) at n x {each:,.0f} calls/s in all, spread call by call over the n instances, at most "
        f"{inst['max_in_flight']} calls in flight, {m['duration']:g} s per cell"
    )
    below = (
        f"stays below this {m['cpus']}-core VM's saturation ({top} x {each:,.0f} = {top * each:,.0f} calls/s "
        f"against the {saturation:,.0f} calls/s of the closed loop above with {top}), so the cores keep idle time"
        if top * each < saturation
        else f"is at or above this {m['cpus']}-core VM's saturation ({top} x {each:,.0f} = {top * each:,.0f} "
        f"calls/s against the {saturation:,.0f} calls/s of the closed loop above with {top}): its top rows hold "
        "some of the saturated machine's scheduling too; a lower `--inst-rate-per-instance` keeps under it"
    )
    shared = [n for n in levels if inst["fixed_rate"] and n * each == inst["fixed_rate"]]
    prose = (
        "This is the scale-out measurement: scaling out adds instances, each carrying its share of a growing "
        f"fleet, so n instances are offered n x {each:,.0f} calls/s, {each:,.0f} each. In production each instance "
        "would have cores of its own, so throughput scales with cores when CPU per call stays flat here as n "
        f"grows (cost vs {levels[0]} near 1): n instances then carry n times the calls on n times the cores. Here "
        f"they share the VM's cores, and the total {below}. Unlike the fixed-rate table, each instance's "
        "load does not fall as n grows, so neither does the number of calls sharing its wake-ups and batched "
        "statements. Same driver (Poisson arrivals, at most "
        f"{inst['max_in_flight']} in flight, late arrivals not sent), set-up and CPU accounting as the fixed-rate "
        "table; its cells rotate with the other tables' cells"
        + (
            f", and its {' and '.join(f'{n}-instance' for n in shared)} "
            f"{'cells are' if len(shared) > 1 else 'cell is'} the fixed-rate table's (the same offered rate: "
            "measured once per round, shown in both)."
            if shared
            else "."
        )
    )
    return title, prose


def heartbeat_markdown(hb: dict[str, Any], m: dict[str, Any]) -> list[str]:
    rs = hb["rounds"]
    lines = [
        f"### Heartbeat round trips: {hb['vins_per_fleet']:,} vehicles per fleet, open loop (Poisson) for "
        f"{m['hb_duration']:g} s per cell",
        "",
        "| window ms | fleet | offered/s | achieved/s | **db round trips / heartbeat**, median (min-max) "
        "(target ≤ 0.05) | heartbeat filter / heartbeat | events / heartbeat | heartbeats per filter statement "
        "| server µs/heartbeat | PostgreSQL µs/heartbeat |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in rs[0]:
        w, phase, rate = key.split("/")
        c = [r[key] for r in rs]
        lines.append(
            f"| {w} | {phase} | {float(rate):,.0f} | {med([x['achieved_per_s'] for x in c]):,.0f} | "
            f"{spread([x['trips_per_heartbeat'] for x in c], lambda v: f'{v:.3f}')} | "
            f"{med([x['filter_per_heartbeat'] for x in c]):.3f} | {med([x['events_per_heartbeat'] for x in c]):.4f} | "
            f"{med([x['heartbeats_per_statement'] for x in c]):.1f} | "
            f"{med([x['server_us_per_heartbeat'] for x in c]):.0f} | {med([x['pg_us_per_heartbeat'] for x in c]):.0f} |"
        )
    lines += [
        "",
        f"One instance per `heartbeat_window_ms` (each one process) on one database; two fleets, every vehicle "
        f"connected (subscribed) before: **idle** has nothing pending; in **work**, {hb['busy']:,} of its vehicles "
        f"({m['work_share']:.0%}) have 2 rows, the first sent at set-up and still out (no vehicle PUBACKs; "
        f"{hb['out_before']:,} deliveries out before, {hb['out_after']:,} after). Round trips are the server's "
        "`sdv_fanout_db_round_trips_total` (every purpose) over `sdv_fanout_heartbeats_total`, from before the "
        "cell until the work behind the answers is done. A statement gathers what arrives in one window plus what "
        "arrives while the previous statement runs, so round trips per heartbeat ≈ 1 / (rate x (window + statement "
        "time)) per instance.",
    ]
    return lines


def e2e_markdown(ee: dict[str, Any], m: dict[str, Any]) -> list[str]:
    rs = ee["rounds"]
    lines = [
        f"### End to end: {ee['vehicles']:,} vehicles x {ee['batches']} batches per measurement, bench/e2e.py's rig "
        "once per store",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
        _row(
            "PostgreSQL deliveries/s (batch → MQTT → PUBACK → acked hook → row deleted)",
            [r["pg"]["msgs_per_s"] for r in rs],
            num,
        ),
        _row("LMDB deliveries/s", [r["lmdb"]["msgs_per_s"] for r in rs], num),
        _row("**ratio PostgreSQL / LMDB** (paired per round)", [r["pg_over_lmdb"] for r in rs], dec),
        _row("PostgreSQL: per-vehicle cycle p50 ms", [r["pg"]["cycle_p50_ms"] for r in rs], dec),
        _row("LMDB: per-vehicle cycle p50 ms", [r["lmdb"]["cycle_p50_ms"] for r in rs], dec),
        _row("PostgreSQL: store write transactions/s", [r["pg"]["commits_per_s"] for r in rs], num),
        _row("PostgreSQL: database round trips / delivery", [r["pg"].get("trips_per_delivery", 0.0) for r in rs], dec),
        _row("LMDB: store commits/s", [r["lmdb"]["commits_per_s"] for r in rs], num),
        "",
        "| CPU µs per delivery (median) | server | PostgreSQL | mosquitto | sim fleet (vehicles + hook driver) "
        "| this process | all | other processes (share of a core) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for side, name in (("pg", "PostgreSQL"), ("lmdb", "LMDB")):

        def us(g: str, side: str = side) -> float:
            return med([r[side]["cpu_us_per_msg"].get(g, 0.0) for r in rs])

        lines.append(
            f"| {name} | {us('server'):,.0f} | {us('postgresql'):,.0f} | {us('mosquitto'):,.0f} | "
            f"{us('sim fleet'):,.0f} | {us('bench'):,.0f} | {us('total'):,.0f} | "
            f"{share(med([r[side]['cpu']['other processes'] for r in rs]))} |"
        )
    stalls = {side: sum(r[side]["stalls"] for r in rs) for side in E2E_SIDES}
    nudged = {side: sum(r[side]["nudged_vins"] for r in rs) for side in E2E_SIDES}
    idle = sum(r["pg"]["idle_vins"] for r in rs)
    lines += [
        "",
        f"**Stalls** (rows left and no delivery ended for {ee['stall_s']:g} s; each vehicle still holding rows then "
        f"sent one heartbeat, as its next periodic one would): PostgreSQL {stalls['pg']} in the measured runs "
        f"({nudged['pg']} vehicle heartbeats; {idle} of those vehicles had no delivery out, i.e. a lost wake-up, "
        f"not a slow one), LMDB {stalls['lmdb']} ({nudged['lmdb']}); warm-ups included: {ee['stalls_total']['pg']} "
        f"(lost wake-ups: {ee['idle_total']['pg']}) and {ee['stalls_total']['lmdb']}. A stall's wait is in that "
        "run's time; under load a slow tail can stall too.",
        "",
        f"Two rigs up for the whole part (each its own mosquitto, server with its default process count and "
        f"{ee['procs']} sim fleet processes); per round each runs bench/e2e.py's `run_ours` (first publish → the "
        "store holding 0 rows), order alternating, after one unrecorded warm-up. The idle rig counts as other "
        "processes. Write transactions on PostgreSQL are xids assigned (each event that changed a vehicle's state, "
        "each batch); on LMDB group commits.",
    ]
    return lines


def sides_of(res: dict[str, Any]) -> list[str]:
    """The ingest sides a round's results (one layout's) hold, in INGEST_SIDES order."""
    return [s for s in INGEST_SIDES if s in res]
