"""The chronometer's report: its figures from the recorded timings (`step_figures`, `validation_figures`,
`flops_figures`, `energy_figures`, which `Chronometer.summary` puts in one dict), the lines it prints, its advice
when data loading holds the step back, and the per-step timeline plot (`python dlojz_chrono.py plot TRACE.json -o
timeline.png`). The timing itself is dlojz_lib/observers/chrono.py's. No torch here.
"""

import json
from pathlib import Path

import numpy as np

from dlojz_lib.checks import OneLineArgumentParser, command, is_png_drawn_by

# Loading is "significant" above this share of the compute step: then the report prints one line of advice.
LOAD_ADVICE_THRESHOLD = 0.05


def slowest_rank(gathered):
    """The rank whose median load phase was the longest, among several gathered (None for one rank)."""
    if not gathered or len(gathered) < 2:
        return None
    candidates = [r for r in gathered if r.get("load_median_s") is not None]
    return max(candidates, key=lambda r: r["load_median_s"]) if candidates else None


def step_figures(loads, forwards, backwards, steps, n_steps, warmup_steps, slowest, ctx) -> dict:
    """Step, load, forward and backward figures from the measured (post warm-up) seconds of each phase (NaN where a
    step had no such phase), the throughput, and the advice when loading holds the step back. `slowest`: the
    gathered record of the rank that loads slowest (None on one rank): it sets the pace of DDP, the advice is
    judged on it."""
    out = dict(steps=n_steps, measured_steps=len(steps), warmup_excluded=n_steps > warmup_steps)
    step_med, load_med = float(np.median(steps)), None
    out.update(step_min_s=float(np.min(steps)), step_median_s=step_med, step_std_s=float(np.std(steps)))
    if not np.all(np.isnan(loads)):
        load_med = float(np.nanmedian(loads))
        out.update(load_min_s=float(np.nanmin(loads)), load_median_s=load_med, load_std_s=float(np.nanstd(loads)))
    if not np.all(np.isnan(forwards)):
        fwd_med, bwd_med = float(np.nanmedian(forwards)), float(np.median(backwards))
        out.update(forward_median_s=fwd_med, backward_median_s=bwd_med)
        if step_med > 0:
            out.update(forward_share=fwd_med / step_med, backward_share=bwd_med / step_med)
    batch = ctx.get("images_per_step")
    if batch and step_med > 0:
        out["throughput_img_s"] = batch / (step_med + (load_med or 0.0))
        out["compute_throughput_img_s"] = batch / step_med
    if slowest is not None:
        out["slowest_rank"] = slowest["rank"]
        out["slowest_rank_load_median_s"] = slowest["load_median_s"]
    known_loads = [x for x in (load_med, out.get("slowest_rank_load_median_s")) if x is not None]
    worst_load = max(known_loads) if known_loads else None
    if worst_load is not None and step_med > 0:
        out["load_share"] = worst_load / step_med
        if worst_load > LOAD_ADVICE_THRESHOLD * step_med:
            out["advice"] = loading_advice(worst_load, step_med, ctx)
    return out


def validation_figures(val_time, step_med, load_med, ctx) -> dict:
    """The last validation's time (and the full validation's, estimated, when --test validated a part), and an
    epoch's estimated time: its steps at the median step and load, plus a full validation."""
    out, full_val = {}, 0.0
    if val_time is not None:
        out["val_time_s"] = full_val = val_time
        done, total = ctx.get("val_batches_done"), ctx.get("val_batches_total")
        if done and total:
            full_val = val_time / done * total
            if done != total:
                out["val_full_estimate_s"] = full_val
    if step_med is not None and ctx.get("steps_per_epoch"):
        out["epoch_time_estimate_s"] = ctx["steps_per_epoch"] * (step_med + (load_med or 0.0)) + full_val
    return out


def unsync_figures(records, synced_steps, ctx) -> dict:
    """The unsynchronised window's throughput: its steps' images over its seconds, the slowest rank's (every rank
    waits for it at each gradient all-reduce); the window's step count, or why there is none."""
    out = {}
    batch = ctx.get("images_per_step")
    windows = [r.get("window_s") for r in records]
    n_steps = records[0].get("window_steps") or 0
    if synced_steps is not None:
        out["unsync_window_steps"] = n_steps
    if batch and n_steps and all(w for w in windows):
        out["unsync_throughput_img_s"] = n_steps * batch / max(windows)
    return out


def flops_figures(throughput, peak, ctx) -> dict:
    """Achieved FLOP/s at `throughput` images/s, and the MFU against `peak` FLOP/s per GPU (None: unknown GPU)."""
    out, flops = {}, ctx.get("train_flops_per_image")
    if flops and throughput is not None:
        out.update(train_flops_per_image=float(flops), achieved_flops=flops * throughput)
        if peak:
            out.update(peak_flops_per_gpu=peak, mfu=out["achieved_flops"] / (peak * (ctx.get("world_size") or 1)))
    if ctx.get("peak_memory_bytes") is not None:
        out["peak_memory_bytes"] = int(ctx["peak_memory_bytes"])
    return out


def energy_figures(records, gathered, ctx) -> dict:
    """Peak power, J per image and energy per epoch from the ranks' `records`: summed over ranks when `gathered`,
    else one rank's times the world size."""
    out = {}
    powers = [r["peak_power_w"] for r in records if r.get("peak_power_w") is not None]
    if powers:
        out["peak_power_w"] = max(powers)
    energies = [r["train_energy_j"] for r in records]
    batch = ctx.get("images_per_step")
    n_steps = records[0].get("energy_steps") or 0
    if batch and n_steps and all(e is not None for e in energies):
        scale = 1 if gathered else (ctx.get("world_size") or 1)
        train_j = sum(energies) * scale
        out["train_energy_j"] = train_j
        out["energy_per_image_j"] = train_j / (n_steps * batch)
        if ctx.get("steps_per_epoch"):
            epoch_j = out["energy_per_image_j"] * ctx["steps_per_epoch"] * batch
            val_energies = [r["val_energy_j"] for r in records]
            if all(e is not None for e in val_energies):
                done, total = ctx.get("val_batches_done"), ctx.get("val_batches_total")
                val_j = sum(val_energies) * scale
                epoch_j += val_j / done * total if done and total else val_j
            out["epoch_energy_estimate_j"] = epoch_j
    return out


def window_energy_figures(records, gathered, ctx) -> dict:
    """Each energy window's mean power per GPU, and the unsynchronised window's J per image: the joules drawn over
    the very steps and seconds its img/s is measured on (validations taken out of both), so that the two figures
    multiply into a power the GPU drew; the GPU's enforced power limit (the lowest rank's), where NVML gives it."""
    out = {}
    limits = [r["power_limit_w"] for r in records if r.get("power_limit_w")]
    if limits:
        out["power_limit_w"] = min(limits)
    spans = [(r.get("train_energy_j"), r.get("energy_window_s")) for r in records]
    if all(j is not None and s for j, s in spans):
        out["train_mean_power_w"] = sum(j / s for j, s in spans) / len(spans)
    unsync = [(r.get("unsync_energy_j"), r.get("window_s")) for r in records]
    batch, n_steps = ctx.get("images_per_step"), records[0].get("window_steps") or 0
    if batch and n_steps and all(j is not None and s for j, s in unsync):
        scale = 1 if gathered else (ctx.get("world_size") or 1)
        out["unsync_energy_j"] = sum(j for j, _ in unsync) * scale
        out["unsync_energy_per_image_j"] = out["unsync_energy_j"] / (n_steps * batch)
        out["unsync_mean_power_w"] = sum(j / s for j, s in unsync) / len(unsync)
    return out


def over_power_limit(s: dict, world_size: int) -> list:
    """The (J/image, img/s) pairs of summary `s` whose product, per GPU, exceeds the GPU's enforced power limit: a
    pair not measured over one window (a J/image printed beside another window's img/s), or a meter that is wrong.
    Each as {"window": name, "watts": watts}."""
    limit = s.get("power_limit_w")
    if not limit:
        return []
    pairs = (
        ("synchronised", "energy_per_image_j", "throughput_img_s"),
        ("unsynchronised", "unsync_energy_per_image_j", "unsync_throughput_img_s"),
    )
    flagged = []
    for name, j_key, img_key in pairs:
        if s.get(j_key) is not None and s.get(img_key) is not None:
            watts = s[j_key] * s[img_key] / max(world_size, 1)
            if watts > limit:
                flagged.append({"window": name, "watts": watts})
    return flagged


def unsync_energy_cell(s: dict) -> str:
    """A table's energy cell for summary `s`'s unsynchronised throughput: its J per image and mean power, from that
    throughput's own window, flagged when the pair exceeds the GPU's power limit; "n/a" without NVML."""
    if s.get("unsync_energy_per_image_j") is None:
        return "n/a"
    cell = f"{s['unsync_energy_per_image_j']:.3f} ({s['unsync_mean_power_w']:.0f} W)"
    for flagged in s.get("over_power_limit", ()):
        if flagged["window"] == "unsynchronised":
            cell += f" over the {s['power_limit_w']:.0f} W limit"
    return cell


def report_lines(s: dict, warmup_steps: int, per_step=None) -> list:
    """The report's lines from a summary `s` (Chronometer.summary), in the course's order; a line whose figures
    are unknown is left out. `per_step`: (step seconds, load seconds or None) of every step, for the course's
    JSON line."""
    return step_lines(s, warmup_steps) + cost_lines(s, per_step)


def step_lines(s: dict, warmup_steps: int) -> list:
    """The report's first half, one branch per line in the order it prints: where a step's time goes, and the
    advice."""
    lines = []
    if "total_time_s" in s:
        line = f"=>>> Training complete in: {_fmt_duration(s['total_time_s'])}"
        if "time_to_first_step_s" in s:
            line += f" (time to first step: {s['time_to_first_step_s']:.2f} s)"
        lines.append(line)
    if "step_median_s" in s:
        note = (
            f"warm-up: first {warmup_steps} steps skipped"
            if s["warmup_excluded"]
            else f"only {s['steps']} steps: only the first skipped"
        )
        lines.append(
            f"=>>> Step time (forward+backward): min {_ms(s['step_min_s'])} median "
            f"{_ms(s['step_median_s'])} +/- {_ms(s['step_std_s'])} over {s['measured_steps']} steps "
            f"({note})"
        )
    if "load_median_s" in s:
        lines.append(
            f"=>>> Load time (DataLoader + host->device): min {_ms(s['load_min_s'])} median "
            f"{_ms(s['load_median_s'])} +/- {_ms(s['load_std_s'])}"
        )
    if "forward_median_s" in s:
        shares = f" ({s['forward_share']:.0%} / {s['backward_share']:.0%} of the step)" if "forward_share" in s else ""
        lines.append(
            f"=>>> Forward median {_ms(s['forward_median_s'])}, backward median {_ms(s['backward_median_s'])}{shares}"
        )
    if "teacher_median_s" in s:
        lines.append(
            f"=>>> Teacher's forward median {_ms(s['teacher_median_s'])} ({s['teacher_share']:.0%} of the step): the "
            "distillation's cost"
        )
    if "throughput_img_s" in s:
        lines.append(
            f"=>>> Throughput: {s['throughput_img_s']:.1f} images/s (global batch / (step + load)); "
            f"compute throughput: {s['compute_throughput_img_s']:.1f} images/s (global batch / step)"
        )
    if "unsync_throughput_img_s" in s:
        lines.append(
            f"=>>> Throughput, unsynchronised: {s['unsync_throughput_img_s']:.1f} images/s over the last "
            f"{s['unsync_window_steps']} steps (wall clock, the device waited for at their start and end only: the "
            "figure to compare with MLPerf's)"
        )
    elif "unsync_window_steps" in s:
        lines.append(
            "=>>> Throughput, unsynchronised: not measured (no step after the chronometer's): the figure above "
            "waits for the device at each phase; give more --test-nsteps than --test-unsync-steps"
        )
    if "load_share" in s:
        line = f"=>>> Data loading: {s['load_share']:.1%} of the step"
        if "slowest_rank" in s:
            line += f" (slowest rank {s['slowest_rank']}: load median {_ms(s['slowest_rank_load_median_s'])})"
        lines.append(line)
    if "advice" in s:
        lines.append(f"=>>> Advice: {s['advice']}")
    return lines


def cost_lines(s: dict, per_step=None) -> list:
    """The report's second half, one branch per line in the order it prints: validation, the epoch's estimate, FLOP/s,
    memory, power and energy, the course's JSON line, the trace."""
    lines = []
    if "val_time_s" in s:
        line = f"=>>> Validation time: {s['val_time_s']:.2f} s"
        if "val_full_estimate_s" in s:
            line += f" (estimate for the full validation set: {_fmt_duration(s['val_full_estimate_s'])})"
        lines.append(line)
    if "epoch_time_estimate_s" in s:
        lines.append(
            f"=>>> Estimated epoch time (full data set, with validation): {_fmt_duration(s['epoch_time_estimate_s'])}"
        )
    if "achieved_flops" in s:
        line = (
            f"=>>> Model FLOP/s: {_si(s['achieved_flops'], 'FLOP/s')} "
            f"({_si(s['train_flops_per_image'], 'FLOP')} per training image, forward + backward)"
        )
        if "mfu" in s:
            line += (
                f", model FLOPs utilisation {s['mfu']:.1%} of the {s['peak_flops_per_gpu'] / 1e12:.0f} "
                f"TFLOP/s peak per GPU"
            )
        lines.append(line)
    if "peak_memory_bytes" in s:
        lines.append(f"=>>> Peak memory: {s['peak_memory_bytes'] / 2**30:.2f} GiB ({s['peak_memory_bytes']} bytes)")
    if "peak_power_w" in s:
        lines.append(f"=>>> Peak power: {s['peak_power_w']:.0f} W")
    limit = f", the GPU's limit {s['power_limit_w']:.0f} W" if "power_limit_w" in s else ""
    if "energy_per_image_j" in s:
        line = f"=>>> Energy: {s['energy_per_image_j']:.3f} J per image over the synchronised steps"
        if "train_mean_power_w" in s:
            line += f" (mean power {s['train_mean_power_w']:.0f} W per GPU{limit})"
        if "epoch_energy_estimate_j" in s:
            line += f", {s['epoch_energy_estimate_j'] / 3600:.1f} Wh per epoch (estimate, all GPUs)"
        lines.append(line)
    if "unsync_energy_per_image_j" in s:
        lines.append(
            f"=>>> Energy, unsynchronised: {s['unsync_energy_per_image_j']:.3f} J per image over the unsynchronised "
            f"throughput's own window (mean power {s['unsync_mean_power_w']:.0f} W per GPU{limit})"
        )
    for flagged in s.get("over_power_limit", ()):
        lines.append(
            f"=>>> WARNING: the {flagged['window']} J per image x images/s is {flagged['watts']:.0f} W per GPU, over "
            f"the GPU's {s['power_limit_w']:.0f} W limit: the two are not from one window, or the meter is wrong"
        )
    if per_step is not None:
        # the course's line, rounded to the microsecond to stay readable (the trace file keeps full precision)
        steps = [round(x, 6) for x in per_step[0]]
        loads = [None if x is None else round(x, 6) for x in per_step[1]]
        lines.append(
            "=>>>JSON " + json.dumps({"GPU process - Forward/Backward": steps, "CPU process - Dataloader": loads})
        )
    if "trace_path" in s:
        lines.append(f"=>>> Trace written to {s['trace_path']}")
    return lines


def loading_advice(load_s: float, step_s: float, ctx: dict) -> str:
    """One line saying what to change when loading takes load_s against a step of step_s (ctx as in summary)."""
    head = f"data loading takes {load_s / step_s:.0%} of the step ({_ms(load_s)} vs {_ms(step_s)}): "
    workers, cpus = ctx.get("num_workers"), ctx.get("cpus_per_task")
    on_gpu = (ctx.get("device_name") or "cpu").lower() != "cpu"
    todo = []
    if workers is not None and cpus and workers < cpus:
        todo.append(f"raise --num-workers from {workers} (the task has {cpus} CPUs)")
    elif workers is not None and cpus and workers >= cpus:
        todo.append(
            f"the input pipeline is CPU-bound ({workers} workers for {cpus} CPUs): ask for more CPUs "
            f"per task, use a smaller --image-size, or faster decoding (pre-resized images, DALI)"
        )
    elif workers is not None:
        todo.append(f"raise --num-workers from {workers} (up to the CPUs per task)")
    else:
        todo.append("use more DataLoader workers (up to the CPUs per task)")
    if on_gpu and ctx.get("pin_memory") is False:
        todo.append("turn on --pin-memory")
    if ctx.get("persistent_workers") is False and workers:
        todo.append("turn on --persistent-workers")
    return head + "; ".join(todo)


def plot_trace(trace, png_path) -> None:
    """Per-step stacked bars (load, forward, backward) with the medians marked; warm-up steps shaded. `trace`: the
    trace as read_trace returns it, or its file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = trace if isinstance(trace, dict) else read_trace(trace)
    loads = np.array([np.nan if x is None else x for x in trace["load_s"]], dtype=float) * 1e3
    forwards = np.array([np.nan if x is None else x for x in trace["forward_s"]], dtype=float) * 1e3
    backwards = np.array(trace["backward_s"], dtype=float) * 1e3
    steps_ms = np.array(trace["step_s"], dtype=float) * 1e3
    warmup = trace.get("warmup_steps", 0)
    x = np.arange(1, len(backwards) + 1)
    loads0, forwards0 = np.nan_to_num(loads), np.nan_to_num(forwards)

    fig, ax = plt.subplots(figsize=(max(6.0, min(20.0, 0.15 * len(x) + 4)), 4.5))
    ax.bar(x, loads0, color="tab:orange", label="load (DataLoader + H2D)")
    ax.bar(x, forwards0, bottom=loads0, color="tab:blue", label="forward")
    ax.bar(x, backwards, bottom=loads0 + forwards0, color="tab:green", label="backward")
    measured = slice(warmup, None) if len(x) > warmup else slice(None)
    if len(x):
        # Bars stack load under compute, so the compute median is drawn on top of the load median.
        step_med = np.median(steps_ms[measured])
        load_med = 0.0 if np.all(np.isnan(loads[measured])) else np.nanmedian(loads[measured])
        if load_med > 0:
            ax.axhline(load_med, color="tab:orange", ls="--", label=f"median load {load_med:.2f} ms")
        ax.axhline(load_med + step_med, color="black", ls="--", label=f"median load + median step ({step_med:.2f} ms)")
    if 0 < warmup < len(x):
        ax.axvspan(0.5, warmup + 0.5, color="grey", alpha=0.15, label="warm-up (not in medians)")
    ax.set_xlabel("training step")
    ax.set_ylabel("time (ms)")
    ax.set_title("dlojz: per-step load vs compute")
    ax.legend(fontsize="small", loc="upper right")
    fig.tight_layout()
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100, metadata={"Software": PLOT_SOFTWARE})  # (is_timeline_plot reads it)
    plt.close(fig)


PLOT_SOFTWARE = "dlojz_chrono.py plot"


def is_timeline_plot(path) -> bool:
    """Whether `path` is a PNG that `dlojz_chrono.py plot` drew (its Software entry)."""
    return is_png_drawn_by(path, PLOT_SOFTWARE)


@command("dlojz_chrono.py")
def main(argv=None):
    parser = OneLineArgumentParser(prog="dlojz_chrono.py", description="dlojz chronometer tools")
    sub = parser.add_subparsers(dest="command", required=True)
    plot = sub.add_parser("plot", help="draw the per-step timeline of a chronometer trace")
    plot.add_argument("trace", help="trace JSON written by Chronometer.write_trace")
    plot.add_argument("-o", "--output", default="timeline.png", help="PNG to write (default: timeline.png)")
    plot.add_argument("--force", action="store_true", help="replace -o even if this command did not draw it")
    args = parser.parse_args(argv)
    from dlojz_lib.checks import claim_output

    trace = read_trace(args.trace)
    claim_output(args.output, "-o/--output", "a timeline this command drew", is_timeline_plot, [args.trace], args.force)
    plot_trace(trace, args.output)
    print(f"timeline written to {args.output}")
    return 0


TRACE_LISTS = ("load_s", "forward_s", "backward_s", "step_s")  # per step, seconds (load and forward may be null)


def read_trace(path) -> dict:
    """A chronometer trace (Chronometer.write_trace's JSON); UserError naming the file if it is not one."""
    from dlojz_lib.checks import fail, read_json

    fix = "give the chrono_trace.json that a dlojz.py --test run writes in its output folder"
    trace = read_json(path, "trace", fix)
    lists = [trace.get(key) for key in TRACE_LISTS]
    if not all(isinstance(values, list) for values in lists) or len({len(values) for values in lists}) != 1:
        fail(
            f"trace {path}: not a chronometer trace (it needs the lists {', '.join(TRACE_LISTS)}, one value a step); {fix}"
        )
    for key, values in zip(TRACE_LISTS, lists):
        nullable = key in ("load_s", "forward_s")  # not measured at some steps
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) or (v is None and nullable) for v in values):
            fail(f"trace {path}: a value of {key} is not a number of seconds; {fix}")
    if not isinstance(trace.get("warmup_steps", 0), int):
        fail(f"trace {path}: warmup_steps is not a whole number; {fix}")
    return trace


def _si(value: float, unit: str) -> str:
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.2f} {unit}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs" if abs(seconds) < 1e-4 else f"{seconds * 1e3:.2f} ms"


def _fmt_duration(seconds: float) -> str:
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{seconds:.1f} s ({hours:d}:{minutes:02d}:{secs:04.1f})" if seconds >= 60 else f"{seconds:.2f} s"
