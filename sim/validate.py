"""The simulator against a real `agentserving compare` run of the same workload.

The fleet the bench starts is what the simulator runs with ``engine_scheduler`` (every worker's
own FCFS scheduler, 512-token chunks, at most 16 running) on the calibrated ``reference-cpu``
profile, whose pods share the host's cores. One thing about the real run the profile cannot
know is how busy the host was: the bench shares 2 cores with whatever else runs (here, other
jobs' test suites), and its own HTTP processes (proxy, API processes, client, hand-off threads)
compete with the engine loops. That is measured per configuration from the run itself: the
engines' own forward timings (``prefill_seconds`` + ``decode_seconds`` summed over the workers
of each role) against the simulator's forward seconds for the same work. A background load per
pod role (extra runnable processes competing with that role's loops, ``sim/host.py``; a decode
pod's loop also shares its process with the hand-off pulls) is fitted by bisection so that
the two agree; only then are throughput and latency compared, which the fit did not look at.
"""

from __future__ import annotations

from typing import Any

from agentserving.sim.cluster import SimConfig, SimResult, simulate
from agentserving.sim.profile import Profile
from agentserving.sim.workload import SimSession

KEYS = ("req_per_s", "e2e_p95_s", "e2e_p50_s", "ttft_p50_s", "prefix_hit_rate")


def real_forward_s(summary: dict[str, Any]) -> dict[str, float]:
    """Seconds the run's engines spent in forward passes (their own metrics), per role."""
    roles = {p["name"]: p["role"] for p in summary.get("fleet", {}).get("processes", [])}
    out: dict[str, float] = {}
    for name, m in summary.get("workers", {}).items():
        role = roles.get(name, "both")
        out[role] = out.get(role, 0.0) + m.get("prefill_seconds_sum", 0.0) + \
            m.get("decode_seconds_sum", 0.0)
    return out


def real_decode_ttft_s(summary: dict[str, Any]) -> float:
    """Decode workers' summed TTFT: request in (the hand-off) to the first token out."""
    roles = {p["name"]: p["role"] for p in summary.get("fleet", {}).get("processes", [])}
    return sum(m.get("ttft_seconds_sum", 0.0) for name, m in summary.get("workers", {}).items()
               if roles.get(name) == "decode")


def proxy_knobs_of(real: dict[str, Any]) -> dict[str, int]:
    """The proxy's conditional-disaggregation settings in a real run (``SimConfig`` fields):
    its ``--proxy-arg`` flags, else the proxy's defaults for a run that had the feature (its
    report counts local turns), else none (a run from before it: every turn through P/D)."""
    from agentserving.proxy.settings import ProxySettings

    per_turn = real.get("configs", {}).get("agentserving", {}).get("per_turn", {})
    had = "local_prefill_share" in per_turn
    args = (real.get("settings") or {}).get("proxy_args") or []
    defaults = ProxySettings()
    out = {}
    for field in ("local_prefill_tokens", "max_prefill_backlog"):
        flag = "--" + field.replace("_", "-")
        value = getattr(defaults, field) if had else 0
        for i, arg in enumerate(args):
            if arg.startswith(flag + "="):
                value = int(arg.split("=", 1)[1])
            elif arg == flag and i + 1 < len(args):
                value = int(args[i + 1])
        out[field] = value
    return out


def environment_fields(env: dict[str, float] | None) -> dict[str, Any]:
    """A fitted environment (per-role background loads and ``handoff_overhead_s``, as
    ``fit_environment`` returns it) as ``SimConfig`` fields."""
    roles = dict(env or {})
    overhead = roles.pop("handoff_overhead_s", 0.0)
    return {"host_background_roles": roles or None, "handoff_overhead_s": overhead}


def run_config(sessions: list[SimSession], profile: Profile, config: str, topology: str,
               rate: float | None, env: dict[str, float], proxy: dict[str, int] | None = None
               ) -> SimResult:
    return simulate(sessions, profile, SimConfig(config=config, topology=topology, rate=rate,
                                                 engine_scheduler=True,
                                                 **environment_fields(env), **(proxy or {})))


def _bisect(measure: Any, want: float, hi: float, iters: int) -> float:
    """The smallest x in [0, hi] with measure(x) >= want (measure grows with x)."""
    if want <= measure(0.0):
        return 0.0
    if measure(hi) < want:
        return hi
    lo = 0.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        if measure(mid) < want:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit_environment(sessions: list[SimSession], profile: Profile, config: str,
                    topology: str, rate: float | None, forward: dict[str, float],
                    decode_ttft: float = 0.0, iters: int = 12, rounds: int = 3,
                    proxy: dict[str, int] | None = None) -> dict[str, float]:
    """What the run's host was like, from the engines' own metrics:
    - per pod role, the background load at which the simulated forward seconds of that
      role's pods match the real ones (they grow with it: every step runs slower);
    - with P/D, the CPU work per hand-off (besides its bytes) at which the decode pods' summed
      TTFT (request in to first token out) matches the real one.
    Coordinate bisection, a few rounds (they barely interact)."""
    env = {role: 0.0 for role in forward}
    targets: list[tuple[str, float, float]] = [(r, w, 16.0) for r, w in forward.items()]
    if decode_ttft:
        env["handoff_overhead_s"] = 0.0
        targets.append(("handoff_overhead_s", decode_ttft, 5.0))

    def metric(key: str, res: SimResult) -> float:
        st = res.summary["sim"]
        return st["decode_ttft_s"] if key == "handoff_overhead_s" else \
            st["forward_s_by_role"].get(key, 0.0)

    for _ in range(rounds if len(targets) > 1 else 1):
        for key, want, hi in targets:
            env[key] = _bisect(lambda x, key=key: metric(key, run_config(
                sessions, profile, config, topology, rate, {**env, key: x}, proxy)),
                want, hi, iters)
    return env


def validate(real: dict[str, Any], sessions: list[SimSession], profile: Profile,
             fit: bool = True) -> dict[str, Any]:
    """Per configuration of the real report: the fitted background, the simulator's metrics
    with it (and with none), and the relative errors."""
    settings = real.get("settings", {})
    topo = f"{settings.get('prefill', 1)}P{settings.get('decode', 2)}D"
    rate = settings.get("rate")
    proxy = proxy_knobs_of(real)
    out: dict[str, Any] = {"topology": topo, "profile": profile.name, "configs": {},
                           "proxy": proxy}
    for name, summary in real["configs"].items():
        if name not in ("baseline", "agentserving"):
            continue
        target = real_forward_s(summary)
        dttft = real_decode_ttft_s(summary)
        bg = fit_environment(sessions, profile, name, topo, rate, target, dttft,
                             proxy=proxy) if fit and target else {}
        row: dict[str, Any] = {"environment": {k: round(v, 3) for k, v in bg.items()},
                               "real_forward_s": {k: round(v, 3) for k, v in target.items()},
                               "real_decode_ttft_s": round(dttft, 3)}
        for label, b in (("fitted", bg), ("idle_host", {})):
            res = run_config(sessions, profile, name, topo, rate, b, proxy)
            row[label] = {"forward_s": {k: round(v, 3) for k, v in
                                        res.summary["sim"]["forward_s_by_role"].items()},
                          "decode_ttft_s": round(res.summary["sim"]["decode_ttft_s"], 3), **{
                k: {"real": summary.get(k), "sim": res.summary.get(k),
                    "error": (res.summary[k] - summary[k]) / summary[k]
                    if summary.get(k) and res.summary.get(k) is not None else None}
                for k in KEYS}}
        out["configs"][name] = row
    errs = [abs(row["fitted"][k]["error"]) for row in out["configs"].values()
            for k in ("req_per_s", "e2e_p95_s") if row["fitted"][k]["error"] is not None]
    out["max_abs_error"] = max(errs) if errs else None
    out["within_15pct"] = bool(errs) and max(errs) <= 0.15
    return out


def across_runs(validations: list[dict[str, Any]]) -> dict[str, Any]:
    """Several real runs of the same workload, each validated against its own host: per
    configuration and metric, the errors' range and mean, the real runs' own spread, and the
    error of the mean prediction against the mean of the real runs (the bench itself varies
    from run to run, so one run is one draw)."""
    rows: dict[str, dict[str, Any]] = {}
    both_ok = 0
    for v in validations:
        ok = True
        for name, row in v.get("configs", {}).items():
            for k in ("req_per_s", "e2e_p95_s"):
                m = row["fitted"][k]
                if m["error"] is None:
                    continue
                r = rows.setdefault(name, {}).setdefault(k, {"real": [], "sim": [], "error": []})
                r["real"].append(m["real"])
                r["sim"].append(m["sim"])
                r["error"].append(m["error"])
                ok = ok and abs(m["error"]) <= 0.15
        both_ok += ok and bool(v.get("configs"))
    out: dict[str, Any] = {"runs": len(validations), "runs_within_15pct": both_ok}
    for name, metrics in rows.items():
        for k, r in metrics.items():
            real_mean = sum(r["real"]) / len(r["real"])
            sim_mean = sum(r["sim"]) / len(r["sim"])
            out.setdefault(name, {})[k] = {
                "error_min": min(r["error"]), "error_max": max(r["error"]),
                "error_mean": sum(r["error"]) / len(r["error"]),
                "real_min": min(r["real"]), "real_max": max(r["real"]), "real_mean": real_mean,
                "error_of_means": (sim_mean - real_mean) / real_mean}
    return out
