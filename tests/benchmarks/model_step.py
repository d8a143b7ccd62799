#!/usr/bin/env python
"""Do kprof's rows predict kernel times inside real decoder layers? One call on a GPU.

Builds N decoder layers (distinct weights, bf16, on the GPU) of Qwen2.5-7B and of Mixtral-8x7B (MoE, top-2
of 8 experts), written only with the public callables kprof's runners time (tests/benchmarks/_decoder.py),
so each op of a layer is one kprof spec. Per config and phase (decode at batch 1, 8, 64 against a 2,048-token
KV cache; prefill of 1x2,048 causal tokens), with CUPTI kernel records (kprof.measure._cupti.Session):

  discovery  one layer op by op, each op alone between synchronized timestamps: how many kernels each op
             launches and their names (eagerly; and for graph mode with each op captured as its own graph)
  eager      the whole model back to back, no sync inside, `--iters` forwards after warm-up (and after
             `--busy-s` seconds of forwards back to back, where given)
  graph      the whole model captured once as one CUDA graph (warmed up on a side stream, captured inside the
             CUPTI session) and replayed `--iters` times

Kernels are sorted by start and cut into layers by the per-layer kernel count; every position must carry the
discovered kernel name, or the pass fails with the first difference. An op's in-model time is the median,
over layers 1..N-1 (layer 0 reads the static model input, not a predecessor's output, so it is left out) and
iterations, of the sum of its kernels' (end - start). kprof's rows come from kprof.api.run(table, "torch",
specs, mode="jit") into a ledger under the output directory, with kprof's default method (CUPTI, cold L2,
eager) or, with --row-method graph, its CUDA-graph method. Each phase reads the rows of its power state: decode
phases sustained (the kernel back to back), prefill phases --prefill-power (default loaded: each call after
heavy GEMMs that hold the GPU at its power limit, as inside a prefill). The state is part of a row's key, so a
spec in a decode and a prefill phase has two rows.

Kernels with no kprof table (KV-cache write, residual adds, MoE routing, gather, combine, and any layout copy
SDPA or a reshape adds) are "uncovered": reported with their in-model time and share of the layer.

Each phase also records where the caching allocator put each covered op's activation in every layer of an eager
forward (`activation_mod_2mib`: its address modulo 2 MiB), since a decode kernel's time follows that address
(tests/benchmarks/address_check.py).

Targets: the per-layer sum of covered ops within 3 % of in-model for every config and phase; per-kernel
median |error| <= 3 %, max <= 8 %. Writes model_step.json (every raw sample) and the ledger as a tar.gz.

    python tests/benchmarks/model_step.py [--out DIR] [--layers 16] [--iters 10] [--quick]
           [--configs qwen2.5-7b,mixtral-8x7b] [--phases decode_b1,decode_b8,decode_b64,prefill_2048]
           [--row-method default|graph] [--prefill-power loaded|sustained] [--busy-s 0] [--db PATH]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import shutil
import statistics
import sys
import tarfile
import time
import traceback
from typing import NamedTuple

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # _decoder lives beside this file, however the script is started
    sys.path.insert(0, _HERE)
if importlib.util.find_spec("kprof") is None:  # run from a checkout without kprof installed
    sys.path.insert(1, os.path.dirname(os.path.dirname(_HERE)))

from _decoder import CONFIGS, END, PHASES, Config, Op, Phase, layer_ops  # noqa: E402  (no torch imported)

MODES = ("eager", "graph")
POWER_STATES = ("loaded", "sustained")  # --prefill-power's choices (kprof.runners.catalog.POWER_STATES)
TARGETS = {"layer": 0.03, "kernel_median": 0.03, "kernel_max": 0.08}
GRAPH_WARMUP = 3  # forwards on a side stream before any capture, as torch.cuda.graphs asks
# Seconds of back-to-back forwards right before each timed window (--busy-s), for asking whether a GPU woken
# from idle runs the timed forwards slower. On an H200 (2026-12-01, run 9) 0.5 s changed no decode layer by
# more than 0.4 points, and made prefill layers 2-5 % slower in-model (the GPU hotter, deeper into its power
# cap): a state between a cold start and continuous prefill, which the default (none) leaves to that flag.
BUSY_S = 0.0
QUICK = {"layers": 4, "iters": 3, "warmup": 2, "phases": ("decode_b1", "prefill_2048")}
LEDGER_TAR_MAX = 256 << 20  # a larger ledger stays as it is, beside the JSON
NOTES = [
    "Layers have no biases and no rotary embedding; q/k/v are views of the qkv GEMM output.",
    "Decode q is a view of the qkv output ([batch, heads, 1, head_dim] with the qkv row stride: contiguous only "
    "at batch 1); the row's q is contiguous.",
    "Decode writes the new token's k/v into the last slot of a 2,048-token cache (one strided copy, uncovered) "
    "and attends over the whole cache; prefill writes its k/v into the cache (one copy, uncovered) and attends "
    "over views of the qkv output (strided q/k/v where the row's are contiguous).",
    "Uncovered kernels also include the residual adds and, for MoE, routing (bias add, fp32 softmax, top-k, "
    "renormalization, stable sort, row->token division, scatter_add counts, int32 cumsum), the row gather and "
    "the weighted combine (index_copy, cast, multiply, sum). attn_out is a view unless SDPA returns another "
    "layout (then its copy is listed there).",
    "In-model medians leave out layer 0 (its input is the static model input, not a predecessor's output).",
    "Rows of decode phases are timed sustained (the kernel back to back, as in decode); rows of prefill phases in "
    "the power state plan.prefill_power names (loaded: each call after heavy GEMMs that hold the GPU at its power "
    "limit, as inside a prefill). Each phase's state is its 'power'; a spec in both kinds of phase has two rows.",
    "The MoE router adds a per-expert bias of std kprof.runners.moe.EXPERT_BIAS, as the rows' routing does.",
    "KPROF_ENERGY_S defaults to 0 here (energy is not compared; it saves ~0.5 s per row).",
]


# ----- kernel records -> ops (pure: tested on the CPU) ---------------------------------------------------

Kernel = tuple  # (name, start_ns, end_ns, correlation_id), as kprof.measure._cupti.Session.collect gives them


class KernelMismatch(Exception):
    """The kernels of a pass do not follow the discovered per-layer sequence: no op can be timed honestly."""


def _short(name: str, n: int = 90) -> str:
    return name if len(name) <= n else name[:n] + "..."


def launch_order(kernels) -> list[Kernel]:
    return sorted(kernels, key=lambda k: (k[1], k[2]))


def assign_windows(kernels, marks: list[tuple[str, int]]) -> dict[str, list[Kernel]]:
    """Kernels per op from a discovery pass. `marks` are (op, timestamp) taken after a synchronize before each
    op, the last one (END, t) after the layer; an op's kernels start and end between its mark and the next.
    Kernels outside [first mark, last mark] (earlier or later work) are left out; one that straddles two
    windows raises KernelMismatch (something else ran on the GPU)."""
    if len(marks) < 2:
        raise KernelMismatch(f"discovery needs a mark before each op and one after the layer, got {marks}")
    windows = list(zip(marks, marks[1:]))
    out: dict[str, list[Kernel]] = {op: [] for op, _t in marks[:-1]}
    for k in launch_order(kernels):
        if k[2] <= marks[0][1] or k[1] >= marks[-1][1]:
            continue
        for (op, t0), (_next, t1) in windows:
            if t0 <= k[1] and k[2] <= t1:
                out[op].append(k)
                break
        else:
            raise KernelMismatch(f"discovery: kernel {_short(k[0])!r} [{k[1]}, {k[2]}] ns is not inside one op's "
                                 f"window; is another process using this GPU?")
    return out


def sequence_of(found: dict[str, list[Kernel]], ops: list[str]) -> list[tuple[str, list[str]]]:
    """(op, kernel names) in layer order: the per-layer sequence a pass must repeat."""
    return [(op, [k[0] for k in found.get(op, [])]) for op in ops]


def split_layers(kernels, sequence: list[tuple[str, list[str]]], layers: int, iterations: int,
                 what: str) -> list[list[Kernel]]:
    """The kernels of `iterations` forwards of `layers` layers, in launch order, cut into one chunk per
    (iteration, layer); raises KernelMismatch naming the first position whose name differs from the
    sequence, or the counts when the names agree as far as they go."""
    names = [n for _op, ns in sequence for n in ns]
    owner = [op for op, ns in sequence for _n in ns]
    n = len(names)
    if n == 0:
        raise KernelMismatch(f"{what}: the discovered layer launched no kernel; is CUPTI tracing this device?")
    ks = launch_order(kernels)
    want = n * layers * iterations
    for i, k in enumerate(ks[:want]):
        if k[0] != names[i % n]:
            it, rest = divmod(i, n * layers)
            layer, pos = divmod(rest, n)
            raise KernelMismatch(
                f"{what}: kernel {i} (iteration {it}, layer {layer}, position {pos} of {n}, op {owner[pos]!r}) is "
                f"{_short(k[0])!r}; discovery found {_short(names[pos])!r} there. The layer's kernel sequence "
                f"changed between discovery and this pass (a library choosing another kernel or dropping a "
                f"split-K reduce)")
    if len(ks) != want:
        extra = f"; the first one past them is {_short(ks[want][0])!r}" if len(ks) > want else ""
        raise KernelMismatch(f"{what}: {len(ks)} kernels, expected {iterations} iterations x {layers} layers x {n} "
                             f"kernels = {want}{extra}")
    return [ks[i:i + n] for i in range(0, want, n)]


def overlaps(kernels) -> int:
    """How many kernels start before the previous one (in launch order) ends: each such kernel's (end - start)
    includes time spent waiting on its predecessor (programmatic dependent launch, or concurrent streams)."""
    ks = launch_order(kernels)
    return sum(b[1] < a[2] for a, b in zip(ks, ks[1:]))


def spans(chunks: list[list[Kernel]], layers: int, skip_first_layer: bool) -> list[float]:
    """µs from each kept layer chunk's first kernel start to its last kernel end: kernel time plus gaps."""
    return [(max(k[2] for k in c) - c[0][1]) / 1e3 for i, c in enumerate(chunks)
            if c and not (skip_first_layer and i % layers == 0)]


def op_samples(chunks: list[list[Kernel]], sequence: list[tuple[str, list[str]]], layers: int,
               skip_first_layer: bool) -> dict[str, list[float]]:
    """µs per op per (iteration, layer) chunk: the sum of its kernels' (end - start). Chunk i is layer
    i % layers; with skip_first_layer, layer 0's chunks are left out. Lists are aligned by chunk."""
    out: dict[str, list[float]] = {op: [] for op, _ns in sequence}
    for index, chunk in enumerate(chunks):
        if skip_first_layer and index % layers == 0:
            continue
        pos = 0
        for op, ns in sequence:
            out[op].append(sum(k[2] - k[1] for k in chunk[pos:pos + len(ns)]) / 1e3)
            pos += len(ns)
    return out


# ----- composition and verdicts (pure) -----------------------------------------------------------------

def rel(predicted: float | None, actual: float | None) -> float | None:
    """predicted / actual - 1, or None when either is missing."""
    if predicted is None or actual is None or actual <= 0:
        return None
    return predicted / actual - 1


def _median(xs) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


def by_layer(xs: list[float], layers: int) -> list[float]:
    """The median of each layer's samples, from µs per (iteration, layer) chunk in chunk order (layer i % layers)."""
    return [statistics.median(xs[i::layers]) for i in range(min(layers, len(xs)))]


def compose(ops: list[Op], samples: dict[str, dict[str, list[float]] | None],
            kprof_us: dict[str, float | None], layers: int | None = None) -> dict:
    """Per op and per layer: kprof's row against the in-model time of each mode in `samples` (op -> µs per
    (iteration, layer); None for a mode that failed). The layer's covered time and its uncovered time are
    medians of per-(iteration, layer) sums, not sums of medians. With `layers` (layers per iteration in the
    samples), each op also gets its per-layer medians' fastest, mean and slowest (`{mode}_layers_us`) and the row
    against the fastest layer (`err_{mode}_fastest_layer`): each layer's weights are their own allocation, and a
    memory-bound kernel's time moves with where its weights lie."""
    covered = [o.name for o in ops if o.table is not None]
    uncovered = [o.name for o in ops if o.table is None]
    out_ops: dict[str, dict] = {}
    for o in ops:
        e = {"table": o.table, "spec": o.spec, "covered": o.table is not None,
             "kprof_us": kprof_us.get(o.name) if o.table is not None else None}
        for mode in MODES:
            s = samples.get(mode)
            e[f"{mode}_us"] = _median(s[o.name]) if s else None
            e[f"err_{mode}"] = rel(e["kprof_us"], e[f"{mode}_us"])
            if s and layers and s[o.name]:
                per = by_layer(s[o.name], layers)
                e[f"{mode}_layers_us"] = {"fastest": min(per), "mean": statistics.fmean(per), "slowest": max(per)}
                e[f"err_{mode}_fastest_layer"] = rel(e["kprof_us"], min(per))
        e["eager_vs_graph"] = rel(e["eager_us"], e["graph_us"])
        out_ops[o.name] = e
    parts = [kprof_us.get(name) for name in covered]
    layer = {"kprof_us": sum(parts) if parts and None not in parts else None,
             "kprof_missing": [name for name, p in zip(covered, parts) if p is None]}
    unc: dict = {"ops": uncovered}
    for mode in MODES:
        s = samples.get(mode)
        if not s:
            layer[f"{mode}_us"] = layer[f"{mode}_total_us"] = unc[f"{mode}_us"] = unc[f"share_{mode}"] = None
            continue
        n = len(s[ops[0].name])
        cov = [sum(s[name][i] for name in covered) for i in range(n)]
        unc_i = [sum(s[name][i] for name in uncovered) for i in range(n)]
        layer[f"{mode}_us"] = _median(cov)
        layer[f"{mode}_total_us"] = _median(c + u for c, u in zip(cov, unc_i))
        unc[f"{mode}_us"] = _median(unc_i)
        unc[f"share_{mode}"] = _median(u / (c + u) for c, u in zip(cov, unc_i) if c + u > 0)
    for mode in MODES:
        # a covered op that ran no kernel time in the model leaves its row in the sum and nothing against it
        unmeasured = [name for name in covered if not (out_ops[name][f"{mode}_us"] or 0) > 0]
        layer[f"{mode}_unmeasured"] = unmeasured if samples.get(mode) else None
        layer[f"err_{mode}"] = None if unmeasured else rel(layer["kprof_us"], layer[f"{mode}_us"])
    layer["eager_vs_graph"] = rel(layer["eager_total_us"], layer["graph_total_us"])
    return {"ops": out_ops, "layer": layer, "uncovered": unc}


def verdicts(phases: list[dict], targets: dict = TARGETS) -> dict:
    """The targets, per in-model reference (eager, graph), over every composed phase. A missing number (a
    failed row or pass) fails the target it belongs to and is listed."""
    out: dict = {"targets": targets}
    for mode in MODES:
        layer_errs, missing, op_errs = [], [], []
        for p in phases:
            where = f"{p['config']} {p['phase']}"
            e = p.get("layer", {}).get(f"err_{mode}")
            if e is None:
                missing.append(f"{where} layer")
            else:
                layer_errs.append((where, e))
            for name, op in p.get("ops", {}).items():
                if not op["covered"]:
                    continue
                if op.get(f"err_{mode}") is None:
                    missing.append(f"{where} {name}")
                else:
                    op_errs.append((where, name, op["table"], op[f"err_{mode}"]))
        if not phases:
            missing.append("no phase ran")
        over_layer = [(w, e) for w, e in layer_errs if abs(e) > targets["layer"]]
        layers_missing = [m for m in missing if m.endswith(" layer")]
        med = _median(abs(e) for *_rest, e in op_errs)
        worst = max(op_errs, key=lambda r: abs(r[3]), default=None)
        families: dict[str, dict] = {}
        for where, name, table, e in op_errs:
            f = families.setdefault(name, {"tables": [], "errs": []})
            f["tables"].append(table)
            f["errs"].append((where, e))
        over = {}
        for name, f in families.items():
            errs = [abs(e) for _w, e in f["errs"]]
            fmed, fmax = statistics.median(errs), max(errs)
            if fmed > targets["kernel_median"] or fmax > targets["kernel_max"]:
                over[name] = {"table": table_label(f["tables"]), "median_abs": fmed, "max_abs": fmax,
                              "over_max_at": [f"{w}: {e:+.1%}" for w, e in f["errs"] if abs(e) > targets["kernel_max"]]}
        out[mode] = {
            "layer_pass": bool(layer_errs) and not over_layer and not layers_missing,
            "layer_within": f"{len(layer_errs) - len(over_layer)}/{len(layer_errs) + len(layers_missing)}",
            "layer_over": [{"where": w, "err": e} for w, e in over_layer],
            "kernel_median_abs": med,
            "kernel_median_pass": med is not None and med <= targets["kernel_median"] and not missing,
            "kernel_max_abs": abs(worst[3]) if worst else None,
            "kernel_max_where": f"{worst[0]} {worst[1]}" if worst else None,
            "kernel_max_pass": worst is not None and abs(worst[3]) <= targets["kernel_max"] and not missing,
            "families_over_target": over,
            "missing": missing,
        }
    out["eager_vs_graph"] = _agreement(phases)
    return out


def table_label(tables: list[str]) -> str:
    """The kprof tables of one op over phases: "attention_decode/prefill" where decode and prefill differ."""
    tables = list(dict.fromkeys(tables))
    common = os.path.commonprefix(tables)
    return tables[0] + "".join(f"/{t.removeprefix(common)}" for t in tables[1:])


def _agreement(phases: list[dict]) -> dict:
    """How far the two in-model references are apart: eager / graph - 1 of whole layers and of covered ops."""
    layers = [(f"{p['config']} {p['phase']}", p["layer"]["eager_vs_graph"]) for p in phases
              if p.get("layer", {}).get("eager_vs_graph") is not None]
    ops = [(f"{p['config']} {p['phase']} {n}", o["eager_vs_graph"]) for p in phases
           for n, o in p.get("ops", {}).items() if o["covered"] and o.get("eager_vs_graph") is not None]
    worst_layer = max(layers, key=lambda r: abs(r[1]), default=None)
    worst_op = max(ops, key=lambda r: abs(r[1]), default=None)
    return {"layer_max_abs": abs(worst_layer[1]) if worst_layer else None,
            "layer_max_where": worst_layer[0] if worst_layer else None,
            "op_median_abs": _median(abs(e) for _w, e in ops),
            "op_max_abs": abs(worst_op[1]) if worst_op else None,
            "op_max_where": worst_op[0] if worst_op else None}


# ----- the plan --------------------------------------------------------------------------------------

class Plan(NamedTuple):
    configs: list[Config]
    phases: list[Phase]
    layers: int
    iters: int
    warmup: int
    out: str
    db: str | None
    row_method: str
    quick: bool
    prefill_power: str = "loaded"
    busy_s: float = BUSY_S

    @property
    def skip_first_layer(self) -> bool:
        return self.layers > 1

    def power(self, ph: Phase) -> str:
        return phase_power(ph, self.prefill_power)


def phase_power(ph: Phase, prefill_power: str = "loaded") -> str:
    """The power state a phase's rows are timed and read in: decode sustained (kprof's default: the kernel back
    to back, as a decode step runs its small kernels), prefill `prefill_power` (loaded: the GPU held at its
    power limit by heavy GEMMs, as a prefill's own GEMMs hold it)."""
    return "sustained" if ph.kind == "decode" else prefill_power


def _names(value: str | None, known: dict, what: str, default) -> list:
    if not value:
        return [known[n] for n in default]
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown {what} {unknown or value!r}; choose from {', '.join(known)} (comma-separated)")
    return [known[n] for n in dict.fromkeys(names)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "model_step-out",
                   help="directory for model_step.json and the ledger (default $OUT, else ./model_step-out)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers per model (default 16; --quick 4)")
    p.add_argument("--iters", type=int, default=None, help="timed forwards per mode (default 10; --quick 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 layers, 3 iterations, decode_b1 and "
                   "prefill_2048 of every config")
    p.add_argument("--configs", default=None, help=f"comma-separated, of {', '.join(CONFIGS)} (default all)")
    p.add_argument("--phases", default=None, help=f"comma-separated, of {', '.join(PHASES)} (default all)")
    p.add_argument("--row-method", choices=("default", "graph"), default="default",
                   help="kprof's timing method for the rows: default (CUPTI, cold L2, eager) or graph "
                        "(api.run(..., cuda_graph=True))")
    p.add_argument("--prefill-power", choices=POWER_STATES, default="loaded",
                   help="power state of the prefill phases' rows: loaded (default: each call after heavy GEMMs "
                        "that hold the GPU at its power limit, as inside a prefill) or sustained (the kernel back "
                        "to back, as in decode); decode phases always read sustained rows")
    p.add_argument("--busy-s", type=float, default=None, help=f"seconds of back-to-back forwards right before "
                   f"each timed window (default {BUSY_S:g}: none)")
    p.add_argument("--db", default=None, help="ledger to fill and read (default: OUT/model_step.db, then packed "
                   "into model_step_ledger.tar.gz); an existing ledger's ok rows are reused")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    """Raises ValueError for a bad argument."""
    layers = args.layers if args.layers is not None else (QUICK["layers"] if args.quick else 16)
    iters = args.iters if args.iters is not None else (QUICK["iters"] if args.quick else 10)
    if layers < 1 or iters < 1:
        raise ValueError(f"--layers ({layers}) and --iters ({iters}) must be at least 1")
    if args.busy_s is not None and not 0 <= args.busy_s < math.inf:  # inf: forwards until the machine is taken back
        raise ValueError(f"--busy-s ({args.busy_s}) must be a finite number of seconds >= 0, e.g. --busy-s 0.5")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a file; name a directory for model_step.json and the ledger")
    if args.db:
        check_db(args.db)
    phases = _names(args.phases, PHASES, "phase", QUICK["phases"] if args.quick else list(PHASES))
    return Plan(_names(args.configs, CONFIGS, "config", list(CONFIGS)), phases, layers, iters,
                QUICK["warmup"] if args.quick else 3, args.out, args.db, args.row_method, args.quick,
                args.prefill_power, args.busy_s if args.busy_s is not None else BUSY_S)


def check_db(db: str) -> None:
    """Raises ValueError unless `db` is a kprof ledger, or a file kprof can create: refused before the GPU passes,
    not when their rows are filled minutes later."""
    from kprof.errors import KprofError
    from kprof.ledger import Ledger

    if not os.path.exists(db):
        if not os.path.isdir(os.path.dirname(os.path.abspath(db))):
            raise ValueError(f"--db {db}: its directory does not exist; create it, or name a ledger in one that does")
        return
    try:
        Ledger.open(db, readonly=True).close()
    except KprofError as e:
        raise ValueError(f"--db {db}: {e}") from None


RowKey = tuple  # (table, spec as sorted JSON, power state): one kprof row


def row_key(table: str, spec: dict, power: str) -> RowKey:
    return table, json.dumps(spec, sort_keys=True), power


def wanted_specs(cfg: Config, phases: list[Phase], prefill_power: str = "loaded") -> dict[tuple, list[dict]]:
    """The unique kprof specs of a config's layers over the phases, per (table, power state of the phase)."""
    out: dict[tuple, dict[RowKey, dict]] = {}
    for ph in phases:
        power = phase_power(ph, prefill_power)
        for o in layer_ops(cfg, ph):
            if o.table is not None:
                out.setdefault((o.table, power), {})[row_key(o.table, o.spec, power)] = o.spec
    return {group: list(specs.values()) for group, specs in out.items()}


# ----- kprof rows ------------------------------------------------------------------------------------

def _method_kwargs(row_method: str, run, power: str | None = None) -> tuple[dict, dict]:
    """(keyword arguments for api.run, environment to set around it) for the row method and power state. graph
    uses api.run(cuda_graph=True); a kprof whose api.run has no such argument gets KPROF_CUDA_GRAPH=1, the same
    method through the environment. The power state (None: kprof's own default) is always passed by name, so
    $KPROF_POWER cannot give a phase the rows of another state; a kprof without it cannot time one."""
    import inspect

    params = inspect.signature(run).parameters
    kwargs, env = {}, {}
    if row_method != "default":
        if "cuda_graph" in params:
            kwargs["cuda_graph"] = True
        else:
            env["KPROF_CUDA_GRAPH"] = "1"
    if power is not None:
        if "power" not in params:
            raise TypeError(f"this kprof's api.run takes no power state, so no {power} row can be read; run the "
                            f"benchmark with a kprof that has one")
        kwargs["power"] = power
    return kwargs, env


def fill_rows(wanted: dict[tuple, list[dict]], backend: str, db: str, row_method: str = "default",
              log=None) -> dict[RowKey, dict]:
    """kprof rows of every wanted spec, per (table, power state) (api.run mode jit: measured unless the ledger
    has them), keyed by row_key: status, time_us, citation, timing, power, and the measured event's kernel
    names and notes."""
    from kprof import api
    from kprof.ledger import Ledger

    out: dict[RowKey, dict] = {}
    for (table, power), specs in wanted.items():
        def progress(n, total, spec, table=table, power=power):
            if log:
                log(f"  row {table} ({power}) {n}/{total} {json.dumps(spec)}")

        env: dict = {}
        saved: dict = {}
        try:
            kwargs, env = _method_kwargs(row_method, api.run, power)
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            result = api.run(table, backend, specs, mode="jit", db=db, progress=progress, **kwargs)
        except Exception as e:  # noqa: BLE001 - a table that cannot run leaves its ops without rows, loudly
            for spec in specs:
                out[row_key(table, spec, power)] = {"table": table, "spec": spec, "power": power, "status": "error",
                                                    "time_us": None, "error": f"{type(e).__name__}: {e}"}
            if log:
                log(f"  rows of {table} ({power}) failed: {type(e).__name__}: {e}")
            continue
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        for spec, doc in zip(specs, result.results):
            ok = doc["status"] == "ok"
            out[row_key(table, spec, power)] = {
                "table": table, "spec": spec, "power": power, "status": doc["status"], "citation": doc.get("citation"),
                "event": doc.get("event"), "time_us": doc["metrics"]["time_ms"] * 1e3 if ok else None,
                "timing": (doc.get("provenance") or {}).get("timing"), "stats": doc.get("stats"),
                "error": doc.get("error")}
    details = [row for row in out.values() if row.get("event") and row["status"] == "ok"]
    if details:
        try:
            with Ledger.open(db, readonly=True) as ledger:
                for row in details:
                    _add_event_details(row, ledger)
        except Exception as e:  # noqa: BLE001 - details only: the rows and the passes' samples stay
            for row in details:
                row["notes_error"] = f"{type(e).__name__}: {e}"
    return out


def _add_event_details(row: dict, ledger) -> None:
    try:
        ev = ledger.event(bytes.fromhex(row["event"]))
        row["notes"] = dict(ev.method.notes)  # kernel names, algorithm used, L2 handling, settling, routing loads
        clocks = ev.environment.clocks
        row["clocks"] = {k: clocks[k] for k in ("sm_mhz_median", "sm_mhz_min", "power_w_mean", "temp_c_max")
                         if k in clocks}
        row["throttle"] = list(ev.environment.throttle)
        row["samples_ms"] = list(ev.stats.samples)
    except Exception as e:  # noqa: BLE001 - details only
        row["notes_error"] = f"{type(e).__name__}: {e}"


def attach_rows(phase: dict, ops: list[Op], rows: dict[RowKey, dict], power: str) -> None:
    """Composes one phase's in-model samples with its rows, those of the power state `power`, into
    phase["ops"/"layer"/"uncovered"]; phase["power"] records the state."""
    phase["power"] = power
    kprof_us, by_op = {}, {}
    for o in ops:
        if o.table is not None:
            row = rows.get(row_key(o.table, o.spec, power), {"status": "missing", "time_us": None})
            kprof_us[o.name], by_op[o.name] = row.get("time_us"), row
    used = phase.get("layers_used")  # "1..15": the layers each iteration's samples hold
    first, _, last = (used or "").partition("..")
    layers = int(last) - int(first) + 1 if first.isdigit() and last.isdigit() else None
    phase.update(compose(ops, phase.get("samples_us", {}), kprof_us, layers))
    for name, row in by_op.items():
        entry = phase["ops"][name]
        entry["layout_in_model"] = phase.get("layouts", {}).get(name)
        entry["row"] = {k: row.get(k) for k in ("status", "citation", "timing", "power", "error")}
        notes = row.get("notes", {})
        entry["row"].update({k: notes[k] for k in ("algorithm_used", "kernels_per_invocation") if k in notes})
        in_model = phase.get("kernels", {}).get("eager", {}).get(name)
        if "kernels" in notes and in_model is not None:  # the row stores its names comma-joined, cut at 1000
            entry["same_kernels_as_row"] = ",".join(in_model)[:1000] == notes["kernels"]
            if not entry["same_kernels_as_row"]:
                entry["row_kernels"] = notes["kernels"]


# ----- the GPU passes --------------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Sampler:
    """NVML telemetry over a block (kprof.measure.nvml.Telemetry); never fails the work."""

    def __init__(self):
        self.tel, self.error = None, None

    def __enter__(self):
        try:
            from kprof.measure.nvml import Telemetry

            self.tel = Telemetry(0, hz=20).__enter__()
        except Exception as e:  # noqa: BLE001
            self.tel, self.error = None, f"{type(e).__name__}: {e}"
        return self

    def __exit__(self, *exc):
        if self.tel is not None:
            self.tel.__exit__(*exc)

    def summary(self) -> dict:
        if self.tel is None:
            return {"error": self.error}
        s = self.tel.summary()
        return {k: s.get(k) for k in ("sm_mhz_min", "sm_mhz_median", "sm_mhz_max", "power_w_mean", "power_w_max",
                                      "temp_c_max", "util_pct_mean", "throttle", "errors")}


def _discover_eager(model, ph, buf, session, ops: list[Op]):
    """Layer 0 op by op, each op between synchronized timestamps, traced: (kernels per op, layouts)."""
    import torch

    from _decoder import Calls, Trace, check_trace, run_layer

    trace, marks = Trace(), []

    def before(op):
        trace.mark(op)
        torch.cuda.synchronize()
        marks.append((op, session.timestamp()))

    torch.cuda.synchronize()
    session.collect()
    run_layer(model.layer(0, ph, buf, buf.x0, Calls(trace)), before)
    torch.cuda.synchronize()
    kernels, _ = session.collect()
    layouts = check_trace(ops, trace)  # the layer made exactly the kprof calls its op list says
    found = assign_windows(kernels, marks)
    empty = [o.name for o in ops if o.table is not None and not found[o.name]]
    if empty:
        raise KernelMismatch(f"discovery: covered op(s) {empty} launched no kernel; is CUPTI tracing this device?")
    return found, layouts


def _discover_graph(model, ph, buf, session, counts: dict[str, int]) -> dict[str, list[Kernel]]:
    """Layer 0 with each op captured as its own CUDA graph (an op that launched nothing eagerly runs eagerly),
    then the graphs replayed in order, each between synchronized timestamps (second round kept)."""
    import torch

    from _decoder import Calls

    gen = model.layer(0, ph, buf, buf.x0, Calls())
    graphs = []
    try:
        op = next(gen)
        while op != END:
            if counts.get(op):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    nxt = next(gen)
            else:
                g, nxt = None, next(gen)
            graphs.append((op, g))
            op = nxt
    finally:
        gen.close()
    marks: list = []
    for _round in range(2):
        torch.cuda.synchronize()
        session.collect()  # the first round's kernels (and anything before) are dropped here
        marks = []
        for op, g in graphs:
            torch.cuda.synchronize()
            marks.append((op, session.timestamp()))
            if g is not None:
                g.replay()
        torch.cuda.synchronize()
        marks.append((END, session.timestamp()))
    kernels, _ = session.collect()
    del graphs
    return assign_windows(kernels, marks)


def _timed(run_once, session, plan: Plan):
    """`plan.warmup` untimed calls and then forwards back to back for `plan.busy_s`, then `plan.iters` back to
    back inside one synchronized window: the kernels inside it, the last output, and the NVML telemetry of the
    window."""
    import torch

    torch.cuda.synchronize()
    session.collect()
    for _ in range(plan.warmup):
        run_once()
    torch.cuda.synchronize()
    t = time.perf_counter()
    while time.perf_counter() - t < plan.busy_s:
        for _ in range(4):
            run_once()
        torch.cuda.synchronize()
        session.collect()  # the busy forwards' records are dropped: only the timed window is kept
    with _Sampler() as sampler:
        t0 = session.timestamp()
        for _ in range(plan.iters):
            out = run_once()
        torch.cuda.synchronize()
        t1 = session.timestamp()
    kernels, _ = session.collect()
    return [k for k in kernels if t0 <= k[1] and k[2] <= t1], out, sampler.summary()


def activation_addresses(model, ph: Phase, buf) -> dict[str, list[int]]:
    """Each covered op's activation address modulo 2 MiB (its place inside a large page), layer by layer, in one
    traced eager forward: where the model's caching allocator puts what a row's placements stand in for (a decode
    kernel's time follows that address: tests/benchmarks/address_check.py). The timed eager passes repeat the
    same allocations, so they see the same places."""
    from _decoder import Calls, Trace, run_layer

    trace = Trace()
    calls, x = Calls(trace), buf.x0
    for i in range(len(model.weights)):
        x = run_layer(model.layer(i, ph, buf, x, calls), trace.mark)
    out: dict[str, list[int]] = {}
    for op, where in trace.addresses:
        out.setdefault(op, []).append(where)
    return out


def run_phase(model, ph: Phase, plan: Plan) -> dict:
    """One config and phase on the GPU: discovery, the eager pass and the graph pass, with one retry (after
    a fresh discovery) of a pass whose kernels do not follow the discovered sequence."""
    import torch

    from _decoder import Calls
    from kprof.measure._cupti import Session

    cfg, ops = model.cfg, layer_ops(model.cfg, ph)
    names = [o.name for o in ops]
    result = {"config": cfg.name, "phase": ph.name, "kind": ph.kind, "batch": ph.batch, "tokens": ph.tokens,
              "length": ph.length, "power": plan.power(ph), "layers": plan.layers, "iterations": plan.iters,
              "warmup": plan.warmup, "busy_s": plan.busy_s,
              "layers_used": f"{1 if plan.skip_first_layer else 0}..{plan.layers - 1}",
              "kernels": {}, "isolated_us": {}, "samples_us": {}, "telemetry": {}, "overlapping_kernels": {},
              "layer_span_us": {}, "errors": {}, "retries": {}, "mismatch": {}}
    started = time.perf_counter()
    buf = model.buffers(ph)
    calls = Calls()

    def forward():
        return model.forward(ph, buf, calls)

    with Session() as session:
        for _ in range(plan.warmup):  # lazy initialization, cuBLAS heuristics, module loading
            forward()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # CUDA graph capture wants its warm-up on a side stream
            for _ in range(GRAPH_WARMUP):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

        found, layouts = _discover_eager(model, ph, buf, session, ops)
        result["layouts"] = layouts
        result["activation_mod_2mib"] = activation_addresses(model, ph, buf)
        counts = {op: len(ks) for op, ks in found.items()}
        graph = static_out = run_once = None
        for mode in MODES:
            try:
                if mode == "graph":
                    found = _discover_graph(model, ph, buf, session, counts)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        static_out = forward()
                    run_once = graph.replay
                else:
                    run_once = forward
                for attempt in (1, 2):
                    seq = sequence_of(found, names)
                    kernels, out, tel = _timed(run_once, session, plan)
                    try:
                        chunks = split_layers(kernels, seq, plan.layers, plan.iters, f"{cfg.name} {ph.name} {mode}")
                        break
                    except KernelMismatch as e:
                        if attempt == 2:
                            n = sum(len(ns) for _op, ns in seq)
                            result["mismatch"][mode] = {"discovered": dict(seq),
                                                        "first_layer_seen": [k[0] for k in launch_order(kernels)[:n]]}
                            raise
                        result["retries"][mode] = str(e)
                        _log(f"  {mode}: {e}; discovering again and retrying once")
                        found = (_discover_graph(model, ph, buf, session, counts) if mode == "graph"
                                 else _discover_eager(model, ph, buf, session, ops)[0])
                result["kernels"][mode] = dict(seq)
                result["isolated_us"][mode] = {op: sum(k[2] - k[1] for k in found[op]) / 1e3 for op in names}
                result["samples_us"][mode] = op_samples(chunks, seq, plan.layers, plan.skip_first_layer)
                result["telemetry"][mode] = tel
                result["overlapping_kernels"][mode] = overlaps(kernels)
                result["layer_span_us"][mode] = _median(spans(chunks, plan.layers, plan.skip_first_layer))
                final = static_out if mode == "graph" else out
                if not bool(torch.isfinite(final).all()):
                    result["errors"][f"{mode}_output"] = "the model output has non-finite values"
            except Exception as e:  # noqa: BLE001 - one mode failing keeps the other's numbers
                result["errors"][mode] = f"{type(e).__name__}: {e}"
                _log(f"  {cfg.name} {ph.name} {mode} FAILED: {type(e).__name__}: {e}")
                traceback.print_exc(file=sys.stderr)
                torch.cuda.synchronize()
            finally:
                run_once = graph = static_out = None  # the graph and its memory go now
    result["wall_s"] = time.perf_counter() - started
    return result


# ----- output ------------------------------------------------------------------------------------------

def _clip(x: float | None, signed: bool = True) -> str:
    """A fraction as a percentage with one decimal; beyond ±999 % as >999 (the columns stay aligned)."""
    if x is None:
        return "n/a"
    if abs(x) >= 9.995:
        return (">+999" if x > 0 else "<-999") if signed else ">999"
    return f"{x * 100:+.1f}" if signed else f"{x * 100:.1f}"


def _pct(x: float | None, width: int = 6) -> str:
    return _clip(x).rjust(width)


def _share(x: float | None) -> str:
    return f"{x * 100:.1f}%" if x is not None else "n/a"


def _us(x: float | None, width: int = 9) -> str:
    return f"{x:{width}.1f}" if x is not None else "n/a".rjust(width)


def phase_lines(p: dict) -> list[str]:
    """A phase's per-op table (stderr, as each config finishes)."""
    lines = [f"{p['config']} {p['phase']} (layers {p.get('layers_used')}, {p.get('iterations')} iterations, "
             f"rows {p.get('power', 'n/a')})"
             + (f"  ERRORS {p['errors']}" if p.get("errors") else "")]
    lines.append(f"  {'op':14} {'table':18} {'kprof':>9} {'eager':>9} {'graph':>9} {'Δeager':>7} {'Δgraph':>7} "
                 f"{'e/g':>6} {'eager layers: fastest-slowest, Δfastest':>41} kernels")
    for name, e in p.get("ops", {}).items():
        n = len(p.get("kernels", {}).get("eager", {}).get(name, []))
        same = "" if e.get("same_kernels_as_row", True) else "  (row ran other kernels)"
        spread = e.get("eager_layers_us")
        by_layer = (f"{spread['fastest']:.1f}-{spread['slowest']:.1f} µs, {_pct(e.get('err_eager_fastest_layer'), 7)}"
                    if spread else "")
        lines.append(f"  {name:14} {e['table'] or 'uncovered':18} {_us(e['kprof_us'])} {_us(e['eager_us'])} "
                     f"{_us(e['graph_us'])} {_pct(e['err_eager'], 7)} {_pct(e['err_graph'], 7)} "
                     f"{_pct(e['eager_vs_graph'])} {by_layer:>41} {n}{same}")
    layer, unc = p.get("layer", {}), p.get("uncovered", {})
    if layer:
        lines.append(f"  {'layer covered':33} {_us(layer['kprof_us'])} {_us(layer['eager_us'])} "
                     f"{_us(layer['graph_us'])} {_pct(layer['err_eager'], 7)} {_pct(layer['err_graph'], 7)} "
                     f"{_pct(layer['eager_vs_graph'])}")
        lines.append(f"  {'uncovered':33} {'':9} {_us(unc.get('eager_us'))} {_us(unc.get('graph_us'))}   share "
                     f"{_share(unc.get('share_eager'))} / {_share(unc.get('share_graph'))} of the layer")
    return lines


def summary_lines(doc: dict) -> list[str]:
    """The short table printed last: per-op errors per phase, per-layer sums, verdicts."""
    phases = doc["phases"]
    used = next((p["layers_used"] for p in phases if p.get("layers_used")), "-")  # a failed phase has none
    lines = [f"model_step: {doc['gpu']}, torch {doc['torch']}, {doc['plan']['layers']} layers (used {used}), "
             f"{doc['plan']['iters']} iterations, rows {', '.join(doc['row_timings']) or 'none'}",
             "kprof row vs in-model kernel time per op: error vs eager / vs graph (%)"]
    for cfg in dict.fromkeys(p["config"] for p in phases):
        mine = [p for p in phases if p["config"] == cfg]
        lines.append(f"{cfg:14} {'table':24}" + "".join(f" {p['phase']:>13}" for p in mine))
        op_names = list(dict.fromkeys(n for p in mine for n, e in p.get("ops", {}).items() if e["covered"]))
        for name in op_names:
            table = table_label([p["ops"][name]["table"] for p in mine if name in p.get("ops", {})])
            cells = []
            for p in mine:
                e = p.get("ops", {}).get(name)
                cells.append(f" {_pct(e['err_eager'])}/{_pct(e['err_graph'])}" if e else f" {'-':>13}")
            lines.append(f"  {name:12} {table:24}" + "".join(cells))
    lines.append(f"{'per layer, covered ops':27} {'power':9} {'kprof µs':>9} {'eager µs':>9} {'graph µs':>9} "
                 f"{'Δeager':>7} {'Δgraph':>7} {'uncov e/g %':>12} {'e/g':>6}")
    for p in phases:
        layer, unc = p.get("layer", {}), p.get("uncovered", {})
        share = "/".join(_share(unc.get(k)).rstrip("%") for k in ("share_eager", "share_graph"))
        lines.append(f"{p['config'][:12]:12} {p['phase']:14} {p.get('power', 'n/a'):9} {_us(layer.get('kprof_us'))} "
                     f"{_us(layer.get('eager_us'))} {_us(layer.get('graph_us'))} {_pct(layer.get('err_eager'), 7)} "
                     f"{_pct(layer.get('err_graph'), 7)} {share:>12} {_pct(layer.get('eager_vs_graph'))}"
                     + ("  ERR " + ",".join(p["errors"]) if p.get("errors") else ""))
    v = doc["verdicts"]
    t = v["targets"]
    lines.append(f"verdicts (targets: layer sum within {t['layer']:.0%} for every config and phase; per-kernel "
                 f"median |err| <= {t['kernel_median']:.0%}, max <= {t['kernel_max']:.0%})")
    for m in MODES:
        r = v[m]
        worst = max(r["layer_over"], key=lambda x: abs(x["err"]), default=None)
        lines.append(f"  vs {m:5}: layer {'PASS' if r['layer_pass'] else 'FAIL'} {r['layer_within']}"
                     + (f" (worst {worst['where']} {_clip(worst['err'])}%)" if worst else "")
                     + f"; kernel median {'PASS' if r['kernel_median_pass'] else 'FAIL'} "
                       f"{_clip(r['kernel_median_abs'], signed=False)}%"
                     + f"; max {'PASS' if r['kernel_max_pass'] else 'FAIL'} {_clip(r['kernel_max_abs'], signed=False)}%"
                     + (f" ({r['kernel_max_where']})" if r["kernel_max_where"] else ""))
        fams = r["families_over_target"]
        lines.append("    over target: " + (", ".join(
            f"{n} ({_clip(f['median_abs'], signed=False)}/{_clip(f['max_abs'], signed=False)}%)"
            for n, f in fams.items()) or "none") + ("  [median/max |err|]" if fams else ""))
        if r["missing"]:
            lines.append(f"    missing ({len(r['missing'])}): {', '.join(r['missing'][:6])}"
                         + (" ..." if len(r["missing"]) > 6 else ""))
    a = v["eager_vs_graph"]
    lines.append(f"in-model eager vs graph: layers within {_clip(a['layer_max_abs'], signed=False)}%"
                 + (f" ({a['layer_max_where']})" if a["layer_max_where"] else "")
                 + f"; covered ops median {_clip(a['op_median_abs'], signed=False)}%, max "
                 f"{_clip(a['op_max_abs'], signed=False)}%" + (f" ({a['op_max_where']})" if a["op_max_where"] else ""))
    return lines


def _environment() -> dict:
    try:
        import msgspec

        from kprof.measure.nvml import gpu_environment

        return msgspec.to_builtins(gpu_environment(0))
    except Exception as e:  # noqa: BLE001 - provenance, never fatal
        return {"errors": {"environment": f"{type(e).__name__}: {e}"}}


def _pack_ledger(db: str, out_dir: str) -> str | None:
    """The ledger as OUT/model_step_ledger.tar.gz, when it is small enough; then its files are removed: the LMDB
    file, its lock file and the fill's claims directory (`<db>-claims`, its lock alone once the fill has ended)."""
    if not os.path.exists(db) or os.path.getsize(db) > LEDGER_TAR_MAX:
        return None
    path = os.path.join(out_dir, "model_step_ledger.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(db, arcname=os.path.basename(db))
    for f in (db, db + "-lock"):
        if os.path.exists(f):
            os.remove(f)
    shutil.rmtree(db + "-claims", ignore_errors=True)
    return path


def _row_name(row: dict) -> str:
    return f"{row['table']} {json.dumps(row['spec'], sort_keys=True)} ({row.get('power')})"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        plan = make_plan(args)
    except ValueError as e:
        print(f"model_step: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(f"model_step: torch {torch.__version__} sees no CUDA device; this benchmark runs on a GPU",
              file=sys.stderr)
        return 2
    from kprof.measure.gpu_timer import cupti_available
    from kprof.runners.catalog import parse_timing, timing_power

    why = cupti_available()
    if why:
        print(f"model_step: CUPTI is not usable ({why}); install cupti-python", file=sys.stderr)
        return 2
    os.environ.setdefault("KPROF_ENERGY_S", "0")
    os.makedirs(plan.out, exist_ok=True)
    db = plan.db or os.path.join(plan.out, "model_step.db")
    env = _environment()
    started = time.perf_counter()
    phases: list[dict] = []
    rows: dict[RowKey, dict] = {}
    failures: list[str] = []
    from _decoder import Model

    for cfg in plan.configs:
        mine: list[dict] = []
        lost: list[dict] = []  # phases the model could not run: each fails its targets, as a failed phase does
        model = None
        try:
            _log(f"{cfg.name}: building {plan.layers} layers on the GPU")
            model = Model(cfg, plan.layers, "cuda")
            for ph in plan.phases:
                _log(f"{cfg.name} {ph.name}: discovery, eager and graph passes")
                try:
                    mine.append(run_phase(model, ph, plan))
                except Exception as e:  # noqa: BLE001 - the next phase still runs
                    traceback.print_exc(file=sys.stderr)
                    mine.append({"config": cfg.name, "phase": ph.name, "errors": {"phase": f"{type(e).__name__}: {e}"}})
                gc.collect()
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - building the model failed (out of memory?): the next config runs
            traceback.print_exc(file=sys.stderr)
            ran = {p["phase"] for p in mine}
            lost = [{"config": cfg.name, "phase": ph.name, "errors": {"model": f"{type(e).__name__}: {e}"}}
                    for ph in plan.phases if ph.name not in ran]
        finally:
            del model
            gc.collect()
            torch.cuda.empty_cache()
        if mine:
            _log(f"{cfg.name}: kprof rows ({plan.row_method} method; prefill {plan.prefill_power}, decode sustained) "
                 f"into {db}")
            got = fill_rows(wanted_specs(cfg, [PHASES[p["phase"]] for p in mine], plan.prefill_power), "torch", db,
                            plan.row_method, _log)
            rows.update(got)
            for p in mine:
                ph = PHASES[p["phase"]]
                attach_rows(p, layer_ops(cfg, ph), got, plan.power(ph))
                for line in phase_lines(p):
                    _log(line)
        phases += mine + lost

    for p in phases:
        failures += [f"{p['config']} {p['phase']} {k}: {v}" for k, v in p.get("errors", {}).items()]
    failures += [f"row {_row_name(r)}: {r['status']} {r.get('error') or ''}" for r in rows.values()
                 if r["status"] != "ok"]
    failures += [f"row {_row_name(r)}: timed {r['timing']}, not in the {r['power']} power state"
                 for r in rows.values() if r.get("timing") and timing_power(r["timing"]) != r["power"]]
    timings = sorted({r["timing"] for r in rows.values() if r.get("timing")})
    if plan.row_method == "default" and any(parse_timing(t) != ("cupti", "cold", False) for t in timings):
        _log(f"note: rows were timed {timings}, not kprof's default cupti;l2=cold;eager (KPROF_TIMER, KPROF_L2 or "
             f"KPROF_CUDA_GRAPH is set in this environment)")
    doc = {"benchmark": "model_step", "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
           "gpu": env.get("gpu_name") or torch.cuda.get_device_name(0), "torch": torch.__version__,
           "environment": env, "plan": {"configs": [c._asdict() for c in plan.configs],
                                        "phases": [p._asdict() for p in plan.phases], "layers": plan.layers,
                                        "iters": plan.iters, "warmup": plan.warmup, "busy_s": plan.busy_s, "quick": plan.quick,
                                        "row_method": plan.row_method, "prefill_power": plan.prefill_power,
                                        "skip_first_layer": plan.skip_first_layer},
           "row_timings": timings, "targets": TARGETS, "notes": NOTES, "phases": phases,
           "rows": list(rows.values()), "verdicts": verdicts(phases), "failures": failures,
           "wall_s": time.perf_counter() - started}
    with open(os.path.join(plan.out, "model_step.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    packed = _pack_ledger(db, plan.out) if plan.db is None else None
    _log(f"wrote {os.path.join(plan.out, 'model_step.json')}" + (f" and {packed}" if packed else f"; ledger {db}"))
    for line in failures[:20]:
        _log(f"FAILED {line}")
    try:
        table = summary_lines(doc)
    except Exception:  # noqa: BLE001 - the JSON is written; say why the table is not
        traceback.print_exc(file=sys.stderr)
        table = ["model_step: the summary table failed (see the traceback above); results are in model_step.json"]
    print("\n".join(table), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
