"""The learner alone on one device (``ragen-async bench learner``): what a StarPO-S step costs.

One rank's share of a paper-scale step (RAGEN's Sokoban config: 8 groups x 16 episodes, the top quarter
kept, four ranks: 8 trajectories of up to 4,000 tokens per rank) is built from synthetic groups
(:func:`~ragen_async.bench.components.synthetic_group`, random token ids) and trained with the
project's :class:`~ragen_async.learner.learner.Learner` (actor and critic, GAE), a few warm-up steps
and then timed steps. A setting is a compute dtype (``model.dtype``: the learner keeps fp32 masters either
way, ``learner/precision.py``) and activation checkpointing on or off. Per setting it reports the median step
time, tokens per second, peak device memory, how far the first step's update of the master weights (at the
paper's lr, 1e-6) is from the float32 setting's (``||u - u_fp32|| / ||u_fp32||``, and the share of weights it
moved: rounding that swallows updates shows as a share far below 1) and the FLOPs utilisation:

    MFU = model FLOPs per step / step time / peak,    HFU = (model + recompute FLOPs) / step time / peak,

FLOPs counted by torchtitan's formula over every pass of the step, as a training run counts them for its
``learner/mfu`` (:mod:`ragen_async.learner.flops`, through :mod:`ragen_async.bench.flops`: 6·N per token with N
every parameter but the embedding, plus the attention term; activation checkpointing's recompute counted
apart). Two peaks: the device's dense datasheet peak in the compute dtype, named in the row
(:func:`~ragen_async.learner.flops.device_peak`: H100, H200, A100; none on a CPU or another GPU: "no peak: MFU
not computed") and, beside it, the rate of a large matmul in the compute dtype timed in the same run
(:func:`matmul_peak`: 8192³ on a GPU, 1024³ on a CPU).

The model is a Qwen2.5-0.5B-shaped one with random weights (``--shape qwen0.5b``; 0.49 B parameters,
written once in bf16 to a temporary directory) or the tiny model (``--shape tiny``: the CPU dry run of
``scripts/device_check.sh``, and float32 beside bfloat16 compute on a CPU).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ragen_async.bench.components import PAPER, GroupShape, synthetic_group
from ragen_async.bench.flops import NO_PEAK, StepPlan, device_peak, dims_of, learner_step_flops
from ragen_async.config import load_config

QWEN_0_5B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151_936, "max_position_embeddings": 32_768,
             "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6}
"""Qwen2.5-0.5B's architecture (its config.json), for a model of its shape with random weights."""
PAPER_CONFIG = "configs/paper/starpo_s_sokoban.yaml"


@dataclass(frozen=True)
class LearnerRow:
    shape: str
    device: str
    device_name: str
    """``torch.cuda.get_device_name()`` on a GPU, ``cpu`` otherwise."""
    dtype: str
    compute_dtype: str
    checkpointing: bool
    parameters: int
    trajectories: int
    tokens_per_step: int
    """Real tokens of the step's trajectories (padding not counted): what the FLOPs are counted over."""
    trained_tokens_per_step: int
    step_s: float
    tokens_per_s: float
    peak_memory_gib: float
    model_tflop: float
    """Model FLOPs per step (``flops.learner_step_flops``), in TFLOP."""
    recompute_tflop: float
    spec_peak_tflops: float | None
    """The device's dense datasheet peak in the compute dtype; None on a CPU or a GPU not in the table."""
    peak: str
    """The peak MFU divides by, named with its source (``learner.flops.Peak``), or "no peak: MFU not computed"."""
    matmul_tflops: float
    """A large matmul's rate in the compute dtype, timed in this run."""
    mfu: float | None
    """Model FLOPs / step time / datasheet peak; None where there is no peak."""
    hfu: float | None
    mfu_vs_matmul: float
    moved_frac: float
    update_vs_fp32: float
    error: str | None = None
    """Why the setting has no figures (e.g. out of memory); None when it ran."""


def random_qwen(out: Path, dtype: str = "bfloat16") -> Path:
    """A Qwen2.5-0.5B-shaped causal LM with random weights, saved to ``out`` (no tokenizer: the learner needs none)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN_0_5B), dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    return out


def make_shard(shape: GroupShape, trajectories: int, vocab: int, cfg):
    """One rank's batch: ``trajectories`` synthetic trajectories of ``shape`` through the real buffer."""
    from ragen_async.staleness.buffer import TrajectoryBuffer

    groups = [synthetic_group(shape, i, vocab=vocab) for i in range(math.ceil(trajectories / shape.trajectories))]
    buffer = TrajectoryBuffer(len(groups), max_staleness=None, filter_mode="none", filter_ratio=1.0,
                              norm_mode=cfg.algo.grpo_norm, consume="arrival")
    for g in groups:
        buffer.add(g, 0, 0.0)
    return buffer.next_batch(0, 0, 0.0).shards[0]


def step_plan(learner, shard) -> StepPlan:
    """What ``learner.train_step(shard)`` runs (as ``Learner.train_step`` plans it; a test checks this against
    the passes the learner's models actually see)."""
    from ragen_async.learner.batch import collate_shard

    lc = learner.cfg.learner
    batch = collate_shard(shard, learner.pad_id, "cpu")
    n_mini = max(1, round(shard.batch_num_seqs / lc.mini_batch_size))
    single = lc.epochs == 1 and n_mini == 1
    return StepPlan(lengths=tuple(int(n) for n in batch.lengths), epochs=lc.epochs, actor_old_logprobs=not single,
                    critic=learner.critic is not None,
                    critic_old_values=not (single and getattr(learner, "critic_values_from_update", False)),
                    reference=learner.ref is not None, checkpointing=learner.cfg.model.gradient_checkpointing)


def matmul_peak(device: str, dtype, n: int | None = None, repeats: int | None = None) -> float:
    """FLOP/s of an ``n``³ matmul in ``dtype`` on ``device`` (default 8192 on a GPU, 1024 on a CPU): the best of
    ``repeats`` timed products after a warm-up, as PyTorch runs it (TF32 only where the process allows it)."""
    import torch

    on_gpu = device.startswith("cuda")
    n = n or (8192 if on_gpu else 1024)
    repeats = repeats or (20 if on_gpu else 5)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    for _ in range(3):
        a @ b
    best = math.inf
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    del a, b
    return 2 * n**3 / best


def _master_vector(learner):
    import torch

    return torch.cat([p.detach().float().flatten() for p in learner.actor.parameters()])


def _failed_row(shape, device, device_name, dtype, ckpt, trajectories, error: str) -> LearnerRow:
    nan = math.nan
    return LearnerRow(shape=shape, device=device, device_name=device_name, dtype=dtype, compute_dtype="?",
                      checkpointing=ckpt, parameters=0, trajectories=trajectories, tokens_per_step=0,
                      trained_tokens_per_step=0, step_s=nan, tokens_per_s=nan, peak_memory_gib=nan, model_tflop=nan,
                      recompute_tflop=nan, spec_peak_tflops=None, peak=NO_PEAK, matmul_tflops=nan, mfu=None, hfu=None,
                      mfu_vs_matmul=nan, moved_frac=nan, update_vs_fp32=nan, error=error)


def bench_learner(shape: str = "qwen0.5b", device: str = "cuda", checkpointing: tuple[bool, ...] = (False, True),
                  steps: int = 5, warmup: int = 2, trajectories: int = 8, tiny_model: str = "artifacts/tiny-model",
                  on_row=None, dtypes: tuple[str, ...] = ("bfloat16",)) -> list[LearnerRow]:
    """Time the learner's step per ``dtypes`` x ``checkpointing`` setting; ``on_row`` sees each row as it is
    measured. The update comparison needs float32 among ``dtypes`` (first, or it is NaN until then). A setting
    that runs out of device memory gives a row with ``error`` set and the others still run."""
    import torch

    from ragen_async.learner.learner import Learner

    rows = []
    fp32_update: dict[bool, torch.Tensor] = {}
    on_gpu = device.startswith("cuda")
    device_name = torch.cuda.get_device_name(torch.device(device)) if on_gpu else "cpu"
    matmul: dict[torch.dtype, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if shape == "qwen0.5b":
            model_path, group_shape = str(random_qwen(Path(tmp) / "qwen")), PAPER
        elif shape == "tiny":
            model_path = tiny_model
            group_shape = GroupShape("tiny", 8, prompt_tokens=300, turns=5, reply_tokens=30, feedback_tokens=60)
        else:
            raise ValueError(f"unknown shape {shape!r}; choose qwen0.5b or tiny")
        vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
        for dtype, ckpt in [(d, c) for d in dtypes for c in checkpointing]:
            cfg = load_config(PAPER_CONFIG, [f"model.path={model_path}", f"model.dtype={dtype}",
                                             f"model.gradient_checkpointing={str(ckpt).lower()}", "learner.num_ranks=1"])
            learner = None
            try:
                learner = Learner(cfg, device=device)
                row = _measure(learner, cfg, shape, device, device_name, dtype, ckpt, trajectories, group_shape,
                               vocab, steps, warmup, matmul, fp32_update)
            except torch.OutOfMemoryError as e:
                row = _failed_row(shape, device, device_name, dtype, ckpt, trajectories,
                                  f"out of memory ({str(e).splitlines()[0][:120]})")
            rows.append(row)
            if on_row is not None:
                on_row(row)
            del learner
            if on_gpu:
                torch.cuda.empty_cache()
    return rows


def _measure(learner, cfg, shape, device, device_name, dtype, ckpt, trajectories, group_shape, vocab, steps, warmup,
             matmul, fp32_update) -> LearnerRow:
    import torch

    on_gpu = device.startswith("cuda")
    shard = make_shard(group_shape, trajectories, vocab, cfg)
    plan = step_plan(learner, shard)
    flops = learner_step_flops(dims_of(learner.actor), dims_of(learner.critic) if learner.critic is not None else None,
                               plan)
    n_params = sum(p.numel() for p in learner.actor.parameters())
    before, update = _master_vector(learner), None
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    times, trained = [], 0
    for i in range(warmup + steps):
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = learner.train_step(shard).metrics
        if on_gpu:
            torch.cuda.synchronize()
        if i == 0:
            update = _master_vector(learner).sub_(before)
            del before
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            trained = int(metrics["learner/num_tokens"])
    step_s = statistics.median(times)
    peak_memory = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else math.nan
    if dtype == "float32":
        fp32_update[ckpt] = update
    ref = fp32_update.get(ckpt)
    versus = math.nan if ref is None else float((update - ref).norm() / ref.norm())
    moved = float((update != 0).float().mean())
    del update
    compute = learner.compute_dtype
    if compute not in matmul:  # measured after the setting's steps, with its memory still held
        matmul[compute] = matmul_peak(device, compute)
    name = str(compute).removeprefix("torch.")
    peak = device_peak(device_name if on_gpu else None, name, tf32=on_gpu and torch.backends.cuda.matmul.allow_tf32)
    spec = None if peak is None else peak.flops
    tokens = sum(plan.lengths)
    return LearnerRow(
        shape=shape, device=device, device_name=device_name, dtype=dtype, compute_dtype=name, checkpointing=ckpt,
        parameters=n_params, trajectories=trajectories, tokens_per_step=tokens, trained_tokens_per_step=trained,
        step_s=step_s, tokens_per_s=tokens / step_s, peak_memory_gib=peak_memory,
        model_tflop=flops.model / 1e12, recompute_tflop=flops.recompute / 1e12,
        spec_peak_tflops=None if spec is None else spec / 1e12, peak=NO_PEAK if peak is None else str(peak),
        matmul_tflops=matmul[compute] / 1e12,
        mfu=None if spec is None else flops.model / step_s / spec,
        hfu=None if spec is None else flops.hardware / step_s / spec,
        mfu_vs_matmul=flops.model / step_s / matmul[compute], moved_frac=moved, update_vs_fp32=versus)


def _pct(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f} %"


def format_table(rows: list[LearnerRow]) -> str:
    lines = ["| shape | device | model.dtype (compute) | activation checkpointing | parameters | tokens/step (trained) | "
             "step (s) | tokens/s | peak memory (GiB) | TFLOP/step: model + recompute | MFU (datasheet peak) | "
             "HFU (datasheet peak) | MFU (matmul peak) | weights moved by step 1 | update vs float32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.error is not None:
            lines.append(f"| {r.shape} | {r.device_name} | {r.dtype} | {'on' if r.checkpointing else 'off'} | "
                         f"{r.error} |" + " |" * 10)
            continue
        mem = "—" if math.isnan(r.peak_memory_gib) else f"{r.peak_memory_gib:.1f}"
        versus = "—" if math.isnan(r.update_vs_fp32) else f"{r.update_vs_fp32:.3f}"
        spec = r.peak if r.spec_peak_tflops is None else f"{_pct(r.mfu)} of {r.spec_peak_tflops:g}"
        lines.append(f"| {r.shape} | {r.device_name} | {r.dtype} ({r.compute_dtype}) | {'on' if r.checkpointing else 'off'} | "
                     f"{r.parameters / 1e6:.1f} M | {r.tokens_per_step} ({r.trained_tokens_per_step}) | {r.step_s:.3f} | "
                     f"{r.tokens_per_s:,.0f} | {mem} | {r.model_tflop:.4g} + {r.recompute_tflop:.4g} | "
                     f"{spec} | {_pct(r.hfu)} | {_pct(r.mfu_vs_matmul)} of {r.matmul_tflops:.4g} | "
                     f"{100 * r.moved_frac:.1f} % | {versus} |")
    return "\n".join(lines)


def rows_json(rows: list[LearnerRow]) -> list[dict]:
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(r).items()} for r in rows]


FIRST_UPDATE_MOVED = 0.99
"""The share of master weights a reduced-precision setting's first update at lr 1e-6 must move."""
FIRST_UPDATE_GAP = 0.35
"""How far (relative norm) that update may lie from float32's."""


def _setting(r: dict) -> str:
    return f"{r['dtype']}, checkpointing {'on' if r['checkpointing'] else 'off'}"


def mfu_verdict(rows: list[dict]) -> tuple[bool, str]:
    """(every dtype measured in at least one setting, the ``VERDICT mfu: ...`` line) from :func:`rows_json`'s rows."""
    parts = []
    for r in rows:
        if r.get("error"):
            parts.append(f"{_setting(r)}: {r['error']}")
            continue
        spec = (f"n/a ({r['peak']})" if r["mfu"] is None else
                f"{100 * r['mfu']:.1f} % of the peak, {r['peak']} (HFU {100 * r['hfu']:.1f} %)")
        parts.append(f"{_setting(r)} ({r['compute_dtype']} compute): MFU {spec}, {100 * r['mfu_vs_matmul']:.1f} % "
                     f"of the {r['matmul_tflops']:.4g} TFLOP/s timed matmul")
    measured = {r["dtype"] for r in rows if not r.get("error")}
    ok = bool(rows) and measured == {r["dtype"] for r in rows}
    where = rows[0]["device_name"] if rows else "?"
    return ok, f"VERDICT mfu: {'measured' if ok else 'no'} on {where} ({'; '.join(parts) or 'no rows'})"


def first_update_verdict(rows: list[dict]) -> tuple[bool, str]:
    """(every reduced-precision setting's first update moved > FIRST_UPDATE_MOVED of the weights within
    FIRST_UPDATE_GAP of float32's, the ``VERDICT first_update: ...`` line)."""
    mixed = [r for r in rows if r["dtype"] != "float32" and not r.get("error")]
    compared = [r for r in mixed if r["update_vs_fp32"] is not None]
    parts, ok = [], bool(compared)
    for r in mixed:
        gap = r["update_vs_fp32"]
        if gap is None:  # its float32 setting did not run (out of memory): nothing to compare with
            parts.append(f"{_setting(r)}: no float32 update to compare with")
            continue
        ok &= r["moved_frac"] > FIRST_UPDATE_MOVED and gap <= FIRST_UPDATE_GAP
        parts.append(f"{_setting(r)} ({r['compute_dtype']} compute): moved {100 * r['moved_frac']:.1f} % of the "
                     f"weights, {gap:.3f} from float32's")
    rule = f"> {100 * FIRST_UPDATE_MOVED:g} % moved, <= {FIRST_UPDATE_GAP} from float32's at lr 1e-6"
    return ok, (f"VERDICT first_update: {'yes' if ok else 'no'} ({'; '.join(parts) or 'no reduced-precision row'}; "
                f"{rule})")
