"""``make paper-shape`` (``scripts/paper_shape.py``): a paper config's settings end to end at Qwen2.5-0.5B's shape,
on the CPUs of one machine.

1. **Model.** A causal LM with Qwen2.5-0.5B's architecture (:data:`~ragen_async.bench.learner.QWEN_0_5B`:
   hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4,864, vocabulary 151,936, tied embeddings, RoPE
   theta 1e6), random weights from a fixed seed (every matrix and embedding ~ N(0, 0.02), norms 1, biases 0),
   saved in bfloat16 safetensors with the project's tokenizer (the files of ``artifacts/tiny-model``; its
   vocabulary is smaller than the model's, as Qwen's own is) and a ``build_info.json`` with its cache key and
   weights' SHA-256. A build with the same key is reused. ``--layers`` / ``--vocab`` make smaller variants.
   The default vocabulary is :data:`DEFAULT_VOCAB` (65,536), not 151,936: at the full vocabulary actor and
   critic do not fit beside the engine in 24 GiB (see there).
2. **Run.** ``configs/paper/shape_bandit.yaml`` (StarPO-S with the critic on Bandit, the paper's settings with the
   batch made small and the hardware CPU: Ray, 1 rollout actor with vLLM on CPU, 2 learner ranks over gloo,
   ``weight_sync.verify_every: 1``, bf16; 4 groups of 3 through the std filter, which keeps 3: 9 trajectories, so
   the ranks' shards are uneven; 2 mini-batches of micro-batches of 2), in one of two variants
   (:data:`VARIANTS`, ``--strategy``): ``ddp``, the paper configs' own strategy, with the reference model (KL
   loss), at the layer count that fits two replicas; ``fsdp`` at the full 24 layers. Through the real CLI: run 1
   trains 2 steps and saves a checkpoint; its saved config is extended to ``total_steps: 3`` and ``ragen-async
   train --resume`` trains step 3 from that checkpoint.
3. **Figures.** The time of each phase (model build, each run, engine start-up from the engine's log, each
   learner step from ``metrics.jsonl``'s timing keys, each checkpoint as seen on disk) and the peak memory
   (RSS) of every process of each run's tree (driver, Ray's daemons, learner ranks, rollout actor, vLLM
   engine core), sampled every 0.5 s.
4. **Checks**, one line each: run 1 exits 0 at step 2; its checkpoint is complete (manifest verified); run 2
   resumes it (steps 1-2 untouched) and reaches step 3; every weight sync's probe
   (``weight_sync/probe_max_abs_diff``: engine vs learner log-probs of a fixed sequence) is present and within
   the tolerance of ``model.dtype``; the learner took the paths a one-shard, one-pass step never takes
   (:func:`learner_path_checks`: uneven shards, several micro-batches with the padded path, two optimizer steps,
   the std filter over several groups, the reference model in the DDP variant) and every sync passed the
   byte-exact weight check; the final checkpoint's actor differs from the base model in more than half of its
   weights. The last line is ``paper-shape: OK`` with the strategy, layers, the compute dtype the learner used
   (``learner/compute_bits``), each check passed and the figures, or ``paper-shape: FAILED ...`` (exit status 1).

Its length (over the project's ~600 lines per module): build, runs, memory watch, checks and the report line are
one end-to-end check whose parts are used nowhere else.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragen_async.bench.learner import QWEN_0_5B

REPO = Path(__file__).resolve().parents[2]
CONFIG = Path("configs/paper/shape_bandit.yaml")
TOKENIZER_SOURCE = Path("artifacts/tiny-model")
MODEL_ROOT = Path("artifacts")
RUNS_ROOT = Path("runs/paper-shape")
FORMAT_VERSION = 1
"""Bump when the build changes in a way its options do not capture (forces a rebuild)."""
INIT_STD = 0.02
"""Standard deviation of every random matrix and embedding (Qwen2's ``initializer_range``): logits stay O(1)."""
FIRST_RUN_STEPS, TOTAL_STEPS = 2, 3
PROBE_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}
"""Largest engine-vs-learner probe difference (nats) accepted, by ``model.dtype``. float32 on both sides agrees
to ~1e-5 (tests/system/test_ray_runtime.py asserts 1e-3). In bf16 the two sides' kernels round differently: measured
on this init, engine vs learner 1.2e-2 at 2 layers; a bf16 against an fp32 forward of the probe 1.3e-2 at 2
layers and 2.1e-2 at 24. A wrong, missing or garbled tensor moves log-probs by far more; a missed step at lr
1e-6 moves them by less than this noise (the probe cannot see one; the moved-weights check covers training)."""
MOVED_MIN = 0.5
"""The final checkpoint's actor must differ from the base model in more than this share of its weights."""
DEFAULT_VOCAB = 65_536
"""The embedding rows of the default build. With Qwen2.5-0.5B's 151,936 the run does not fit a 24 GiB machine:
each learner rank holds half of actor and critic in fp32 with AdamW state and gradients (16 B per parameter
per model, halved by FSDP: 494 M x 16 B = 7.9 GB a rank), during a forward and backward the root unit's
embedding gathered in bf16 with its full-size gradient (136 M x 8 B = 1.1 GB), and rank 0 one full optimizer
state while it checkpoints (494 M x 8 B = 4 GB). Measured at 151,936 (with :data:`MALLOC_ENV`): step 1 done,
22.1 GiB PSS for the whole run, and Ray's memory monitor (95 % of 23.5 GB) killed a rank in step 2. 65,536
rows take 58 M of the 136 M embedding parameters per model: the run then peaks at 20.4 GiB PSS."""
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "1048576"}
"""glibc settings for every process of the run (Ray's workers inherit them): tensors of 1 MiB and more are
mapped and unmapped, not kept in the heap after they are freed. Without them the learner ranks' heaps keep
the full fp32 models loaded before sharding and the gathered buckets of each publish: measured at vocabulary
65,536, ranks at 9.6 and 8.7 GiB RSS and Ray's memory monitor killed one in step 2; with them 11.2 and
7.7 GiB at their peaks (rank 0 during the checkpoint), 20.4 GiB PSS for the whole run."""
SAMPLE_S = 0.5
MIN_AVAILABLE_GIB = 0.75
"""Below this much available memory the run is stopped (SIGTERM) rather than left to the OOM killer."""
BUDGET_S = 30 * 60
"""What `make paper-shape` may take on the 2-core machine."""
VARIANTS: dict[str, dict[str, Any]] = {
    "ddp": {"layers": 8, "overrides": ["learner.strategy=ddp", "algo.kl_coef=0.001"]},
    "fsdp": {"layers": QWEN_0_5B["num_hidden_layers"], "overrides": ["learner.strategy=fsdp"]},
}
"""The two runs of ``make paper-shape``: the paper configs' DDP (actor, critic and the reference model replicated on
each rank with fp32 masters, gradients and AdamW state: the full 24 layers need about 16 GB a rank, so fewer layers
with the same widths, heads, vocabulary and tied head) and FSDP at the full shape (``--strategy``)."""
COMPUTE_NAMES = {16.0: "bf16", 32.0: "fp32", None: "unreported"}
"""``learner/compute_bits`` (what the learner's matmuls produced) as the report names it."""
BUILD_INFO = "build_info.json"
_NOT_TOKENIZER = ("config.json", "generation_config.json", BUILD_INFO)


def log(msg: str) -> None:
    print(f"[paper-shape] {msg}", flush=True)


# --------------------------------------------------------------------------------------------- the model

def model_dir_for(layers: int, vocab: int) -> Path:
    """Where the build of this shape lives: ``artifacts/qwen2.5-0.5b-shape`` for the full shape (the config's
    ``model.path``), a suffixed sibling for a variant."""
    suffix = "" if layers == QWEN_0_5B["num_hidden_layers"] else f"-l{layers}"
    suffix += "" if vocab == QWEN_0_5B["vocab_size"] else f"-v{vocab}"
    return MODEL_ROOT / f"qwen2.5-0.5b-shape{suffix}"


def tokenizer_files(source: Path) -> list[Path]:
    """The tokenizer's files of a model directory (everything but weights, configs and build info)."""
    return sorted(p for p in source.iterdir() if p.is_file() and p.name not in _NOT_TOKENIZER
                  and not p.name.endswith(".safetensors") and not p.name.startswith("."))


def build_key(layers: int, vocab: int, seed: int, source: Path) -> str:
    """The cache key of a build: its shape, seed, init, format version and the tokenizer's bytes."""
    h = hashlib.sha256(json.dumps({"format_version": FORMAT_VERSION, "shape": {**QWEN_0_5B, "num_hidden_layers": layers,
                                                                              "vocab_size": vocab},
                                   "seed": seed, "init_std": INIT_STD, "dtype": "bfloat16"}, sort_keys=True).encode())
    for f in tokenizer_files(source):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _special_ids(source: Path) -> dict[str, int | None]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
            "tokenizer_vocab": len(tok)}


def ensure_shape_model(out: Path, layers: int, vocab: int, seed: int = 0, source: Path = TOKENIZER_SOURCE,
                       force: bool = False) -> tuple[Path, float, bool]:
    """A model directory of Qwen2.5-0.5B's shape (``layers`` decoder layers, ``vocab`` embeddings) in ``out``:
    reused when a complete build with the same key is there, else built. Returns (path, seconds, built)."""
    t0 = time.perf_counter()
    if not (source / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer at {source}: the project's tokenizer ships in artifacts/tiny-model (`git checkout artifacts/tiny-model`)")
    key = build_key(layers, vocab, seed, source)
    info_path = out / BUILD_INFO
    if not force and info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("complete") and info.get("cache_key") == key and any(out.glob("*.safetensors")):
            log(f"model: {out} already holds build {key} ({info['parameter_count'] / 1e6:.1f} M parameters); reused")
            return out, time.perf_counter() - t0, False
        log(f"model: {out} holds build {info.get('cache_key')}, wanted {key}: rebuilding")

    import torch
    import transformers
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from ragen_async.modeldir import weights_sha256

    ids = _special_ids(source)
    if ids["tokenizer_vocab"] > vocab:
        raise ValueError(f"--vocab {vocab} is smaller than the tokenizer's {ids['tokenizer_vocab']} tokens")
    special = {k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = Qwen2Config(**{**QWEN_0_5B, "num_hidden_layers": layers, "vocab_size": vocab, "initializer_range": INIT_STD,
                            "use_sliding_window": False, **special})
    log(f"model: building {out} (key {key}): {layers} layers x hidden {config.hidden_size}, {config.num_attention_heads} "
        f"heads / {config.num_key_value_heads} KV, intermediate {config.intermediate_size}, vocabulary {vocab} "
        f"(tokenizer {ids['tokenizer_vocab']}), tied embeddings, seed {seed}, init N(0, {INIT_STD})")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    t = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # explicit, so the weights depend on the seed and not on a library's init code
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                p.normal_(0.0, INIT_STD, generator=gen)
    model = model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.1f} M parameters initialised in {time.perf_counter() - t:.1f} s; writing bf16 safetensors")
    model.generation_config = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, **special)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    for f in tokenizer_files(source):
        shutil.copy2(f, tmp / f.name)
    written = json.loads((tmp / "config.json").read_text())
    for k, v in special.items():  # the saved config must name the tokenizer's special tokens
        if written.get(k) != v:
            raise RuntimeError(f"config.json has {k}={written.get(k)}, the tokenizer {v}")
    info = {"complete": True, "format_version": FORMAT_VERSION, "cache_key": key, "seed": seed, "init_std": INIT_STD,
            "shape": "qwen2.5-0.5b", "model_config": {k: written[k] for k in (
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")},
            "parameter_count": n_params, "tokenizer_source": str(source), "tokenizer_vocab": ids["tokenizer_vocab"],
            "dtype": "bfloat16", "weights_sha256": weights_sha256(tmp),
            "build_wall_time_s": round(time.perf_counter() - t0, 2),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    seconds = time.perf_counter() - t0
    log(f"model: built {out} in {seconds:.1f} s ({sum(f.stat().st_size for f in out.iterdir()) / 2**30:.2f} GiB)")
    return out, seconds, True


# --------------------------------------------------------------------------------------------- watching a run

@dataclass
class ProcStat:
    pid: int
    label: str
    peak_rss: int = 0
    first_s: float = 0.0
    last_s: float = 0.0


@dataclass
class Watch:
    """What a sampler thread saw of one run: its process tree's memory and its run directory's progress."""

    t0: float
    procs: dict[int, ProcStat] = field(default_factory=dict)
    peak_total_rss: int = 0
    peak_total_pss: int = 0
    samples: int = 0
    records_seen: dict[int, float] = field(default_factory=dict)
    """learner step -> seconds after the start when its metrics record appeared."""
    ckpt_seen: dict[int, list[float]] = field(default_factory=dict)
    """checkpoint step -> [first seen staging, first seen complete] (seconds after the start)."""
    memory_stop: str = ""
    """Why the sampler stopped the run for lack of memory ("" if it did not)."""


def _fd1(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""


def process_label(proc, root_pid: int, logs: str = "/logs/") -> str:
    """A readable name of a process of a run's tree: its Ray actor (learner ranks and rollout actors by the
    log file they write to), the vLLM engine core, Ray's daemons by executable or script."""
    if proc.pid == root_pid:
        return "driver (ragen-async train)"
    try:
        cmd = proc.cmdline()
    except Exception:  # noqa: BLE001 - gone or not ours
        return "?"
    title = " ".join(cmd)
    out = _fd1(proc.pid)
    log_name = Path(out).stem if logs in out else ""  # the run's logs/learner-0.log, logs/rollout-w0.log
    if "EngineCore" in title:
        return f"vllm engine core ({log_name})" if log_name else "vllm engine core"
    if title.startswith("ray::"):
        actor = title.split()[0].split(".")[0]
        if actor == "ray::IDLE":
            return "ray worker (idle)"
        return f"{actor} ({log_name})" if log_name else actor
    exe = Path(cmd[0]).name if cmd else proc.name()
    if exe.startswith("python") and len(cmd) > 1:
        script = next((Path(a).name for a in cmd[1:] if a.endswith(".py")), None)
        if script is None and "-m" in cmd[1:-1]:
            script = cmd[cmd.index("-m") + 1]
        ray_own = any("/ray/" in a for a in cmd[1:2])
        return f"{'ray ' if ray_own else ''}{script or exe}"
    return exe


def _specificity(label: str) -> int:
    return 0 if label in ("?", "ray worker (idle)") else 2 if "(" in label else 1


def sample_tree(root_pid: int, run_dir: Path, watch: Watch, stop: threading.Event) -> None:
    """Every :data:`SAMPLE_S`: RSS of each process under ``root_pid`` (and PSS summed), the metrics records
    and checkpoints that appeared in ``run_dir``."""
    import psutil

    try:
        root = psutil.Process(root_pid)
    except psutil.NoSuchProcess:
        return
    metrics = run_dir / "metrics.jsonl"
    pos = metrics.stat().st_size if metrics.is_file() else 0  # records of an earlier run are not this one's
    logs = str(run_dir.resolve() / "logs") + "/"
    while not stop.is_set():
        now = time.perf_counter() - watch.t0
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        total_rss = total_pss = 0
        for p in procs:
            try:
                rss = p.memory_info().rss
                try:
                    pss = p.memory_full_info().pss
                except (psutil.AccessDenied, AttributeError):
                    pss = rss
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
            total_rss += rss
            total_pss += pss
            stat = watch.procs.get(p.pid)
            label = process_label(p, root_pid, logs)
            if stat is None:
                stat = watch.procs[p.pid] = ProcStat(p.pid, label, first_s=now)
            elif _specificity(label) > _specificity(stat.label):  # an idle worker becomes an actor
                stat.label = label
            stat.peak_rss = max(stat.peak_rss, rss)
            stat.last_s = now
        watch.peak_total_rss = max(watch.peak_total_rss, total_rss)
        watch.peak_total_pss = max(watch.peak_total_pss, total_pss)
        available = psutil.virtual_memory().available
        if available < MIN_AVAILABLE_GIB * 2**30 and not watch.memory_stop:
            watch.memory_stop = (f"{_gib(available)} available at +{now:.0f} s with the run at {_gib(total_pss)} "
                                 f"(PSS): stopped before the OOM killer; try a smaller --vocab")
            log(f"memory: {watch.memory_stop}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(root_pid, signal.SIGTERM)
        watch.samples += 1
        if metrics.is_file():
            with metrics.open("rb") as f:
                f.seek(pos)
                chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits for the next sample
            pos += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                rec = _json_line(line)
                if rec and "timing/step_s" in rec:
                    watch.records_seen.setdefault(int(rec["learner/step"]), now)
        ckpts = run_dir / "checkpoints"
        if ckpts.is_dir():
            for d in ckpts.iterdir():
                m = re.fullmatch(r"\.?step_(\d+)(\.partial)?", d.name)
                if m:
                    seen = watch.ckpt_seen.setdefault(int(m.group(1)), [math.nan, math.nan])
                    if m.group(2) and math.isnan(seen[0]):
                        seen[0] = now
                    if not m.group(2) and (d / "COMPLETE").exists() and math.isnan(seen[1]):
                        seen[1] = now
        stop.wait(SAMPLE_S)


def _json_line(line: str) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


@dataclass
class Phase:
    name: str
    rc: int
    wall_s: float
    watch: Watch
    timed_out: bool = False
    started: float = 0.0
    """Wall-clock time (``time.time()``) of the start."""
    log_offsets: dict[str, int] = field(default_factory=dict)
    """Size of each rollout actor's log at the start and at the end: what lies between is this run's."""
    log_ends: dict[str, int] = field(default_factory=dict)


def _ragen_async() -> list[str]:
    exe = Path(sys.executable).parent / "ragen-async"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ragen_async.cli"]


def run_phase(name: str, args: list[str], run_dir: Path, timeout_s: float) -> Phase:
    """Run ``ragen-async ARGS`` (its output prefixed on this console) while sampling its process tree."""
    env = {**os.environ, **MALLOC_ENV, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    cmd = [*_ragen_async(), *args]
    log(f"{name}: {' '.join(cmd)}")
    offsets = {f.name: f.stat().st_size for f in (REPO / run_dir / "logs").glob("rollout-*.log")}
    started, t0 = time.time(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    watch, stop = Watch(t0), threading.Event()
    sampler = threading.Thread(target=sample_tree, args=(proc.pid, REPO / run_dir, watch, stop), daemon=True)
    sampler.start()

    def relay() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"  | {line.rstrip()}", flush=True)

    relayer = threading.Thread(target=relay, daemon=True)
    relayer.start()
    timed_out = False
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        log(f"{name}: still running after {timeout_s:.0f} s; stopping it (SIGTERM to pid {proc.pid})")
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)
        proc.wait(90)
        raise
    finally:
        stop.set()
        sampler.join(10)
        relayer.join(10)
    wall = time.perf_counter() - t0
    log(f"{name}: exit status {proc.returncode} after {wall:.1f} s")
    ends = {f.name: f.stat().st_size for f in (REPO / run_dir / "logs").glob("rollout-*.log")}
    return Phase(name, proc.returncode, wall, watch, timed_out, started, offsets, ends)


# --------------------------------------------------------------------------------------------- reading a run

def read_records(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, validation records) of ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    recs = [r for r in map(_json_line, path.read_text().splitlines()) if r] if path.is_file() else []
    return [r for r in recs if "timing/step_s" in r], [r for r in recs if "timing/val_s" in r]


_VLLM_TIME = re.compile(r" (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) ")
_TOOK = re.compile(r"(Initializing model|Loading weights|init engine|Reloading and processing weights)\b.*?took ([\d.]+) ?s")


def engine_startup(run_dir: Path, phase: Phase) -> list[str]:
    """The engine's start-up in ``phase``, from each rollout actor's log (vLLM's timestamped lines): from its
    first line to ``init engine ... took``, when that was (seconds after the run's start), vLLM's own timings,
    and the in-place weight reloads that followed."""
    out = []
    year = time.localtime(phase.started).tm_year
    for f in sorted((run_dir / "logs").glob("rollout-*.log")):
        with f.open("rb") as fh:
            start = phase.log_offsets.get(f.name, 0)
            fh.seek(start)
            lines = fh.read(max(0, phase.log_ends.get(f.name, 0) - start)).decode(errors="replace").splitlines()
        stamps, took, reloads, ready = [], [], [], None
        for line in lines:
            m = _VLLM_TIME.search(line)
            t = None
            if m:
                mo, d, hh, mm, ss = map(int, m.groups())
                t = time.mktime((year, mo, d, hh, mm, ss, 0, 0, -1))
                stamps.append(t)
            k = _TOOK.search(line)
            if k and k.group(1).startswith("Reloading"):
                reloads.append(float(k.group(2)))
            elif k:
                took.append(f"{k.group(1)} {float(k.group(2)):.1f} s")
                if k.group(1) == "init engine" and ready is None:
                    ready = t
        if ready is None or not stamps:
            out.append(f"{f.stem}: no engine start-up in its log")
            continue
        out.append(f"{f.stem}: vLLM up in {ready - stamps[0]:.0f} s (its first log line to ready; ready at "
                   f"+{ready - phase.started:.0f} s): {', '.join(took)}; in-place weight reloads "
                   f"{', '.join(f'{r:.1f}' for r in reloads) or 'none'} s")
    return out


def weights_moved(base: Path, actor: Path) -> tuple[float, int, dict[str, int]]:
    """(share of the base's weights that differ in ``actor``, weights compared, the actor's dtypes by count)."""
    import torch
    from safetensors import safe_open

    def index(path: Path) -> dict[str, Path]:
        names = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(f, framework="pt") as st:
                names.update({k: f for k in st.keys()})
        return names

    base_ix, actor_ix = index(base), index(actor)
    changed = total = 0
    dtypes: dict[str, int] = {}
    for name, f in base_ix.items():
        if name not in actor_ix:
            continue
        with safe_open(f, framework="pt") as st:
            b = st.get_tensor(name)
        with safe_open(actor_ix[name], framework="pt") as st:
            a = st.get_tensor(name)
        dtypes[str(a.dtype).removeprefix("torch.")] = dtypes.get(str(a.dtype).removeprefix("torch."), 0) + a.numel()
        if a.shape != b.shape:
            raise ValueError(f"{name}: shape {tuple(a.shape)} in the checkpoint, {tuple(b.shape)} in the base")
        changed += int((a.to(torch.float32) != b.to(torch.float32)).sum())
        total += b.numel()
    return (changed / total if total else 0.0), total, dtypes


# --------------------------------------------------------------------------------------------- the whole thing

class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed: list[str] = []

    def __call__(self, name: str, ok: bool, detail: str = "") -> bool:
        """One check's line; ``name`` up to its first " (" is what the report line lists."""
        print(f"[paper-shape] check {'PASS' if ok else 'FAIL'}: {name}{f' ({detail})' if detail else ''}", flush=True)
        (self.passed if ok else self.failed).append(name.split(" (")[0])
        return ok


def learner_path_checks(steps: list[dict[str, Any]], cfg: Any) -> list[tuple[str, bool, str]]:
    """``(name, passed, detail)`` for each part of the paper's learner that the run must have taken, from its step
    records: uneven shards, several micro-batches a rank (the padded path), two optimizer steps a learner step, the
    std filter over several groups, the reference model when the config has one, and the byte-exact weight check
    at every sync."""
    def every(key: str, pred) -> tuple[bool, str]:
        vals = [r.get(key) for r in steps]
        return bool(vals) and all(v is not None and pred(v) for v in vals), "/".join(
            "absent" if v is None else f"{v:g}" for v in vals)

    out = []
    ok_max, maxes = every("batch/shard_seqs_max", lambda v: True)
    uneven = ok_max and all(r["batch/shard_seqs_max"] > r.get("batch/shard_seqs_min", math.inf) for r in steps)
    mins = "/".join(f"{r.get('batch/shard_seqs_min', math.nan):g}" for r in steps)
    out.append(("uneven shards (trajectories per rank differ)", uneven, f"most {maxes}, fewest {mins} per step"))
    ok, micro = every("learner/micro_batches", lambda v: v > 1)  # a mean over the step's optimizer steps
    ok_pad, padded = every("learner/padded_micro_batches", lambda v: True)
    padded_any = ok_pad and any(r["learner/padded_micro_batches"] > 0 for r in steps)
    out.append(("several micro-batches in an optimizer step and the padded path", ok and padded_any,
                f"micro-batches per optimizer step {micro} (mean), padded ones {padded} (all ranks)"))
    ok, n_opt = every("learner/optimizer_steps", lambda v: v >= 2)
    out.append(("two optimizer steps per learner step (PPO ratio off 1)", ok, f"optimizer steps {n_opt}"))
    kept = cfg.rollout.groups_per_step if cfg.algo.filter_mode == "none" else \
        int(cfg.algo.filter_ratio * cfg.rollout.groups_per_step)
    ok, groups = every("batch/num_groups", lambda v: v == kept)
    out.append(("the std filter over several groups", ok and cfg.algo.filter_mode == "std" and
                1 < kept < cfg.rollout.groups_per_step,
                f"{cfg.algo.filter_mode} filter kept {groups} of {cfg.rollout.groups_per_step} groups"))
    if cfg.algo.use_ref:
        ok, kl = every("actor/kl_loss", math.isfinite)
        out.append(("the reference model (KL loss)", ok, f"kl_coef {cfg.algo.kl_coef:g}, KL loss {kl}"))
    ok, n = every("weight_sync/verified_tensors", lambda v: v > 0)
    _, secs = every("weight_sync/verify_s", lambda v: True)
    out.append(("every weight sync byte-exact", ok, f"{n} tensors checked per engine, {secs} s per check"))
    return out


def psutil_total() -> int:
    import psutil

    return psutil.virtual_memory().total


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def print_memory(phase: Phase) -> None:
    w = phase.watch
    log(f"{phase.name}: peak memory of its process tree: {_gib(w.peak_total_rss)} RSS summed "
        f"({_gib(w.peak_total_pss)} PSS, shared pages counted once), sampled {w.samples} times")
    shown = sorted(w.procs.values(), key=lambda s: -s.peak_rss)
    big, small = [s for s in shown if s.peak_rss >= 64 * 2**20], [s for s in shown if s.peak_rss < 64 * 2**20]
    for s in big:
        log(f"  {s.label:<44} pid {s.pid:<8} peak RSS {_gib(s.peak_rss):>10}  (seen +{s.first_s:.0f}..{s.last_s:.0f} s)")
    if small:
        log(f"  {len(small)} more processes under 64 MiB each ({_gib(sum(s.peak_rss for s in small))} together)")


def build_in_subprocess(out: Path, layers: int, vocab: int, seed: int, force: bool) -> tuple[float, bool, int]:
    """:func:`ensure_shape_model` in a child process (this one stays small while the runs are measured);
    returns (seconds, built, the child's peak RSS in bytes)."""
    import resource

    t0 = time.perf_counter()
    code = ("import sys; from pathlib import Path; from ragen_async.bench.paper_shape import ensure_shape_model; "
            f"_, _, built = ensure_shape_model(Path({str(out)!r}), {layers}, {vocab}, {seed}, force={force}); "
            "sys.exit(10 if built else 0)")
    rc = subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode
    if rc not in (0, 10):
        raise RuntimeError(f"the model build failed (exit status {rc})")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return time.perf_counter() - t0, rc == 10, peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paper_shape", description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=sorted(VARIANTS), default="ddp",
                        help="the learner's strategy: ddp (the paper configs' own, with the reference model, at "
                             f"{VARIANTS['ddp']['layers']} layers) or fsdp (the full 24 layers)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: the variant's; Qwen2.5-0.5B has 24)")
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB,
                        help=f"embedding rows (default {DEFAULT_VOCAB}, what fits 24 GiB; Qwen2.5-0.5B has 151936; "
                             "at least the tokenizer's)")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the model is built (default: artifacts/qwen2.5-0.5b-shape[-lN][-vV])")
    parser.add_argument("--runs-root", type=Path, default=RUNS_ROOT, help="parent of the run directory")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep the run's checkpoints after a pass (about 19 GB; a failed run always keeps them)")
    parser.add_argument("--timeout-min", type=float, default=25.0, help="minutes each of the two runs may take")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the model even if a build with its key exists")
    parser.add_argument("overrides", nargs="*", help="extra dotted config overrides for run 1 (e.g. inference.kv_cache_gib=0.2)")
    args = parser.parse_args(argv)
    if args.layers is None:
        args.layers = VARIANTS[args.strategy]["layers"]
    os.chdir(REPO)
    try:
        return _run(args)
    except Exception as e:  # noqa: BLE001 - whatever broke, the last line says so
        import traceback

        traceback.print_exc()
        print(f"paper-shape: FAILED {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
        return 1


def _run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    checks = Checks()

    from ragen_async.config import dump_config, load_config
    from ragen_async.records.rundir import verify_checkpoint

    # --- 1. the model
    model_dir = args.model_dir or model_dir_for(args.layers, args.vocab)
    build_s, built, build_rss = build_in_subprocess(model_dir, args.layers, args.vocab, args.seed, args.rebuild)
    info = json.loads((model_dir / BUILD_INFO).read_text())

    variant = VARIANTS[args.strategy]
    overrides = [f"model.path={model_dir}", f"total_steps={FIRST_RUN_STEPS}", *variant["overrides"], *args.overrides]
    cfg = load_config(CONFIG, overrides)
    tol = PROBE_TOLERANCE[cfg.model.dtype]
    log(f"config: {CONFIG} (inherits configs/paper/starpo_s_bandit.yaml) + {' '.join(overrides)}")
    log(f"config: {cfg.algo.adv_estimator} with critic={cfg.algo.use_critic}, filter {cfg.algo.filter_mode} "
        f"{cfg.algo.filter_ratio}, {cfg.rollout.groups_per_step} group x {cfg.rollout.group_size} episodes, "
        f"replies <= {cfg.agent.max_tokens_per_turn} tokens, k = {cfg.staleness.max_staleness}, "
        f"lr {cfg.learner.actor_lr}/{cfg.learner.critic_lr}, {cfg.model.dtype}, {cfg.learner.num_ranks} ranks "
        f"{cfg.learner.strategy} over {cfg.learner.backend}, {cfg.rollout.num_workers} rollout actor "
        f"(vLLM, {cfg.inference.kv_cache_gib} GiB KV), verify_every {cfg.weight_sync.verify_every}")
    run_dir = args.runs_root / f"{info['cache_key']}-{time.strftime('%Y%m%d-%H%M%S')}"
    timeout = args.timeout_min * 60

    # --- 2. run 1: 2 steps and a checkpoint
    run1 = run_phase("run 1", ["train", str(CONFIG), *overrides, "--run-dir", str(run_dir)], run_dir, timeout)
    checks("run 1 keeps a memory margin", not run1.watch.memory_stop, run1.watch.memory_stop or
           f"peak {_gib(run1.watch.peak_total_pss)} (PSS) of {_gib(psutil_total())}")
    steps1, _ = read_records(run_dir)
    reached1 = max((int(r["learner/step"]) for r in steps1), default=0)
    checks("run 1 exits 0 and reaches step 2", run1.rc == 0 and reached1 == FIRST_RUN_STEPS,
           f"exit status {run1.rc}{', timed out' if run1.timed_out else ''}, last step {reached1}")
    ckpt1 = run_dir / "checkpoints" / f"step_{FIRST_RUN_STEPS:06d}"
    problem = verify_checkpoint(ckpt1) if (ckpt1 / "COMPLETE").is_file() else "no COMPLETE marker"
    needed = ["driver_state.json", *(f"learner_rank{r}.pt" for r in range(cfg.learner.num_ranks))]
    missing = [n for n in needed if not (ckpt1 / n).is_file()]
    if problem is None and not list((ckpt1 / "actor").glob("*.safetensors")):
        missing.append("actor/*.safetensors")
    ckpt_bytes = sum(p.stat().st_size for p in ckpt1.rglob("*") if p.is_file()) if ckpt1.is_dir() else 0
    checks("a complete checkpoint of step 2 exists", problem is None and not missing,
           f"{ckpt1}: {problem or ('missing ' + ', '.join(missing) if missing else 'manifest verified')}, "
           f"{_gib(ckpt_bytes)}")

    # --- 3. run 2: --resume for 1 more step
    run2: Phase | None = None
    steps: list[dict[str, Any]] = steps1
    if not checks.failed:
        saved = run_dir / "config.yaml"
        saved_cfg = load_config(saved)
        saved.write_text(dump_config(saved_cfg.model_copy(update={"total_steps": TOTAL_STEPS})))
        log(f"run 2: {saved}: total_steps {saved_cfg.total_steps} -> {TOTAL_STEPS}")
        run2 = run_phase("run 2 (resume)", ["train", "--resume", str(run_dir)], run_dir, timeout)
        checks("run 2 keeps a memory margin", not run2.watch.memory_stop, run2.watch.memory_stop or
               f"peak {_gib(run2.watch.peak_total_pss)} (PSS) of {_gib(psutil_total())}")
        steps, _ = read_records(run_dir)
        reached2 = max((int(r["learner/step"]) for r in steps), default=0)
        kept = [r for r in steps if r["learner/step"] <= FIRST_RUN_STEPS] == steps1
        third = [r for r in steps if r["learner/step"] == TOTAL_STEPS]
        checks("run 2 resumes from the checkpoint and reaches step 3",
               run2.rc == 0 and reached2 == TOTAL_STEPS and kept and len(third) == 1
               and third[0].get("policy_version") == TOTAL_STEPS,
               f"exit status {run2.rc}{', timed out' if run2.timed_out else ''}, last step {reached2}, steps 1-2 "
               f"{'kept' if kept else 'rewritten (started over?)'}, step 3 at policy version "
               f"{third[0].get('policy_version') if third else None}")

    # --- 4. every weight sync verified
    diffs = {int(r["learner/step"]): r.get("weight_sync/probe_max_abs_diff") for r in steps}
    want = TOTAL_STEPS if run2 is not None else FIRST_RUN_STEPS
    bad = {s: d for s, d in diffs.items() if d is None or not math.isfinite(d) or d > tol}
    shown = ", ".join(f"step {s}: {'absent' if d is None else f'{d:.2e}'}" for s, d in sorted(diffs.items()))
    checks(f"every weight sync's probe agrees within {tol:g} ({cfg.model.dtype})",
           len(diffs) == want and not bad, shown or "no step records")

    # --- 5. the paths of the paper's learner that a one-shard, one-pass step never takes
    for name, ok, detail in learner_path_checks(steps, cfg):
        checks(name, ok, detail)

    # --- 6. the actor moved
    final = run_dir / "checkpoints" / f"step_{max(diffs, default=0):06d}" / "actor"
    if final.is_dir():
        share, n, dtypes = weights_moved(model_dir, final)
        checks(f"the actor's weights moved (> {MOVED_MIN:.0%} differ from the base)", share > MOVED_MIN,
               f"{share:.2%} of {n / 1e6:.1f} M weights differ in {final.parent.name} "
               f"(stored as {', '.join(f'{k} {v / 1e6:.1f} M' for k, v in dtypes.items())})")
    else:
        checks("the actor's weights moved", False, f"no checkpointed actor at {final}")

    # --- figures
    total_s = time.perf_counter() - t_start
    phases = [p for p in (run1, run2) if p is not None]
    log(f"time: model {'build' if built else 'reuse'} {build_s:.1f} s (peak RSS {_gib(build_rss)})" + "".join(
        f"; {p.name} {p.wall_s:.1f} s" for p in phases) + f"; total {total_s:.1f} s")
    for p in phases:
        for line in engine_startup(run_dir, p):
            log(f"  {p.name}: engine {line}")
        if p.watch.records_seen:
            first = min(p.watch.records_seen)
            log(f"  {p.name}: start to step {first}'s record {p.watch.records_seen[first]:.1f} s "
                "(Ray, engine and learner start-up, rollout, the step itself)")
        for step, (staged, done) in sorted(p.watch.ckpt_seen.items()):
            if math.isnan(staged):  # an earlier run's
                continue
            log(f"  {p.name}: checkpoint of step {step}: written in ~{done - staged:.1f} s (staging seen at "
                f"+{staged:.1f} s, complete at +{done:.1f} s)")
    _, vals = read_records(run_dir)
    if vals:
        log("  validation (" + ", ".join(f"step {int(v['learner/step'])}: {v['timing/val_s']:.1f} s" for v in vals) + ")")
    for r in steps:
        g = r.get
        log(f"  step {int(r['learner/step'])}: {g('timing/step_s', math.nan):.1f} s = wait for the batch "
            f"{g('timing/wait_batch_s', math.nan):.1f} s + learner {g('timing/train_s', math.nan):.1f} s (compute "
            f"{g('timing/learner_compute_s', math.nan):.1f} s: recompute {g('timing/learner_recompute_s', math.nan):.1f}, "
            f"update {g('timing/learner_update_s', math.nan):.1f}) + weight sync {g('weight_sync/time_s', math.nan):.1f} s; "
            f"{int(g('learner/num_tokens', 0))} tokens, reward {g('rollout/reward_mean', math.nan):.2f}")
    for p in phases:
        print_memory(p)
    peak_total = max(p.watch.peak_total_pss for p in phases)
    top = max((s for p in phases for s in p.watch.procs.values()), key=lambda s: s.peak_rss, default=None)
    step_times = "/".join(f"{r['timing/step_s']:.0f}" for r in steps)
    bits = {r.get("learner/compute_bits") for r in steps}
    computed = "/".join(COMPUTE_NAMES.get(b, str(b)) for b in sorted(bits, key=str))
    verify = [r["weight_sync/verify_s"] for r in steps if "weight_sync/verify_s" in r]
    variant_line = (f"{cfg.learner.strategy} over {cfg.learner.backend}, {cfg.learner.num_ranks} ranks, {args.layers} "
                    f"layers, compute {computed} (model.dtype {cfg.model.dtype}), byte-exact weight check "
                    f"{max(verify, default=math.nan):.1f} s at most; checks: {', '.join(checks.passed)}")
    figures = (f"{variant_line} | total {total_s / 60:.1f} min (model {build_s:.0f} s, " +
               ", ".join(f"{p.name.split(' (')[0]} {p.wall_s:.0f} s" for p in phases) +
               f"), steps {step_times} s, peak memory {_gib(peak_total)} PSS total, max per process "
               f"{_gib(top.peak_rss) if top else '?'} RSS ({top.label if top else '?'}); "
               f"{info['parameter_count'] / 1e6:.0f} M parameters, {args.layers} layers, vocabulary {args.vocab}; "
               f"run {run_dir}")
    if total_s > BUDGET_S:
        log(f"note: {total_s / 60:.1f} min is over the {BUDGET_S / 60:.0f}-minute budget of `make paper-shape`")
    if checks.failed:  # a failed run keeps everything, for a look
        print(f"paper-shape: FAILED {'; '.join(checks.failed)} | {figures}", flush=True)
        return 1
    if not args.keep_checkpoints:  # two checkpoints of fp32 masters and AdamW state: about 19 GB a pass
        freed = sum(p.stat().st_size for p in (run_dir / "checkpoints").rglob("*") if p.is_file())
        shutil.rmtree(run_dir / "checkpoints")
        log(f"removed the run's checkpoints ({_gib(freed)}; --keep-checkpoints keeps them)")
    print(f"paper-shape: OK {figures}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
