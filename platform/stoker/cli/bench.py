"""`stoker bench` and `stoker plan`: measure a deployment under load, then size it for a rate.

    stoker bench NAME (--trace FILE [--thin K] [--time-scale S] | --rate R) [--duration D]
                 [--concurrency-limit N] [--prompt-tokens N] [--output-tokens N]
                 [--max-prompt-tokens N] [--max-tokens N] [--seed N] [--timeout D] [--json] [--url URL]
    stoker plan --from BENCH.json --qps Q --p99-ttft S [--peak-qps P] [--redundancy N+K]
                [--instances-per-device N] [--min-samples N] [--json]

`bench` replays the load (`stoker.cli.loadgen`) against the platform's OpenAI API, with
`$STOKER_API_KEY` (else `$STOKER_ADMIN_KEY`) as the bearer key when set, and prints its figures
(`stoker.cli.plan.summarize`); `--json` prints them with every request's sample, the file `plan`
reads. `plan` is pure arithmetic on that file (`stoker.cli.plan`); it reaches nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from stoker.cli.admin_client import add_url_args, base_url, call
from stoker.cli.plan import BENCH_KIND, Sample, explain, levels, parse_redundancy, plan, summarize
from stoker.errors import CLIError
from stoker.spec.durations import duration


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser(
        "bench", help="replay load against a deployment: TTFT, TPOT, e2e, throughput, cold starts"
    )
    b.add_argument("name", metavar="NAME", help="the deployment (the requests' `model`)")
    load = b.add_mutually_exclusive_group(required=True)
    load.add_argument(
        "--trace", type=Path, metavar="FILE", help="CSV with TIMESTAMP, ContextTokens, GeneratedTokens"
    )
    load.add_argument("--rate", type=float, metavar="R", help="Poisson arrivals, R requests per second")
    b.add_argument(
        "--duration",
        type=duration,
        metavar="D",
        help="how long to send for (default: 1m with --rate, the whole trace with --trace)",
    )
    for flag, kind, default, meta, text in (
        ("--thin", int, 1, "K", "--trace: keep every K-th request"),
        ("--time-scale", float, 1.0, "S", "--trace: multiply every time by S (< 1: faster)"),
        ("--prompt-tokens", int, 256, "N", "--rate: each prompt's size in tokens (about)"),
        ("--output-tokens", int, 128, "N", "--rate: each request's max_tokens"),
        ("--max-prompt-tokens", int, 2000, "N", "cap on a prompt's tokens (a trace's ContextTokens)"),
        ("--max-tokens", int, 1024, "N", "cap on a request's max_tokens (a trace's GeneratedTokens)"),
        ("--concurrency-limit", int, None, "N", "at most N requests in flight (default: no limit)"),
        ("--seed", int, 0, "N", "--rate: seeds the arrival times"),
        ("--timeout", duration, "5m", "D", "one request's limit, end to end"),
    ):
        b.add_argument(flag, type=kind, default=default, metavar=meta, help=text)
    b.add_argument(
        "--json", action="store_true", help="one JSON object: the figures and every request's sample"
    )
    add_url_args(b)
    b.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "plan", help="size a deployment for a rate and a p99 TTFT from a `stoker bench --json` file"
    )
    p.add_argument(
        "--from",
        dest="bench",
        type=Path,
        required=True,
        metavar="BENCH.json",
        help="`stoker bench --json` output",
    )
    p.add_argument(
        "--qps", type=float, required=True, metavar="Q", help="the rate to serve, requests per second"
    )
    p.add_argument(
        "--p99-ttft", type=duration, required=True, metavar="S", help="the p99 time to first token to meet"
    )
    p.add_argument(
        "--peak-qps", type=float, metavar="P", help="the highest rate, sizes --max (default: --qps)"
    )
    p.add_argument("--redundancy", default="N+0", metavar="N+K", help="K spare instances beyond the load's N")
    p.add_argument(
        "--instances-per-device", type=int, default=1, metavar="N", help="instances that share one device"
    )
    p.add_argument(
        "--min-samples", type=int, default=5, metavar="N", help="requests an in-flight level needs to count"
    )
    p.add_argument("--json", action="store_true", help="one JSON object: the plan and its inputs")
    p.set_defaults(func=cmd_plan)


def _positive(args: argparse.Namespace, flag: str, value, low=1) -> None:
    if value is not None and not value >= low:
        raise CLIError(f"--{flag} must be {low} or more, got {value!r}")


def cmd_bench(args: argparse.Namespace) -> int:
    from stoker.cli.loadgen import poisson_arrivals, replay, trace_arrivals

    for flag in (
        "thin",
        "prompt_tokens",
        "output_tokens",
        "max_prompt_tokens",
        "max_tokens",
        "concurrency_limit",
    ):
        _positive(args, flag.replace("_", "-"), getattr(args, flag))
    if args.rate is not None and not (0 < args.rate < float("inf")):
        raise CLIError(f"--rate must be a number of requests per second > 0, got {args.rate!r}")
    if args.duration is not None and args.duration <= 0:
        raise CLIError(f"--duration must be more than 0 s, got {args.duration!r}")
    if args.timeout <= 0:
        raise CLIError(f"--timeout must be more than 0 s, got {args.timeout!r}")
    url = base_url(args)
    if args.trace is not None:
        from warm_pool.trace import TraceError, load_trace

        try:
            requests = load_trace(args.trace, thin=args.thin, time_scale=args.time_scale)
        except TraceError as exc:
            raise CLIError(str(exc)) from None
        arrivals = trace_arrivals(
            requests,
            duration=args.duration,
            max_prompt_tokens=args.max_prompt_tokens,
            max_tokens=args.max_tokens,
        )
        load = {
            "trace": str(args.trace),
            "thin": args.thin,
            "time_scale": args.time_scale,
            "duration_s": args.duration,
        }
    else:
        span = 60.0 if args.duration is None else args.duration
        arrivals = poisson_arrivals(
            args.rate,
            span,
            prompt_tokens=min(args.prompt_tokens, args.max_prompt_tokens),
            max_tokens=min(args.output_tokens, args.max_tokens),
            seed=args.seed,
        )
        load = {"rate": args.rate, "duration_s": span, "seed": args.seed}
    if not arrivals:
        raise CLIError(
            "no requests to send: the trace has none within --duration, or --rate × --duration is too small"
        )
    key = os.environ.get("STOKER_API_KEY") or os.environ.get("STOKER_ADMIN_KEY")
    run = asyncio.run(
        replay(
            url,
            args.name,
            arrivals,
            api_key=key,
            concurrency_limit=args.concurrency_limit,
            timeout_s=args.timeout,
        )
    )
    result = {
        "kind": BENCH_KIND,
        "version": 1,
        "deployment": args.name,
        "url": url,
        "load": {**load, "concurrency_limit": args.concurrency_limit},
        **_deployment_of(args),
        **summarize(run.samples, run.wall_s),
        "levels": [lv.to_json() for lv in levels(run.samples)],
        "samples": [s.to_json() for s in run.samples],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print("\n".join(_bench_lines(result)))
    return 0


def _deployment_of(args: argparse.Namespace) -> dict:
    """The deployment's model and engine, for the deploy command `plan` prints (needs the admin
    key where the platform has one; without it the plan says MODEL)."""
    try:
        d = call(args, "GET", f"/admin/v1/deployments/{args.name}")
    except CLIError:
        return {}
    return {"model": d.get("snapshot_id") or d.get("model"), "engine": d.get("engine")}


def _s(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _bench_lines(r: dict) -> list[str]:
    load = r["load"]
    how = f"--rate {load['rate']:g}/s" if "rate" in load else f"--trace {load['trace']}"
    errors = ", ".join(f"{n} {kind}" for kind, n in r["error_kinds"].items())
    out = [
        f"bench {r['deployment']} ({how}): {r['requests']} requests in {r['wall_s']:.1f} s, "
        f"{r['answered']} answered, {r['errors']} errors{f' ({errors})' if errors else ''}, "
        f"{r['cold_starts']} cold starts",
        f"throughput      {r['throughput_rps']:.2f} req/s, {r['output_tokens_per_s']:.1f} output tokens/s",
        "                p50 s     p99 s",
        f"TTFT            {_s(r['ttft_p50_s']):<9} {_s(r['ttft_p99_s'])}   (warm only p99 {_s(r['ttft_warm_p99_s'])})",
        f"TPOT            {_s(r['tpot_p50_s']):<9} {_s(r['tpot_p99_s'])}",
        f"e2e             {_s(r['e2e_p50_s']):<9} {_s(r['e2e_p99_s'])}",
        f"in flight       {r['mean_in_flight']:.2f} on average (Σ e2e / wall time), {r['instances_seen']} instance(s) "
        f"answered, {_s(r['in_flight_per_instance'])} per instance",
    ]
    if r["levels"]:
        out.append("by in flight on the instance at send (warm answers):")
        out.append("  in flight   requests   p50 TTFT s   p99 TTFT s   mean e2e s")
        for lv in r["levels"]:
            out.append(
                f"  {lv['in_flight']:<11} {lv['requests']:<10} {lv['ttft_p50_s']:<12.3f} "
                f"{lv['ttft_p99_s']:<12.3f} {lv['e2e_mean_s']:.3f}"
            )
    return out


def _read_bench(path: Path) -> tuple[dict, list[Sample]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CLIError(f"--from {path}: no such file") from None
    except IsADirectoryError:
        raise CLIError(f"--from {path}: is a directory, not a bench file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"--from {path}: cannot read it: {exc}") from None
    try:
        bench = json.loads(text)
    except ValueError:
        raise CLIError(f"--from {path}: not JSON; give the output of `stoker bench NAME … --json`") from None
    if (
        not isinstance(bench, dict)
        or bench.get("kind") != BENCH_KIND
        or not isinstance(bench.get("samples"), list)
    ):
        raise CLIError(f"--from {path}: not a bench result; give the output of `stoker bench NAME … --json`")
    try:
        samples = [Sample.from_json(s) for s in bench["samples"]]
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CLIError(
            f"--from {path}: a sample in it is malformed; run `stoker bench … --json` again"
        ) from None
    if not any(s.ok for s in samples):
        raise CLIError(
            f"--from {path}: no request in it was answered ({len(samples)} sent); nothing to plan from"
        )
    return bench, samples


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        redundancy = parse_redundancy(args.redundancy)
    except ValueError as exc:
        raise CLIError(f"--redundancy: {exc}") from None
    bench, samples = _read_bench(args.bench)
    measured = levels(samples)
    result = plan(
        measured,
        qps=args.qps,
        p99_ttft_s=args.p99_ttft,
        redundancy=redundancy,
        peak_qps=args.peak_qps,
        instances_per_device=args.instances_per_device,
        min_samples=args.min_samples,
    )
    name = bench.get("deployment", "NAME")
    command = (
        f"stoker deploy {name} --model {bench.get('model') or 'MODEL'}"
        + (f" --engine {bench['engine']}" if bench.get("engine") else "")
        + f" --target-concurrency {result.target_concurrency} --min-warm {result.min_warm} --max {result.max_instances}"
    )
    if args.json:
        print(json.dumps({**result.to_json(), "deployment": name, "deploy_command": command}))
        return 0
    warm = sum(lv.requests for lv in measured)
    print(
        f"from {args.bench}: {len(samples)} requests to {name}, {warm} answered warm; "
        f"plan for {args.qps:g} req/s at p99 TTFT ≤ {args.p99_ttft:g} s"
    )
    print("\n".join(explain(result, min_samples=args.min_samples)))
    print(f"deploy with: {command}")
    return 0
