"""The learner alone on one device (``ragen-async bench learner``): what a StarPO-S step costs.

One rank's share of a paper-scale step (RAGEN's Sokoban config: 8 groups x 16 episodes, the top quarter
kept, four ranks: 8 trajectories of up to 4,000 tokens per rank) is built from synthetic groups
(:func:`~ragen_async.bench.components.synthetic_group`, random token ids) and trained with the
project's :class:`~ragen_async.learner.learner.Learner` (actor and critic, GAE), a few warm-up steps
and then timed steps. A setting is a compute dtype (``model.dtype``: the learner keeps fp32 masters either
way, ``learner/precision.py``) and activation checkpointing on or off. Per setting it reports the median step
time, tokens per second, peak device memory, how far the first step's update of the master weights (at the
paper's lr, 1e-6) is from the float32 setting's (``||u - u_fp32|| / ||u_fp32||``, and the share of weights it
moved: rounding that swallows updates shows as a share far below 1) and the model FLOPs utilisation:

    MFU = 6 * N * T * M / step time / peak,

N parameters, T tokens per step, M trained models (actor and critic); the recompute forwards and
attention are not counted, so MFU understates the work done. ``peak`` is a bf16 matrix product's rate
measured on the device (an H200: about 790 TFLOP/s); on a CPU MFU is not reported.

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
from ragen_async.config import load_config

QWEN_0_5B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151_936, "max_position_embeddings": 32_768,
             "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6}
"""Qwen2.5-0.5B's architecture (its config.json), for a model of its shape with random weights."""
H200_BF16_PEAK = 790e12
"""An 8192^3 bf16 matrix product through PyTorch on the lent H200, as measured there (788 TFLOP/s on random
data): MFU's denominator."""
PAPER_CONFIG = "configs/paper/starpo_s_sokoban.yaml"


@dataclass(frozen=True)
class LearnerRow:
    shape: str
    device: str
    dtype: str
    compute_dtype: str
    checkpointing: bool
    parameters: int
    trajectories: int
    tokens_per_step: int
    step_s: float
    tokens_per_s: float
    peak_memory_gib: float
    mfu: float
    moved_frac: float
    update_vs_fp32: float


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
    from ragen_async.buffer import TrajectoryBuffer

    groups = [synthetic_group(shape, i, vocab=vocab) for i in range(math.ceil(trajectories / shape.trajectories))]
    buffer = TrajectoryBuffer(len(groups), max_staleness=None, filter_mode="none", filter_ratio=1.0,
                              norm_mode=cfg.algo.grpo_norm)
    for g in groups:
        buffer.add(g, 0, 0.0)
    return buffer.next_batch(0, 0, 0.0).shards[0]


def _master_vector(learner):
    import torch

    return torch.cat([p.detach().float().flatten() for p in learner.actor.parameters()])


def bench_learner(shape: str = "qwen0.5b", device: str = "cuda", checkpointing: tuple[bool, ...] = (False, True),
                  steps: int = 5, warmup: int = 2, trajectories: int = 8, tiny_model: str = "artifacts/tiny-model",
                  peak_flops: float = H200_BF16_PEAK, on_row=None,
                  dtypes: tuple[str, ...] = ("bfloat16",)) -> list[LearnerRow]:
    """Time the learner's step per ``dtypes`` x ``checkpointing`` setting; ``on_row`` sees each row as it is
    measured. The update comparison needs float32 among ``dtypes`` (first, or it is NaN until then)."""
    import torch

    from ragen_async.learner.learner import Learner

    rows = []
    fp32_update: dict[bool, torch.Tensor] = {}
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
            learner = Learner(cfg, device=device)
            shard = make_shard(group_shape, trajectories, vocab, cfg)
            n_params = sum(p.numel() for p in learner.actor.parameters())
            before, update = _master_vector(learner), None
            models = 1 + (learner.critic is not None)
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            times, tokens = [], 0
            for i in range(warmup + steps):
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                metrics = learner.train_step(shard).metrics
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                if i == 0:
                    update = _master_vector(learner).sub_(before)
                    del before
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                    tokens = int(metrics["learner/num_tokens"])
            step_s = statistics.median(times)
            on_gpu = device.startswith("cuda")
            if dtype == "float32":
                fp32_update[ckpt] = update
            ref = fp32_update.get(ckpt)
            versus = math.nan if ref is None else float((update - ref).norm() / ref.norm())
            row = LearnerRow(
                shape=shape, device=device, dtype=dtype, compute_dtype=str(learner.compute_dtype).removeprefix("torch."),
                checkpointing=ckpt, parameters=n_params, trajectories=trajectories,
                moved_frac=float((update != 0).float().mean()), update_vs_fp32=versus,
                tokens_per_step=tokens, step_s=step_s, tokens_per_s=tokens / step_s,
                peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if on_gpu else math.nan,
                mfu=6 * n_params * tokens * models / step_s / peak_flops if on_gpu else math.nan)
            rows.append(row)
            if on_row is not None:
                on_row(row)
            del learner, update
            if on_gpu:
                torch.cuda.empty_cache()
    return rows


def format_table(rows: list[LearnerRow]) -> str:
    lines = ["| shape | device | model.dtype (compute) | activation checkpointing | parameters | tokens/step | step (s) | "
             "tokens/s | peak memory (GiB) | MFU | weights moved by step 1 | update vs float32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = "—" if math.isnan(r.mfu) else f"{100 * r.mfu:.1f} %"
        mem = "—" if math.isnan(r.peak_memory_gib) else f"{r.peak_memory_gib:.1f}"
        versus = "—" if math.isnan(r.update_vs_fp32) else f"{r.update_vs_fp32:.3f}"
        lines.append(f"| {r.shape} | {r.device} | {r.dtype} ({r.compute_dtype}) | {'on' if r.checkpointing else 'off'} | "
                     f"{r.parameters / 1e6:.1f} M | {r.tokens_per_step} | {r.step_s:.3f} | {r.tokens_per_s:,.0f} | {mem} | "
                     f"{mfu} | {100 * r.moved_frac:.1f} % | {versus} |")
    return "\n".join(lines)


def rows_json(rows: list[LearnerRow]) -> list[dict]:
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(r).items()} for r in rows]
