"""Printing the tables, computing the ratios, drawing the optional PNG."""

from __future__ import annotations

import re
import statistics
from typing import Any

from .common import noisy_mark

TARGETS = {"gsync / floor": 1.10, "gsync / DDP": 0.60, "gsync 1 device / one process": 1.05}


def _fmt(value: float | None, spec: str = ".1f", missing: str = "-") -> str:
    if value is None or value != value:  # None or NaN
        return missing
    return format(value, spec)


def _spread(values: list[float]) -> str:
    """How per-repeat values spread: the quartiles of five or more (the middle half), else the least and the
    greatest, e.g. ``1.08-1.21``."""
    if len(values) < 2:
        return " ".join(f"{value:.2f}" for value in values)
    if len(values) < 5:
        return f"{min(values):.2f}-{max(values):.2f}"
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return f"{low:.2f}-{high:.2f}"


def print_header(results: dict[str, Any]) -> None:
    env = results["env"]
    print(f"gsync benchmark ({results['mode']} mode): torch {env.get('torch')}, {env.get('cpus')} CPUs, "
          f"torch default threads {env.get('torch_default_threads')}, python {env['python']}")
    dirty = env["gsync_dirty_files"]
    print(f"git {env['git_commit'][:12]}{' + uncommitted changes in ' + ', '.join(dirty) if dirty else ''}; "
          f"load average at start {_fmt(env['loadavg_start'][0], '.2f') if env['loadavg_start'] else '-'}")
    print("'other load' = cores used by processes outside the measurement during its timed window "
          "(should be ~0; more means noisy numbers)")
    if env.get("child_env"):
        print(f"measurement processes run with {env['child_env']}")


def _floor(configs: dict[str, Any]) -> tuple[str, float] | None:
    floors = [(k, configs[k]["median_ms"]) for k in ("floor_t1", "floor_inherit") if k in configs]
    return min(floors, key=lambda kv: kv[1]) if floors else None


def step_ratios(configs: dict[str, Any]) -> dict[str, float]:
    ratios: dict[str, float] = {}
    floor = _floor(configs)
    for key, name in (
        ("gsync", "gsync"),
        ("gsync_session", "gsync session.step"),
        ("gsync_shared", "gsync(one shared thread)"),
    ):
        if key not in configs:
            continue
        ms = configs[key]["median_ms"]
        if floor:
            ratios[f"{name} / floor"] = ms / floor[1]
        if "ddp" in configs:
            ratios[f"{name} / DDP"] = ms / configs["ddp"]["median_ms"]
        if "plain" in configs:
            ratios[f"{name} / one process"] = ms / configs["plain"]["median_ms"]
    if "gsync_1" in configs and "plain" in configs:
        # What gsync adds on one device, where there is nothing to synchronize.
        ratios["gsync 1 device / one process"] = configs["gsync_1"]["median_ms"] / configs["plain"]["median_ms"]
    if "gsync" in configs and "gsync_session" in configs:
        ratios["session.step loop / fit"] = configs["gsync_session"]["median_ms"] / configs["gsync"]["median_ms"]
    if "ddp" in configs and "plain" in configs:
        ratios["DDP / one process"] = configs["ddp"]["median_ms"] / configs["plain"]["median_ms"]
    if floor and "plain" in configs:
        ratios["floor / one process"] = floor[1] / configs["plain"]["median_ms"]
    return ratios


def print_step(step: dict[str, Any]) -> None:
    configs = step["configs"]
    print(f"\n== 1. step time: MLP 784-2048-2048-2048-10 (10.0M params), global batch 256, SGD momentum "
          f"({step['steps']} measured steps after {step['warmup']} warm-up, {step['repeats']} interleaved repeat(s)) ==")
    print(f"{'configuration':40} {'ms/step':>8} {'repeats (ms)':>22} {'CPU ms/step':>11} {'faults/step':>11} "
          f"{'other load':>10}")
    for key, c in configs.items():
        repeats = " ".join(f"{m:.1f}" for m in c["repeat_medians_ms"])
        flag = "*" if c["noisy"] else " "
        print(f"{c['label']:40} {c['median_ms']:7.1f}{flag} {repeats:>22} {_fmt(c['cpu_ms_per_step'], '11.0f')} "
              f"{_fmt(c['faults_per_step'], '11.0f')} {_fmt(c['other_load_cores'], '.2f'):>10}")
    print("(ms/step, CPU, faults, other load: median over the repeats that other processes did not disturb;\n"
          " * = every repeat was disturbed, numbers are unreliable. CPU ms and page faults are per step, all threads"
          " and processes of the configuration)")
    floor = _floor(configs)
    if floor:
        print(f"(floor = the faster floor row: {configs[floor[0]]['label']})")
    print("\nratio                                          value   target")
    for name, value in step["ratios"].items():
        target = TARGETS.get(re.sub(r"\(.*\)", "", name))
        verdict = "" if target is None else f"<= {target:.2f}  {'met' if value <= target else 'MISSED'}"
        print(f"  {name:42} {value:6.3f}   {verdict}")
    for key in ("gsync", "gsync_shared"):
        if key in configs:
            print_trace_analysis(configs[key]["label"], configs[key]["representative"], configs.get("floor_t1"))


def print_trace_analysis(label: str, run: dict[str, Any], floor: dict[str, Any] | None) -> None:
    stats = run["stats"]
    print(f"\n  trace of {label} (median repeat, {run['measured_steps']} steps): "
          f"{stats['buckets']} buckets {stats['bucket_sizes_mib']} MiB, "
          f"{stats['bucket_ready_messages_per_step']:.0f} BucketReady messages/step; "
          f"torch threads seen: workers {run['torch_threads_seen']['workers']}, comm {run['torch_threads_seen']['comm']}")
    floor_phases = floor["representative"]["phase_mean_us"] if floor else {}
    print(f"  {'phase':18} {'mean us':>9} {'per step':>6} {'total us/step':>13} {'floor(1 thr) mean us':>21}")
    for name, p in run["phases"].items():
        print(f"  {name:18} {p['mean_us']:9.0f} {p['count_per_step']:6.1f} {p['total_per_step_us']:13.0f} "
              f"{_fmt(floor_phases.get(name), '.0f'):>21}")
    o = run["overlap"]
    print(f"  all_reduce hidden behind backward: median {o['median_fraction']:.0%} per step "
          f"(mean {o['mean_fraction']:.0%}, pooled {o['pooled_fraction']:.0%})")
    cp = run["critical_path_us"]
    print("  critical path per step (us): " + ", ".join(f"{k} {v:.0f}" for k, v in cp.items()))
    print(f"  wall/steps of the whole timed fit incl. replica setup & teardown: {run['wall_ms_per_step_incl_fit_setup']:.1f} ms")


def print_memory(memory: dict[str, Any]) -> None:
    print("\n== 3. peak RSS (VmHWM), each configuration in its own fresh process ==")
    idle = memory.get("idle", {}).get("peak_rss_mib")
    procs = {"ddp": 2}
    print(f"{'configuration':40} {'processes':>9} {'peak RSS MiB':>12} {'above idle':>10}")
    for key, m in memory.items():
        n = procs.get(key, 1)
        above = None if idle is None else m["peak_rss_mib"] - n * idle
        print(f"{m['label']:40} {n:9d} {m['peak_rss_mib']:12.0f} {_fmt(above, '.0f'):>10}")
    print("(DDP: sum over both ranks; 'above idle' subtracts one idle python+torch process per process)")


def print_control(control: dict[str, Any]) -> None:
    default, per_param = control["gsync_default_buckets"], control["gsync_per_param_buckets"]
    threads = control.get("threads_no_sync")
    print("\n== 2. control-plane cost: 100 x Linear(8,8) (200 parameter tensors), batch 16 ==")
    print("  seq: the 2 replicas' work by hand in one plain thread (fwd/bwd each, grads averaged by hand, 2 optimizer\n"
          "  steps); handoff: the same work as jobs an asyncio loop hands to plain threads as gsync runs them\n"
          f"  ({(default or {}).get('device_threads', 'shared')} device threads and a communication thread), with "
          "nothing else (the design's floor).\n  Both run in gsync's process before and after each of its repeats")
    if threads is not None:
        floor_us = threads["step"]["median_ms"] * 1e3
        print(f"  2 threads, one replica each, no sync at all (floor; barrier per step): "
              f"{floor_us:.0f} us/step (other load {_fmt(threads.get('other_load_cores'), '.2f')})")
    print(f"  {'gsync 2 x cpu':25} {'us/step':>8} {'seq':>6} {'gsync/seq':>9} {'spread':>11} {'handoff/seq':>11} "
          f"{'gsync/handoff':>13} {'minus seq':>9} {'minus floor':>11} {'loop CPU us':>11} {'handoff loop':>12} {'msgs/step':>9} "
          f"{'dev x buckets':>13} {'fixed ms/fit':>12} {'other load':>10}")
    rows = []
    for name, r in (("default buckets", default), ("one bucket per parameter", per_param)):
        if r is None:
            continue
        extra = r["minus_sequential_us_per_step"]
        rows.append((r, extra))
        # The floor ran in its own process: this difference is only as good as the machine's drift allows.
        over_floor = r["us_per_step"] - threads["step"]["median_ms"] * 1e3 if threads is not None else None
        print(f"  {name:25} {r['us_per_step']:7.0f}{noisy_mark(r)} {r['sequential_us_per_step']:6.0f} "
              f"{r['ratio_to_sequential']:9.2f} {_spread(r['all_ratios_to_sequential']):>11} "
              f"{_fmt(r.get('handoff_ratio_to_sequential'), '.2f'):>11} {_fmt(r.get('ratio_to_handoff'), '.2f'):>13} "
              f"{extra:9.0f} {_fmt(over_floor, '.0f'):>11} "
              f"{_fmt(r.get('loop_cpu_us_per_step'), '.0f'):>11} {_fmt(r.get('handoff_loop_cpu_us_per_step'), '.0f'):>12} "
              f"{r['messages_per_step']:9.0f} "
              f"{r['devices']} x {r['buckets']:<9} {r['fixed_ms_per_fit']:12.1f} {_fmt(r.get('other_load_cores'), '.2f'):>10}")
    if len(rows) == 2 and rows[1][0]["buckets"] != rows[0][0]["buckets"]:
        (a, ea), (b, eb) = rows
        per_bucket = (eb - ea) / (b["buckets"] - a["buckets"])
        print(f"  => each extra bucket costs ~{per_bucket:.0f} us/step "
              f"({per_bucket / a['devices']:.0f} us per BucketReady message, incl. its share of the reduction launch)")
    print("  (ratios and minus seq: medians over repeats of each repeat against the mean of a baseline's runs around\n"
          "   it; spread: the quartiles of gsync/seq over repeats, or the least and greatest of fewer than 5.\n"
          "   gsync/handoff is what gsync's own machinery (messages, mailboxes, buckets, timeouts) costs; handoff/seq\n"
          "   what the design's hand-offs cost. loop CPU = CPU time of the event-loop thread per step (handoff loop:\n"
          "   the floor's); in one process it holds the GIL the device threads need, so it adds to the step time\n"
          "   almost one for one)")


CONTROL8_TARGETS = {"gsync8 / sequential (one bucket)": 1.5, "loop CPU us per BucketReady": 20.0}


def control8_ratios(control8: dict[str, Any]) -> dict[str, float]:
    """gsync / sequential for each bucket layout, and the loop CPU, wall time and wake-ups per extra message."""
    one, per = control8.get("one_bucket"), control8.get("per_tensor")
    threads = control8.get("threads")
    ratios: dict[str, float] = {}
    if threads is not None and one is not None:
        # The plain threads ran in their own process, so this ratio is not paired as gsync's are.
        ratios["8 plain threads, no sync / sequential (unpaired)"] = (
            threads["step"]["median_ms"] * 1e3 / one["sequential_us_per_step"]
        )
    for name, r in (
        ("one bucket", one),
        ("one bucket, a thread per device", control8.get("one_bucket_per_device")),
        ("one bucket per tensor", per),
    ):
        if r is not None:
            ratios[f"gsync8 / sequential ({name})"] = r["ratio_to_sequential"]
    if one is not None and threads is not None:
        ratios["gsync8 / 8 plain threads (one bucket)"] = one["us_per_step"] / (threads["step"]["median_ms"] * 1e3)
    if one is not None and per is not None and per["messages_per_step"] > one["messages_per_step"]:
        extra = per["messages_per_step"] - one["messages_per_step"]
        ratios["loop CPU us per BucketReady"] = (per["loop_cpu_us_per_step"] - one["loop_cpu_us_per_step"]) / extra
        ratios["wall us per BucketReady"] = (per["us_per_step"] - one["us_per_step"]) / extra
        ratios["loop wake-ups per extra BucketReady"] = (per["loop_wakeups_per_step"] - one["loop_wakeups_per_step"]) / extra
        ratios["loop wake-ups per extra bucket"] = (
            (per["loop_wakeups_per_step"] - one["loop_wakeups_per_step"]) / (per["buckets"] - one["buckets"])
        )
    return ratios


def print_control8(control8: dict[str, Any]) -> None:
    rows = [
        (name, control8.get(key))
        for key, name in (
            ("one_bucket", "one bucket"),
            ("one_bucket_per_device", "one bucket, thread/device"),
            ("per_tensor", "one bucket per tensor"),
        )
    ]
    params = next((r["params"] for _, r in rows if r is not None), None)
    print(f"\n== 2b. control plane at 8 devices: {_fmt(params, 'd')} parameter tensors (Linear(8,8)), batch 16 ==")
    print("  seq: the 8 replicas' work by hand in one plain thread (fwd/bwd each, grads averaged by hand, 8 optimizer\n"
          "  steps); handoff: the same jobs handed out by an asyncio loop to plain threads as each row's gsync runs them\n"
          "  (its device threads and a communication thread: the design's floor);\n"
          "  both measured in each gsync row's process before and after each of its repeats")
    threads = control8.get("threads")
    if threads is not None:
        print(f"  8 plain threads, one replica each, no synchronization at all (the cost of a thread per device): "
              f"{threads['step']['median_ms']:.2f} ms/step{noisy_mark(threads)} "
              f"(other load {_fmt(threads.get('other_load_cores'), '.2f')})")
    print(f"  {'gsync 8 x cpu':25} {'ms/step':>8} {'seq ms':>6} {'vs seq':>6} {'spread':>11} {'handoff/seq':>11} "
          f"{'gsync/handoff':>13} {'loop CPU ms':>11} "
          f"{'buckets':>7} {'BucketReady':>11} {'thread posts':>12} {'loop iters':>10} {'wake-ups':>8} {'other load':>10}")
    for name, r in rows:
        if r is None:
            continue
        print(f"  {name:25} {r['us_per_step'] / 1e3:7.2f}{noisy_mark(r)} {r['sequential_us_per_step'] / 1e3:6.2f} "
              f"{r['ratio_to_sequential']:6.2f} {_spread(r['all_ratios_to_sequential']):>11} "
              f"{_fmt(r.get('handoff_ratio_to_sequential'), '.2f'):>11} {_fmt(r.get('ratio_to_handoff'), '.2f'):>13} "
              f"{r['loop_cpu_us_per_step'] / 1e3:11.2f} {r['buckets']:7d} {r['messages_per_step']:11.0f} "
              f"{r['thread_posts_per_step']:12.0f} {r['loop_iterations_per_step']:10.0f} {r['loop_wakeups_per_step']:8.0f} "
              f"{_fmt(r.get('other_load_cores'), '.2f'):>10}")
    for name, value in control8.get("ratios", {}).items():
        target = CONTROL8_TARGETS.get(name)
        verdict = "" if target is None else f"   (target <= {target:g}: {'met' if value <= target else 'MISSED'})"
        print(f"  {name:40} {value:8.2f}{verdict}")
    print("  (per step, from a long fit minus a short one; spread: of the repeats' ratios to seq, as in section 2.\n"
          "   loop CPU: the event-loop thread's CPU time; thread posts:\n"
          "   callbacks gsync's threads scheduled on the loop; loop iters: selector polls; wake-ups: polls that could\n"
          "   block, i.e. the loop slept and a thread or timer woke it. Target: wake-ups O(buckets), not O(devices x buckets))")


def print_sweeps(sweeps: dict[str, Any]) -> None:
    print("\n== 4a. gsync step time vs bucket_cap_mb (2 devices, reference MLP) ==")
    print(f"  {'cap MiB':>7} {'buckets':>7} {'ms/step':>8} {'all_reduce us/step':>18} {'hidden':>6} "
          f"{'exposed reduce us':>17} {'other load':>10}")
    for cap, r in sweeps["bucket_cap_mb"].items():
        ar = r["phases"].get("all_reduce", {}).get("total_per_step_us")
        print(f"  {float(cap):7g} {r['stats']['buckets']:7d} {r['step']['median_ms']:7.1f}{noisy_mark(r)} {_fmt(ar, '.0f'):>18} "
              f"{_fmt(r['overlap']['median_fraction'], '.0%'):>6} {r['critical_path_us'].get('exposed_reduce', 0):17.0f} "
              f"{_fmt(r.get('other_load_cores'), '.2f'):>10}")
    print("\n== 4b. gsync step time vs device count (global batch 256 split across devices) ==")
    base = sweeps["devices"].get("1", {}).get("step", {}).get("median_ms")
    print(f"  {'devices':>7} {'ms/step':>8} {'vs 1 dev':>8} {'CPU ms/step':>11} {'all_reduce us/step':>18} "
          f"{'slowest dev fwd+bwd+opt us':>26} {'OS threads':>10} {'other load':>10}")
    for count, r in sweeps["devices"].items():
        ar = r["phases"].get("all_reduce", {}).get("total_per_step_us")
        compute = r["critical_path_us"].get("compute")
        ratio = r["step"]["median_ms"] / base if base else None
        print(f"  {count:>7} {r['step']['median_ms']:7.1f}{noisy_mark(r)} {_fmt(ratio, '.2f'):>8} {_fmt(r['cpu_ms_per_step'], '.0f'):>11} "
              f"{_fmt(ar, '.0f'):>18} {_fmt(compute, '.0f'):>26} {r['max_os_threads']:>10} "
              f"{_fmt(r.get('other_load_cores'), '.2f'):>10}")


def print_checkpoint(checkpoint: dict[str, Any]) -> None:
    print("\n== checkpoints: fit(checkpoint_dir=..., checkpoint_every=N), reference MLP, 2 CPU devices ==")
    base = checkpoint.get("none")
    print(f"{'checkpoint_every':18} {'ms/step (median)':>16} {'mean ms/step':>13} {'vs none':>8} {'file MiB':>9}")
    for key, label in (("none", "never"), ("every_50", "50"), ("every_1", "1")):
        run = checkpoint.get(key)
        if run is None:
            continue
        ratio = run["wall_ms_per_step_incl_fit_setup"] / base["wall_ms_per_step_incl_fit_setup"] if base else float("nan")
        size = run.get("checkpoint_mib")
        print(f"{label:18} {run['step']['median_ms']:16.1f} {run['wall_ms_per_step_incl_fit_setup']:13.1f} "
              f"{ratio:8.3f} {_fmt(size, '9.1f')}")
    print("(mean ms/step = wall time of the whole fit / steps, so a write every 50 steps shows up in it; the median "
          "of the per-step periods does not)")


def print_ablation(ablation: dict[str, Any]) -> None:
    print("\n== 5. ablation: the 2-replica floor (2 threads x 1 torch thread, NO sync) with gsync's gradient handling ==")
    base = ablation.get("fresh", {}).get("median_ms")
    print(f"  {'gradients':48} {'ms/step':>8} {'repeats (ms)':>17} {'vs plain':>8} {'zero us':>7} {'fwd us':>7} "
          f"{'bwd us':>7} {'opt us':>7} {'faults/step':>11} {'other load':>10}")
    for key, a in ablation.items():
        ph = a["phase_mean_us"]
        delta = a["median_ms"] - base if base else None
        repeats = " ".join(f"{m:.1f}" for m in a.get("repeat_medians_ms", []))
        print(f"  {a['label']:48} {a['median_ms']:7.1f}{noisy_mark(a)} {repeats:>17} {_fmt(delta, '+.1f'):>8} "
              f"{ph['zero_grad']:7.0f} {ph['forward']:7.0f} {ph['backward']:7.0f} {ph['optimizer']:7.0f} "
              f"{_fmt(a.get('faults_per_step'), '.0f'):>11} {_fmt(a['other_load_cores'], '.2f'):>10}")
    print("  (the difference between the first two rows is what gsync pays for keeping .grad as bucket views that\n"
          "   are zeroed every step and accumulated into, before any reduction)")


def print_compression(compression: dict[str, Any]) -> None:
    print("\n== gsync and DDP across 2 processes x 1 torch thread (gloo), reference MLP, batch 256 ==")
    print(f"  {'configuration':42} {'ms/step':>8} {'repeats (ms)':>17} {'vs uncompressed':>15} {'vs DDP':>7} "
          f"{'MiB reduced/step':>16} {'other load':>10}")
    for key, c in compression.items():
        engine = key.split("_")[0]
        plain = compression.get(engine, {}).get("median_ms")
        ddp = compression.get(key.replace("gsync", "ddp"), {}).get("median_ms") if engine == "gsync" else None
        nbytes = c.get("reduced_bytes_per_step")
        repeats = " ".join(f"{m:.1f}" for m in c["repeat_medians_ms"])
        print(f"  {c['label']:42} {c['median_ms']:7.1f}{noisy_mark(c)} {repeats:>17} "
              f"{_fmt(c['median_ms'] / plain if plain and key != engine else None, '.3f'):>15} "
              f"{_fmt(c['median_ms'] / ddp if ddp else None, '.3f'):>7} "
              f"{_fmt(nbytes / 2**20 if nbytes else None, '.1f'):>16} {_fmt(c['other_load_cores'], '.2f'):>10}")
    print("  (MiB reduced/step: bytes per rank handed to the group's all-reduce, gsync's FitStats.reduced_bytes;\n"
          "   DDP's hook casts the same buckets the same way)")


def plot(sweeps: dict[str, Any], path: str, step: dict[str, Any] | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib, or the bench extra)")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    caps = sorted(sweeps["bucket_cap_mb"].items(), key=lambda kv: float(kv[0]))
    if caps:
        left.plot([float(c) for c, _ in caps], [r["step"]["median_ms"] for _, r in caps], marker="o")
        left.set_xscale("log")
    left.set(xlabel="bucket_cap_mb", ylabel="ms / step (median)", title="gsync, 2 CPU devices")
    devices = sorted(sweeps["devices"].items(), key=lambda kv: int(kv[0]))
    if devices:
        right.plot([int(c) for c, _ in devices], [r["step"]["median_ms"] for _, r in devices], marker="o")
        right.set_xticks([int(c) for c, _ in devices])
    right.set(xlabel="CPU devices", ylabel="ms / step (median)", title="gsync, global batch 256")
    references = []
    if step is not None:
        configs = step["configs"]
        floor = _floor(configs)
        if "plain" in configs:
            references.append((configs["plain"]["median_ms"], "one process", "tab:green"))
        if floor:
            references.append((floor[1], "2-replica floor", "tab:gray"))
        if "ddp" in configs:
            references.append((configs["ddp"]["median_ms"], "DDP gloo x2", "tab:red"))
    for axis in (left, right):
        for value, label, color in references:
            axis.axhline(value, linestyle="--", color=color, linewidth=1, label=label)
        if references:
            axis.legend(fontsize=8, loc="lower right")
        axis.grid(alpha=0.3)
        axis.set_ylim(bottom=0)
    fig.suptitle("MLP 784-2048-2048-2048-10, SGD momentum")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")
